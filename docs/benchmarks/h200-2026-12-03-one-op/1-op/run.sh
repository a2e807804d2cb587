#!/usr/bin/env bash
# The recurrence as one op: parity; the mixer before (25572d5) and after, taking turns.
set -u
B=.dev/b41a; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
xz -dc $B/recurrence_before.xz > /tmp/recurrence_before && chmod +x /tmp/recurrence_before
bash scripts/gpu_bench.sh $B $R/gb parity > $R/gb_parity.log 2>&1; cp /tmp/gpu_bench_results/parity.log $R/parity_full.log 2>/dev/null; pack
grep -E "test result|FAILED|panicked" $R/gb_parity.log $R/parity_full.log | head -20
summ() { python3 -c 'import json,sys; print([ (json.loads(l)["form"], json.loads(l)["pass"], round(json.loads(l)["ms"],2)) for l in open(sys.argv[1])])' $1; }
for d in head none; do for round in 1 2; do
  order="after before"; [ $round = 2 ] && order="before after"
  for w in $order; do
    bin=/tmp/recurrence; [ $w = before ] && bin=/tmp/recurrence_before
    $bin --shape 16,2048,16,128,128 --decay $d --iterations 5 --forms chunked-kernels > $R/mixer_${w}_${d}_$round.jsonl 2>>$R/mixer.err
    echo "$d $round $w: $(summ $R/mixer_${w}_${d}_$round.jsonl)"
  done
done; done | tee $R/mixer.txt; pack
for w in after before; do
  bin=/tmp/recurrence; [ $w = before ] && bin=/tmp/recurrence_before
  $bin --shape 1,2048,8,256,512 --decay head --iterations 5 --forms chunked-kernels > $R/mixer_${w}_wide.jsonl 2>>$R/mixer.err
  echo "wide $w: $(summ $R/mixer_${w}_wide.jsonl)"
done | tee -a $R/mixer.txt; pack
