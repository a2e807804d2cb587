#!/usr/bin/env bash
# Call 9: recovery before (428c7f6's build) and after (this tree: the ungated output norm lays its output out
# by heads, without the pending sum inside the MLP step), DeltaNet 1.3B (the ungated norm), 16 x 2048, 6 steps.
B=.dev/u; R=$OUT; mkdir -p $R
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $R/$d; env "$@" > $R/$d/stdout.txt 2>&1; tail -12 $R/$d/stdout.txt; }
step 9-recover BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/9-recover recover:delta_net_1p3b
cd $R; mkdir -p x; tar xzf 9-recover/results.tgz -C x; for f in x/recover_statecut_*.log; do echo "$f: $(tr '\r' '\n' < $f | grep -E "out of|blocks keep" | head -2)"; done
python3 -c 'import json,sys,glob
for f in sorted(glob.glob("x/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(f, [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], round(r.get("peak_memory_bytes",0)/2**30,2))'; rm -rf x
