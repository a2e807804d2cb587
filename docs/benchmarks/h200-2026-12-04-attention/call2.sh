#!/usr/bin/env bash
# Call 2: ncu sections over the chunk kernels at the pruned DeltaNet 1.3B student's shape (one forward + backward).
B=.dev/h; R=$OUT; mkdir -p $R
xz -dc $B/recurrence.xz > /tmp/recurrence; chmod +x /tmp/recurrence
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
/tmp/recurrence --help 2>&1 | head -20
timeout 400 /usr/local/cuda/bin/ncu --clock-control none -k regex:chunk_ -c 7 \
  --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section InstructionStats --section SchedulerStats \
  /tmp/recurrence --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu_sections.txt 2> $R/ncu.err
echo "rc $?"; tail -3 $R/ncu.err; wc -l $R/ncu_sections.txt
grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Issue Slots Busy|No Eligible|Stall" $R/ncu_sections.txt | head -120
