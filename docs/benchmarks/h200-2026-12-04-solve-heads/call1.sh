#!/usr/bin/env bash
# Call 1: recovery before (db1fde3) and after (this tree), DeltaNet and Gated DeltaNet 1.3B, builds one after the other.
B=.dev/b1
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $OUT/$d; env "$@" 2>&1 | tee $OUT/$d/stdout.txt; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
step 1-recover BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $OUT/1-recover recover:delta_net_1p3b recover:gdn_1p3b
