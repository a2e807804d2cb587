#!/usr/bin/env bash
# The frozen MLP as one op: GPU parity (checkout fixtures), then recovery before (d649c1d) and after, 6 steps, auto.
set -u
B=.dev/b50; R=$OUT; mkdir -p $R
bash scripts/gpu_bench.sh $B $R/p parity > $R/parity_stage.log 2>&1
cp /tmp/gpu_bench_results/parity.log $R/ 2>/dev/null
grep -E "test result|FAILED|panicked|WARNING" $R/parity.log $R/parity_stage.log | head; grep -E "^(conv|swiglu|norm|frozen|trained)" $R/parity.log | head -40 > $R/parity_ops.txt
for m in ${MODELS:-delta_net_1p3b gdn_1p3b}; do
  BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/gb recover:$m > $R/rec_${m}.log 2>&1
  for w in "" _before; do
    cp /tmp/gpu_bench_results/recover_statecut_$m$w.json $R/rec_${m}$w.json 2>/dev/null; cp /tmp/gpu_bench_results/recover_statecut_$m$w.log $R/rec_${m}${w}_statecut.log 2>/dev/null
    echo "$m${w:-_after}: steps $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print([round(s["seconds"],3) for s in r["history"]], [round(s["loss"],4) for s in r["history"]], round(r.get("peak_memory_bytes",0)/2**30,1))' $R/rec_${m}$w.json 2>&1 | cut -c1-240)"
  done
  grep -E "peak_mib" $R/rec_${m}.log | cut -c1-200
done | tee $R/recover.txt
rm -rf $R/p $R/gb
cd $R && tar czf /tmp/all.tgz . && rm -rf $R/* && mv /tmp/all.tgz $R/
