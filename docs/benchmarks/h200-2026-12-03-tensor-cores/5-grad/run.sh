#!/usr/bin/env bash
# The Grad selector (prune --method grad) on Gated DeltaNet 1.3B at 32 x 2048 tokens: 25572d5 against 46d4e1c.
set -u
B=.dev/b40; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
GRAD_SAMPLES=32 BEFORE=1 bash scripts/gpu_bench.sh $B $R/gb grad:gdn_1p3b > $R/gb_grad.log 2>&1; cp /tmp/gpu_bench_results/grad_* $R/ 2>/dev/null; pack
tail -12 $R/gb_grad.log
