#!/usr/bin/env bash
# Call 28: the recurrence alone, statecut's chunk kernels against fla's, both harnesses with the
# loss sum(o · w) (--grad sum) and with w seeded as o's gradient (--grad seed), statecut's two rounds, fla's one.
B=.dev/n28; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $B/whl/*.whl > /dev/null 2>&1; export PYTHONPATH=/tmp/site
xz -dc $B/recurrence.xz > /tmp/rec; chmod +x /tmp/rec
for round in 1 2; do for s in 16,2048,16,64,128/none 16,2048,16,128,128/none 16,2048,16,128,128/head; do for g in sum seed; do
  timeout 60 /tmp/rec --shape ${s%/*} --decay ${s#*/} --iterations 5 --forms chunked-kernels --grad $g >> $R/statecut.jsonl 2>> $R/log.txt
  [ $round = 1 ] && timeout 90 python3 scripts/recurrence_reference.py --shape ${s%/*} --decay ${s#*/} --iterations 5 --grad $g >> $R/fla.jsonl 2>> $R/log.txt
done; done; done
python3 - $R <<'PY'
import json, sys
for f in ("statecut", "fla"):
    for l in open(sys.argv[1] + "/" + f + ".jsonl"):
        try: r = json.loads(l)
        except Exception: continue
        print(f, r["dk"], r["dv"], r["decay"], r.get("grad"), r["pass"], round(r["ms"], 3) if "ms" in r else r.get("error", "")[:80])
PY
