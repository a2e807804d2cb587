#!/usr/bin/env bash
# Call 6: Qwen3.5-9B shapes, one batch of 16, 3 steps: attention as one op (this build, with the memory trace)
# against ca208e0, one after the other.
B=.dev/l; R=$OUT; mkdir -p $R
export STATECUT_TRACE_MEMORY=1
BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/x recover:qwen3_5_9b > $R/run.log 2>&1
for f in recover_statecut_qwen3_5_9b recover_statecut_qwen3_5_9b_before; do cp /tmp/gpu_bench_results/$f.log $R/$f.log; cp /tmp/gpu_bench_results/$f.json $R/$f.json; done
tail -6 $R/run.log
tr '\r' '\n' < $R/recover_statecut_qwen3_5_9b.log | grep -E "\[mem\] keep|FAILED|out of|blocks keep|recovered" | cut -c1-400 | head -12
tr '\r' '\n' < $R/recover_statecut_qwen3_5_9b_before.log | grep -E "out of|blocks keep|recovered" | head -5
python3 -c 'import json,sys
for f in sys.argv[1:]:
  r=json.load(open(f)); print(f.split("/")[-1], [round(s["seconds"],3) for s in r["history"]], [round(s["loss"],4) for s in r["history"]], round(r.get("peak_memory_bytes",0)/2**30,2))' $R/recover_statecut_qwen3_5_9b.json $R/recover_statecut_qwen3_5_9b_before.json
rm -rf $R/x
