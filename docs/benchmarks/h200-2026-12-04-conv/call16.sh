#!/usr/bin/env bash
# Call 16: recovery before (HEAD 8687b2c's build) and after (vectorised short conv), DeltaNet and Gated
# DeltaNet 1.3B, 16 x 2048 tokens a step, 6 steps; then ncu on the conv kernels of one step, each build.
B=.dev/a; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $R/$d; env "$@" > $R/$d/stdout.txt 2>&1; tail -5 $R/$d/stdout.txt; }
step 2-recover BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=6 bash scripts/gpu_bench.sh $B $R/2-recover recover:delta_net_1p3b recover:gdn_1p3b
cd $R; for d in 2-recover; do mkdir -p x; [ -f $d/results.tgz ] && tar xzf $d/results.tgz -C x; for f in x/recover_statecut_*.log; do echo "$d $f: $(tr '\r' '\n' < $f | grep -E "blocks keep|kept|recovered" | head -2)"; done
python3 -c 'import json,sys,glob
for f in sorted(glob.glob("x/recover_statecut_*.json")):
  if f.endswith("_peak.json"): continue
  r=json.load(open(f)); h=r["history"]; print(sys.argv[1], f, [round(s["seconds"],3) for s in h], [round(s["loss"],4) for s in h], round(r.get("peak_memory_bytes",0)/2**30,2))' $d; rm -rf x; done
cd - >/dev/null
for exe in statecut statecut_before; do
  rm -rf /tmp/rec_ncu
  timeout 200 /usr/local/cuda/bin/ncu -k regex:'conv_silu' --launch-count 8 /tmp/$exe recover -m /tmp/ck/delta_net_1p3b-rp50 \
    --teacher /tmp/ck/delta_net_1p3b --data $B/shared/data/calib/wiki.jsonl --steps 1 --batch-size 16 --seqlen 2048 --warmup 0 \
    --device cuda --dtype bf16 -q -o /tmp/rec_ncu > $R/ncu_conv_$exe.txt 2>&1
  echo "== $exe"; grep -E "^  conv_silu|Duration|DRAM Throughput" $R/ncu_conv_$exe.txt
done
