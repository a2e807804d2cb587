#!/usr/bin/env bash
# Keys' gradient joined in place, −dKc's sign in the solve's backward, o in the values' dtype:
# parity (fixtures in the checkout), the recurrence before (e32e0ea) and after taking turns, ncu.
set -u
B=.dev/b45; R=$OUT; mkdir -p $R
xz -dc $B/recurrence_before.xz > /tmp/recurrence_before && chmod +x /tmp/recurrence_before
bash scripts/gpu_bench.sh $B $R/gb parity > $R/gb_parity.log 2>&1; cp /tmp/gpu_bench_results/parity.log $R/parity_full.log 2>/dev/null
grep -E "^test |test result|FAILED|panicked" $R/parity_full.log | cut -c1-160 | head -30
summ() { python3 -c 'import json,sys; print([ (json.loads(l)["pass"], round(json.loads(l)["ms"],2)) for l in open(sys.argv[1])])' $1; }
for d in head none; do for round in 1 2; do
  order="after before"; [ $round = 2 ] && order="before after"
  for w in $order; do
    bin=/tmp/recurrence; [ $w = before ] && bin=/tmp/recurrence_before
    $bin --shape 16,2048,16,128,128 --decay $d --iterations 5 --forms chunked-kernels > $R/mixer_${w}_${d}_$round.jsonl 2>>$R/mixer.err
    echo "$d $w $round: $(summ $R/mixer_${w}_${d}_$round.jsonl)"
  done
done; done | tee $R/mixer_ab.txt
for w in after before; do
  bin=/tmp/recurrence; [ $w = before ] && bin=/tmp/recurrence_before
  $bin --shape 1,2048,8,256,512 --decay head --iterations 5 --forms chunked-kernels > $R/mixer_${w}_wide.jsonl 2>>$R/mixer.err
  echo "wide $w: $(summ $R/mixer_${w}_wide.jsonl)"
done | tee -a $R/mixer_ab.txt
/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base /tmp/recurrence --shape 16,2048,16,128,128 --decay head --iterations 1 --forms chunked-kernels > $R/ncu_head.csv 2>$R/ncu.err
python3 scripts/kernel_times.py $R/ncu_head.csv --top 30 > $R/ncu_head.txt; head -12 $R/ncu_head.txt
