#!/usr/bin/env bash
# Call 13: where the time goes now. (1) ncu over the recurrence bench's forward + backward at the pruned
# DeltaNet 1.3B student's shape; (2) ncu over one DeltaNet 1.3B recovery step, --recompute all (as the
# 2026-12-03 profiles).
set -u
B=.dev/d; R=$OUT; mkdir -p $R
NCU="/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base"
xz -dc $B/recurrence.xz > /tmp/recurrence; chmod +x /tmp/recurrence
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
timeout 150 $NCU /tmp/recurrence --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu_mixer.csv 2> $R/ncu_mixer.err
echo "ncu mixer rc $?"; tail -2 $R/ncu_mixer.err
python3 scripts/kernel_times.py $R/ncu_mixer.csv --top 30 | tee $R/ncu_mixer.txt | head -45
M=delta_net_1p3b
RECOVER_REFERENCE=0 RECOVER_STEPS=1 bash scripts/gpu_bench.sh $B $R/x recover:$M > $R/recover.log 2>&1
tail -3 $R/recover.log
D=$B/shared/data/calib/wiki.jsonl
timeout 300 $NCU /tmp/statecut recover -m /tmp/ck/$M-rp50 --teacher /tmp/ck/$M --data $D --steps 1 --batch-size 16 --seqlen 2048 \
  --warmup 0 --device cuda --dtype bf16 --recompute all -q -o /tmp/ck/ncu-rec > $R/ncu_rec.csv 2> $R/ncu.err
echo "ncu rc $?"; tail -3 $R/ncu.err
python3 scripts/kernel_times.py $R/ncu_rec.csv --top 45 --json $R/ncu_rec_summary.json | tee $R/ncu_rec.txt | head -70
xz -9 $R/ncu_rec.csv $R/ncu_mixer.csv
rm -rf $R/x
