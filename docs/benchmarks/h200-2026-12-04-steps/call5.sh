#!/usr/bin/env bash
# Call 5: CUDA parity of this tree on the fixtures (the MLP step held to the ops it replaces), then where
# the time goes now: ncu over one DeltaNet 1.3B recovery step, --recompute all (as the earlier profiles).
set -u
B=.dev/t; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/gpu_parity
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|mlp step|largest" $R/parity.log | head -40
NCU="/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base"
M=delta_net_1p3b
[ -d /tmp/ck/$M-rp50 ] || { RECOVER_REFERENCE=0 RECOVER_STEPS=1 bash scripts/gpu_bench.sh $B $R/x recover:$M > $R/recover.log 2>&1; tail -3 $R/recover.log; }
xz -dc $B/statecut.xz > /tmp/statecut; chmod +x /tmp/statecut
D=$B/shared/data/calib/wiki.jsonl
timeout 300 $NCU /tmp/statecut recover -m /tmp/ck/$M-rp50 --teacher /tmp/ck/$M --data $D --steps 1 --batch-size 16 --seqlen 2048 \
  --warmup 0 --device cuda --dtype bf16 --recompute all -q -o /tmp/ck/ncu-rec > $R/ncu_rec.csv 2> $R/ncu.err
echo "ncu rc $?"; tail -3 $R/ncu.err
python3 scripts/kernel_times.py $R/ncu_rec.csv --top 45 --json $R/ncu_rec_summary.json | tee $R/ncu_rec.txt | head -60
xz -9 $R/ncu_rec.csv
rm -rf $R/x
