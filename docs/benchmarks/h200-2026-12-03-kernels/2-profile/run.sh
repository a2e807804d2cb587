#!/usr/bin/env bash
# Kernel times over one DeltaNet 1.3B recovery step (--recompute all), after.
set -u
B=.dev/b49; R=$OUT; mkdir -p $R; M=delta_net_1p3b
D=$B/shared/data/calib/wiki.jsonl
timeout 400 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  /tmp/statecut recover -m /tmp/ck/$M-rp50 --teacher /tmp/ck/$M --data $D --steps 1 --batch-size 16 --seqlen 2048 \
  --warmup 0 --device cuda --dtype bf16 --recompute all -q -o /tmp/ck/ncu-rec > $R/ncu_rec.csv 2> $R/ncu.err
echo "ncu rc $?"; tail -2 $R/ncu.err
python3 scripts/kernel_times.py $R/ncu_rec.csv --top 45 --json $R/ncu_rec_summary.json | tee $R/ncu_rec.txt | head -40
xz -9 $R/ncu_rec.csv
cd $R && tar czf /tmp/all.tgz . && rm -rf $R/* && mv /tmp/all.tgz $R/
