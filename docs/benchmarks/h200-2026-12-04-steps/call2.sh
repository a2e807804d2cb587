#!/usr/bin/env bash
# Call 2: recovery before (7cceaa2's build) and after (this tree), DeltaNet and Gated DeltaNet 1.3B,
# 16 x 2048 tokens a step, 6 steps, the builds one after the other.
B=.dev/q; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $R/$d; env "$@" > $R/$d/stdout.txt 2>&1; tail -30 $R/$d/stdout.txt; }
step 2-recover BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/2-recover recover:delta_net_1p3b recover:gdn_1p3b
python3 -c 'import json,sys,glob
for f in sorted(glob.glob(sys.argv[1]+"/2-recover/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(f.split("/")[-1], [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], r.get("blocks_kept"), round(r.get("peak_memory_bytes",0)/2**30,2))' $R
