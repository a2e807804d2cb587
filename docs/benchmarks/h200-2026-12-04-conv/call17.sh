#!/usr/bin/env bash
# Call 17: the vectorised conv at 4 steps a thread (statecut.xz) against 8 (statecut_before.xz), both with
# hardware exp/reciprocal in the conv's forward and backward: DeltaNet 1.3B recovery, 4 steps each, then
# ncu over every conv launch of one step of each build.
B=.dev/n17; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
rm -rf /tmp/gpu_bench_results; mkdir -p $R/rec
BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=4 bash scripts/gpu_bench.sh $B $R/rec recover:delta_net_1p3b > $R/rec/stdout.txt 2>&1
grep -E "statecut (after|before)|tokens_per" $R/rec/stdout.txt
for exe in statecut statecut_before; do
  rm -rf /tmp/rec_ncu
  timeout 240 /usr/local/cuda/bin/ncu -k regex:'conv_silu' --launch-count 72 /tmp/$exe recover -m /tmp/ck/delta_net_1p3b-rp50 \
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
