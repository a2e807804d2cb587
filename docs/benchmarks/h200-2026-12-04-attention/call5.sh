#!/usr/bin/env bash
# Call 5: Qwen3.5-9B shapes, one batch of 16, 3 steps, with the memory trace of the keep rule.
B=.dev/k; R=$OUT; mkdir -p $R
export STATECUT_TRACE_MEMORY=1
RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/x recover:qwen3_5_9b > $R/run.log 2>&1
cp /tmp/gpu_bench_results/recover_statecut_qwen3_5_9b.log $R/trace.log
tail -3 $R/run.log
tr '\r' '\n' < $R/trace.log | grep -E "\[mem\] keep|FAILED|out of|recover|step" | head -20
tr '\r' '\n' < $R/trace.log | grep -c "\[mem\]"
rm -rf $R/x
