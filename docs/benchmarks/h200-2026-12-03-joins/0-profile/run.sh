#!/usr/bin/env bash
# Where the recurrence's forward + backward goes at e32e0ea: per-kernel GPU time in launch order, stage marks, nsys timeline summary.
set -u
B=.dev/b44; R=$OUT; mkdir -p $R
xz -dc $B/recurrence.xz > /tmp/recurrence; chmod +x /tmp/recurrence
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
for d in head none; do
  /tmp/recurrence --shape 16,2048,16,128,128 --decay $d --iterations 5 --forms chunked-kernels > $R/mixer_$d.jsonl 2>>$R/mixer.err
  cut -c1-100 $R/mixer_$d.jsonl
done
STATECUT_PROFILE=1 /tmp/recurrence --shape 16,2048,16,128,128 --decay head --iterations 5 --forms chunked-kernels > $R/prof_head.jsonl 2> $R/prof_head.txt
tail -30 $R/prof_head.txt
/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base /tmp/recurrence --shape 16,2048,16,128,128 --decay head --iterations 1 --forms chunked-kernels > $R/ncu_head.csv 2>$R/ncu.err
python3 scripts/kernel_times.py $R/ncu_head.csv --top 30 | tee $R/ncu_head.txt | head -45
NSYS=$(ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1); echo "nsys: $NSYS"
if [ -n "$NSYS" ]; then
  $NSYS profile -o $R/nsys_head -t cuda --force-overwrite true /tmp/recurrence --shape 16,2048,16,128,128 --decay head --iterations 3 --forms chunked-kernels > $R/nsys_run.txt 2>&1
  $NSYS stats -r cuda_gpu_kern_sum,cuda_api_sum $R/nsys_head.nsys-rep > $R/nsys_stats.txt 2>&1; head -60 $R/nsys_stats.txt
  $NSYS export -t sqlite -o $R/nsys_head.sqlite $R/nsys_head.nsys-rep > /dev/null 2>&1; rm -f $R/nsys_head.nsys-rep
fi
ls -la $R
