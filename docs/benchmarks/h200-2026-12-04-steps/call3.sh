#!/usr/bin/env bash
# Call 3: the keep rule. Qwen3.5-9B shapes (one batch of 16 x 2048, 3 steps, recurrent mixers trained), then
# DeltaNet 1.3B within --train-memory 45GiB (6 steps): before (7cceaa2's build) and after (this tree).
B=.dev/q; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $R/$d; env "$@" > $R/$d/stdout.txt 2>&1; tail -12 $R/$d/stdout.txt; }
step 3-budget BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 RECOVER_ARGS="--train-memory 45GiB" bash scripts/gpu_bench.sh $B $R/3-budget recover:delta_net_1p3b
step 4-9b BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/4-9b recover:qwen3_5_9b
cd $R; for d in 3-budget 4-9b; do mkdir -p x; tar xzf $d/results.tgz -C x; for f in x/recover_statecut_*.log; do echo "$f: $(tr '\r' '\n' < $f | grep -E "out of|blocks keep|kept|recovered" | head -3)"; done
python3 -c 'import json,sys,glob
for f in sorted(glob.glob("x/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(f, [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], round(r.get("peak_memory_bytes",0)/2**30,2))'; rm -rf x; done
