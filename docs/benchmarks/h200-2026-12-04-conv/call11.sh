#!/usr/bin/env bash
# ncu detail on the six tensor-core chunk kernels, DeltaNet 1.3B pruned shapes.
B=.dev/w; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
xz -dc $B/recurrence.xz > /tmp/rec; chmod +x /tmp/rec
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu=$NCU"
timeout 60 /tmp/rec --shape 16,2048,16,64,128 --decay none --iterations 3 --forms chunked-kernels > $R/mixer.jsonl 2>&1; cat $R/mixer.jsonl
timeout 400 $NCU --set full -k regex:'chunk_.*_tc' --launch-count 6 -o $R/chunk /tmp/rec --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu.log 2>&1; echo "ncu rc $?"
$NCU -i $R/chunk.ncu-rep --page details > $R/details.txt 2>&1
$NCU -i $R/chunk.ncu-rep --page raw --csv > $R/raw.csv 2>&1
xz -T4 $R/raw.csv
grep -E "^  chunk_|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Hit|Bank" $R/details.txt | head -150
