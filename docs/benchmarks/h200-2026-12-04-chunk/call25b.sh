#!/usr/bin/env bash
# Call 25b: the conv backward's four-step window: ncu over every conv launch of one DeltaNet 1.3B
# recovery step, before (4dd0c39) and after; then recovery, 16 x 2048, 6 steps, both builds.
B=.dev/n25b; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $R/$d; env "$@" > $R/$d/stdout.txt 2>&1; tail -3 $R/$d/stdout.txt; }
step 1-recover BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/1-recover recover:delta_net_1p3b
cd $R; for d in 1-recover; do mkdir -p x; [ -f $d/results.tgz ] && tar xzf $d/results.tgz -C x
python3 -c 'import json,sys,glob
for f in sorted(glob.glob("x/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(sys.argv[1], f, [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], round(r.get("peak_memory_bytes",0)/2**30,2))' $d; rm -rf x; done
cd - >/dev/null
for exe in statecut statecut_before; do
  rm -rf /tmp/rec_ncu
  timeout 200 /usr/local/cuda/bin/ncu -k regex:'conv_silu' --launch-count 72 /tmp/$exe recover -m /tmp/ck/delta_net_1p3b-rp50 \
    --teacher /tmp/ck/delta_net_1p3b --data $B/shared/data/calib/wiki.jsonl --steps 1 --batch-size 16 --seqlen 2048 --warmup 0 \
    --device cuda --dtype bf16 -q -o /tmp/rec_ncu > $R/ncu_conv_$exe.txt 2>&1
  python3 - $R/ncu_conv_$exe.txt $exe <<'PY'
import re, sys, collections
name=None; d=collections.defaultdict(list)
for l in open(sys.argv[1]):
    m=re.match(r'\s+(conv_silu\w*) \((\d+), (\d+), 1\)', l)
    if m: name=f"{m.group(1)} grid {m.group(2)}x{m.group(3)}"; continue
    m=re.match(r'\s+Duration\s+(us|ms)\s+([\d.,]+)', l)
    if m and name:
        v=float(m.group(2).replace(',','')); d[name].append(v/1000 if m.group(1)=='us' else v); name=None
for k,v in d.items(): print(sys.argv[2], k, len(v), "launches, mean", round(sum(v)/len(v),4), "ms")
PY
done
xz -9 $R/ncu_conv_*.txt
