#!/usr/bin/env bash
# Call 3: the recurrence's chunk kernels alone, before (db1fde3) and after, taking turns, two rounds.
B=.dev/b3
mkdir -p $OUT/4-mixer
xz -dc $B/recurrence.xz > /tmp/rec_after; xz -dc $B/recurrence_before.xz > /tmp/rec_before; chmod +x /tmp/rec_*
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
for round in 1 2; do for bin in before after; do for s in 16,2048,16,128,128/head 16,2048,16,128,128/none 16,2048,16,64,128/head 16,2048,16,64,128/none 1,2048,8,256,512/head; do
  /tmp/rec_$bin --shape ${s%/*} --decay ${s#*/} --iterations 5 --forms chunked-kernels >> $OUT/4-mixer/mixer_$bin.jsonl 2>> $OUT/4-mixer/mixer.log
done; done; done
python3 -c 'import json,sys
for f in ("before","after"):
  for l in open(sys.argv[1]+"/mixer_"+f+".jsonl"):
    r=json.loads(l); print(f, r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["form"], r["pass"], round(r["ms"],3))' $OUT/4-mixer
