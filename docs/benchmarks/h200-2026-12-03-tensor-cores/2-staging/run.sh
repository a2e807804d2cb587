#!/usr/bin/env bash
# Walk with asynchronous key copies, vectorised staging, 32-bit layout ops: parity, then the mixer A/B (this build vs 137f0dd, taking turns), fla.
set -u
B=.dev/b37; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
bash scripts/gpu_bench.sh $B $R/gb parity > $R/gb_parity.log 2>&1; pack
grep -E "test result|FAILED|panicked|bf16 values" $R/gb_parity.log | head -30
xz -dc $B/recurrence_before.xz > /tmp/recurrence_before; chmod +x /tmp/recurrence_before
for d in head none; do for round in 1 2; do for w in after before; do
  bin=/tmp/recurrence; [ $w = before ] && bin=/tmp/recurrence_before
  $bin --shape 16,2048,16,128,128 --decay $d --iterations 5 --forms chunked-kernels > $R/mixer_${w}_${d}_$round.jsonl 2>>$R/mixer.err
  echo "$d $w $round: $(python3 -c 'import json,sys; print([ (json.loads(l)["pass"], round(json.loads(l)["ms"],2)) for l in open(sys.argv[1])])' $R/mixer_${w}_${d}_$round.jsonl)"
done; done; done | tee $R/mixer_ab.txt; pack
/tmp/recurrence --shape 1,2048,8,256,512 --decay head --iterations 5 --forms chunked-kernels > $R/mixer_after_wide.jsonl 2>>$R/mixer.err
/tmp/recurrence_before --shape 1,2048,8,256,512 --decay head --iterations 5 --forms chunked-kernels > $R/mixer_before_wide.jsonl 2>>$R/mixer.err
cat $R/mixer_*_wide.jsonl | cut -c1-120
/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base /tmp/recurrence --shape 16,2048,16,128,128 --decay head --iterations 1 --forms chunked-kernels > $R/ncu_head.csv 2>/dev/null
python3 scripts/kernel_times.py $R/ncu_head.csv --top 25 | tee $R/ncu_head.txt | head -40; pack
