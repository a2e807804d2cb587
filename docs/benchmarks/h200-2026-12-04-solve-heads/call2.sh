#!/usr/bin/env bash
# Call 2: parity on the fixtures, then recovery under --train-memory 45GiB (after only).
B=.dev/b2
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $OUT/$d; env "$@" 2>&1 | tee $OUT/$d/stdout.txt; }
step 2-parity bash scripts/gpu_bench.sh $B $OUT/2-parity parity
step 3-budget RECOVER_REFERENCE=0 RECOVER_STEPS=6 "RECOVER_ARGS=--train-memory 45GiB" bash scripts/gpu_bench.sh $B $OUT/3-budget recover:delta_net_1p3b recover:gdn_1p3b
