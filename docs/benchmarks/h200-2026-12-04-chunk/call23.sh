#!/usr/bin/env bash
# Call 23: CUDA parity with the layout kernels' 16-byte form; the chunk kernels alone before
# (0b907bc) and after, taking turns, two rounds; ncu per kernel of one forward + backward.
B=.dev/n23; R=$OUT; mkdir -p $R/mixer
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
for x in gpu_parity rec_before rec_after; do xz -dc $B/$x.xz > /tmp/$x; chmod +x /tmp/$x; done
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|largest" $R/parity.log | head -20
for round in 1 2; do for bin in before after; do for s in 16,2048,16,64,128/none 16,2048,16,128,128/head 1,2048,8,128,512/head; do
  timeout 60 /tmp/rec_$bin --shape ${s%/*} --decay ${s#*/} --iterations 5 --forms chunked-kernels >> $R/mixer/$bin.jsonl 2>> $R/mixer/log.txt
done; done; done
python3 -c 'import json,sys
for f in ("before","after"):
  for l in open(sys.argv[1]+"/mixer/"+f+".jsonl"):
    r=json.loads(l); print(f, r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))' $R
NCU=/usr/local/cuda/bin/ncu
for bin in before after; do
  timeout 120 $NCU --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --csv /tmp/rec_$bin --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu_$bin.csv 2> $R/ncu_$bin.err
done
python3 - $R <<'PY'
import csv,sys,collections
for b in ("before","after"):
    rows=[r for r in csv.reader(l for l in open(sys.argv[1]+"/ncu_"+b+".csv") if l.startswith('"'))]
    h=rows[0]; ki=h.index("Kernel Name"); vi=h.index("Metric Value"); mi=h.index("Metric Name")
    acc=collections.defaultdict(list)
    for r in rows[1:]: acc[(r[ki].split("(")[0][:40], r[mi][:12])].append(float(r[vi].replace(",","")))
    for k,v in sorted(acc.items()):
        if "chunk" in k[0]: print(b, k[0], k[1], len(v), round(sorted(v)[len(v)//2],2))
PY
