#!/usr/bin/env bash
# The recurrence as one op: recovery before (25572d5) and after; the Grad selector at
# GRAD_SAMPLES x 2048 in both orders. Stages as arguments: rec, grad (after then before),
# grad_swapped (before then after).
set -u
B=.dev/b41b; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
S=/tmp/swapped; mkdir -p $S
for f in whl tokenizer shared; do ln -sfn $PWD/$B/$f $S/$f; done
ln -sf $PWD/$B/statecut_before.xz $S/statecut.xz; ln -sf $PWD/$B/statecut.xz $S/statecut_before.xz
N=${GRAD_SAMPLES:-128}
for stage in "$@"; do case $stage in
rec)
  for m in gdn_1p3b delta_net_1p3b; do
    BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/rec recover:$m > $R/rec_${m}.log 2>&1
    cp /tmp/gpu_bench_results/recover_statecut_$m*.log $R/ 2>/dev/null
    echo "$m: $(grep -E 'tokens_per' $R/rec_${m}.log | cut -c1-220)"
    [ $m = gdn_1p3b ] && RECOVER_ARGS="--recompute all" RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/recall recover:$m > $R/rec_${m}_all.log 2>&1
    [ $m = gdn_1p3b ] && mkdir -p $R/all && cp /tmp/gpu_bench_results/recover_statecut_$m*.log $R/all/ 2>/dev/null
    [ $m = gdn_1p3b ] && echo "$m --recompute all: $(grep -E 'tokens_per' $R/rec_${m}_all.log | cut -c1-220)"
  done | tee -a $R/recover.txt; pack ;;
grad)
  GRAD_SAMPLES=$N BEFORE=1 bash scripts/gpu_bench.sh $B $R/g1 grad:gdn_1p3b > $R/grad_$N.log 2>&1
  mkdir -p $R/grad_$N; cp /tmp/gpu_bench_results/grad_* $R/grad_$N/ 2>/dev/null; pack; tail -8 $R/grad_$N.log ;;
grad_swapped)
  GRAD_SAMPLES=$N BEFORE=1 bash scripts/gpu_bench.sh $S $R/g2 grad:gdn_1p3b > $R/grad_${N}_swapped.log 2>&1
  mkdir -p $R/grad_${N}_swapped; cp /tmp/gpu_bench_results/grad_* $R/grad_${N}_swapped/ 2>/dev/null; pack; tail -8 $R/grad_${N}_swapped.log ;;
esac; done
