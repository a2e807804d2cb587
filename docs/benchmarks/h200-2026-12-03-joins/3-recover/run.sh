#!/usr/bin/env bash
# Recovery before (9de4a0f) and after, 6 steps each, --recompute auto (the default); the Grad
# selector at 128 x 2048 after then before (time and peak).
set -u
B=.dev/b46; R=$OUT; mkdir -p $R
for m in ${MODELS:-gdn_1p3b delta_net_1p3b}; do
  BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/gb recover:$m > $R/rec_${m}.log 2>&1
  for w in "" _before; do
    cp /tmp/gpu_bench_results/recover_statecut_$m$w.json $R/rec_${m}$w.json 2>/dev/null; cp /tmp/gpu_bench_results/recover_statecut_$m$w.log $R/rec_${m}${w}_statecut.log 2>/dev/null
    echo "$m${w:-_after}: steps $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print([round(s["seconds"],3) for s in r["history"]], [round(s["loss"],4) for s in r["history"]])' $R/rec_${m}$w.json 2>&1 | cut -c1-200)"
  done
  grep -E "peak_mib|tokens_per" $R/rec_${m}.log | cut -c1-200
done | tee $R/recover.txt
[ "${GRAD:-1}" = 1 ] || exit 0
GRAD_SAMPLES=128 BEFORE=1 bash scripts/gpu_bench.sh $B $R/gg grad:gdn_1p3b > $R/grad_128.log 2>&1
cp /tmp/gpu_bench_results/grad_* $R/ 2>/dev/null
grep -E "peak_mib|calibrate|wall" $R/grad_128.log | cut -c1-220 | head -12
