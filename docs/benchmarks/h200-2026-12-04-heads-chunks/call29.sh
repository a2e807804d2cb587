#!/usr/bin/env bash
# Call 29: (parity in call29p.sh, its own call: the bundles together passed the carry limit)
# recovery with q and k normed straight into the chunk kernels' layout, before (3dd843b) and after, DeltaNet and Gated DeltaNet 1.3B, 16 x 2048 tokens a step,
# 6 steps, builds taking turns per model; then DeltaNet within --train-memory 45GiB.
B=.dev/n29; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $R/$d; env "$@" > $R/$d/stdout.txt 2>&1; tail -3 $R/$d/stdout.txt; }
step 1-recover BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/1-recover recover:delta_net_1p3b recover:gdn_1p3b
step 2-budget BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 RECOVER_ARGS="--train-memory 45GiB" bash scripts/gpu_bench.sh $B $R/2-budget recover:delta_net_1p3b
cd $R; for d in 1-recover 2-budget; do mkdir -p x; [ -f $d/results.tgz ] && tar xzf $d/results.tgz -C x; for f in x/recover_statecut_*.log; do echo "$d $f: $(tr '\r' '\n' < $f | grep -E "blocks keep|kept|recovered" | head -2)"; done
python3 -c 'import json,sys,glob
for f in sorted(glob.glob("x/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(sys.argv[1], f, [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], round(r.get("peak_memory_bytes",0)/2**30,2))' $d; rm -rf x; done
