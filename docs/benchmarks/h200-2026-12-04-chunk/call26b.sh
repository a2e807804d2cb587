#!/usr/bin/env bash
# Call 26b: the heads kernels with column pairs: recovery before (b9e9f78) and after, DeltaNet and
# Gated DeltaNet 1.3B, 16 x 2048, 6 steps; ncu over the heads kernels of one DeltaNet step.
B=.dev/n26b; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $R/$d; env "$@" > $R/$d/stdout.txt 2>&1; tail -3 $R/$d/stdout.txt; }
step 1-recover BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/1-recover recover:delta_net_1p3b recover:gdn_1p3b
cd $R; for d in 1-recover; do mkdir -p x; [ -f $d/results.tgz ] && tar xzf $d/results.tgz -C x
python3 -c 'import json,sys,glob
for f in sorted(glob.glob("x/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(sys.argv[1], f, [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], round(r.get("peak_memory_bytes",0)/2**30,2))' $d; rm -rf x; done
cd - >/dev/null
for exe in statecut statecut_before; do
  rm -rf /tmp/rec_ncu
  timeout 150 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv -k regex:'heads_' /tmp/$exe recover -m /tmp/ck/delta_net_1p3b-rp50 \
    --teacher /tmp/ck/delta_net_1p3b --data $B/shared/data/calib/wiki.jsonl --steps 1 --batch-size 16 --seqlen 2048 --warmup 0 \
    --device cuda --dtype bf16 -q -o /tmp/rec_ncu > $R/ncu_heads_$exe.csv 2>&1
  python3 - $R/ncu_heads_$exe.csv $exe <<'PY'
import csv, sys, collections
rows=[r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
h=rows[0]; ki=h.index("Kernel Name"); vi=h.index("Metric Value"); gi=h.index("Grid Size")
d=collections.defaultdict(list)
for r in rows[1:]: d[r[ki].split("(")[0]+" grid "+r[gi]].append(float(r[vi].replace(",",""))/1e6)
for k,v in sorted(d.items()): print(sys.argv[2], k, len(v), "launches, mean", round(sum(v)/len(v),4), "ms")
PY
done
xz -9 $R/ncu_heads_*.csv
