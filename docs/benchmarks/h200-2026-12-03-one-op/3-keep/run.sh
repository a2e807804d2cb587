#!/usr/bin/env bash
# The recurrence as one op: the mixer before (25572d5) and after, taking turns; recovery with
# --recompute auto and all, 6 steps, per-step seconds from each run's report.
set -u
B=.dev/b42; R=/tmp/res2; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
xz -dc $B/recurrence_before.xz > /tmp/recurrence_before && chmod +x /tmp/recurrence_before
xz -dc $B/recurrence.xz > /tmp/recurrence && chmod +x /tmp/recurrence
summ() { python3 -c 'import json,sys; print([ (json.loads(l)["form"], json.loads(l)["pass"], round(json.loads(l)["ms"],2)) for l in open(sys.argv[1])])' $1; }
for d in head none; do for round in 1 2; do
  order="after before"; [ $round = 2 ] && order="before after"
  for w in $order; do
    bin=/tmp/recurrence; [ $w = before ] && bin=/tmp/recurrence_before
    $bin --shape 16,2048,16,128,128 --decay $d --iterations 5 --forms chunked-kernels > $R/mixer_${w}_${d}_$round.jsonl 2>>$R/mixer.err
    echo "$d $round $w: $(summ $R/mixer_${w}_${d}_$round.jsonl)"
  done
done; done | tee $R/mixer.txt; pack
for m in gdn_1p3b delta_net_1p3b; do for how in all auto; do
  RECOVER_ARGS="--recompute $how" RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/gb recover:$m > $R/rec_${m}_$how.log 2>&1
  cp /tmp/gpu_bench_results/recover_statecut_$m.json $R/rec_${m}_$how.json; cp /tmp/gpu_bench_results/recover_statecut_$m.log $R/rec_${m}_${how}_statecut.log
  echo "$m $how: $(grep -E 'peak_mib' $R/rec_${m}_$how.log | cut -c1-120) steps $(python3 -c 'import json,sys; print([round(s["seconds"],3) for s in json.load(open(sys.argv[1]))["history"]])' $R/rec_${m}_$how.json)"
done; done | tee $R/recover.txt; pack
