#!/usr/bin/env bash
# Call 8: softmax attention as one op with a written-out backward, group by group: the CUDA parity tests on the
# fixtures, then Qwen3.5-9B shapes (one batch of 16, 3 steps) this build (ca208e0 ran in calls 5 and 6: the device budget left room for one call).
B=.dev/o; R=$OUT; mkdir -p $R
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/gpu_parity
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
timeout 150 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|qwen3_5_moe|nemotron|granite|falcon|kimi|gdn_moby|largest" $R/parity.log | head -30
RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/x recover:qwen3_5_9b > $R/run.log 2>&1
for f in recover_statecut_qwen3_5_9b; do cp /tmp/gpu_bench_results/$f.log $R/$f.log; cp /tmp/gpu_bench_results/$f.json $R/$f.json; done
tail -6 $R/run.log
for f in recover_statecut_qwen3_5_9b; do tr '\r' '\n' < $R/$f.log | grep -E "out of|blocks keep|recovered" | head -4; done
python3 -c 'import json,sys
for f in sys.argv[1:]:
  r=json.load(open(f)); print(f.split("/")[-1], [round(s["seconds"],3) for s in r["history"]], [round(s["loss"],4) for s in r["history"]], round(r.get("peak_memory_bytes",0)/2**30,2))' $R/recover_statecut_qwen3_5_9b.json
rm -rf $R/x
