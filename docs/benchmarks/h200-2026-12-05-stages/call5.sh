#!/bin/bash
# One call: fla 0.6.0's chunk_delta_rule and statecut's chunk kernels (this tree) at the same
# shapes, output gradient seeded, taking turns; results in $OUT/fla.tgz.
set -u
source .dev/calls/setup.sh
W=/tmp/res/fla; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for round in 1; do
  for s in "16,2048,16,64,128"; do
    timeout 110 python3 scripts/recurrence_reference.py --shape $s --decay none --iterations 5 --grad seed >> $W/fla.jsonl 2>>$W/fla.log
    echo "fla $s rc $?"
    /tmp/bins/ob5/recurrence --shape $s --decay none --iterations 5 --forms chunked-kernels --grad seed >> $W/statecut.jsonl 2>>$W/statecut.log
  done
  [ $(( $(date +%s) - t0 )) -gt 300 ] && break
done
python3 - $W <<'PY'
import json,sys
for f in ("fla","statecut"):
    for l in open(sys.argv[1]+"/"+f+".jsonl"):
        try: r=json.loads(l)
        except Exception: continue
        print(f, r.get("form"), r.get("dk"), r.get("pass"), round(r["ms"],3))
PY
tail -3 $W/fla.log
tar -czf $O/fla.tgz -C $W .
