#!/usr/bin/env bash
# Call 7: Qwen3.5-9B shapes, 2 steps, the memory trace inside the attention op.
B=.dev/n; R=$OUT; mkdir -p $R
export STATECUT_TRACE_MEMORY=1
RECOVER_REFERENCE=0 RECOVER_STEPS=2 bash scripts/gpu_bench.sh $B $R/x recover:qwen3_5_9b > $R/run.log 2>&1
cp /tmp/gpu_bench_results/recover_statecut_qwen3_5_9b.log $R/trace.log
tail -3 $R/run.log
tr '\r' '\n' < $R/trace.log | grep -E "\[(mem|att)\]" | grep -n "" | sed -n '/after block 31/,/backward 30 start/p' | cut -c1-120 | head -60
rm -rf $R/x
