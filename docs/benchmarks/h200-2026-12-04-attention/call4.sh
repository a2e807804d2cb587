#!/usr/bin/env bash
# Call 4: two more forms of the tensor-core product loop against ca208e0, taking turns: (b) the slice of K
# outer and fully unrolled, B's fragment shared; (c) the old loop order with fixed strides only.
B=.dev/j; R=$OUT; mkdir -p $R
for b in recurrence recurrence_before recurrence_c; do xz -dc $B/$b.xz > /tmp/$b; chmod +x /tmp/$b; done
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
for round in 1 2; do for bin in recurrence_before recurrence recurrence_c; do for s in 16,2048,16,64,128/none 16,2048,16,128,128/head; do
  /tmp/$bin --shape ${s%/*} --decay ${s#*/} --iterations 5 --forms chunked-kernels >> $R/mixer_$bin.jsonl 2>> $R/mixer.log
done; done; done
python3 -c 'import json,sys
for f in ("recurrence_before","recurrence","recurrence_c"):
  for l in open(sys.argv[1]+"/mixer_"+f+".jsonl"):
    r=json.loads(l); print(f, r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))' $R
NCU="/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base -k regex:chunk_"
for bin in recurrence_before recurrence recurrence_c; do
  timeout 100 $NCU /tmp/$bin --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu_$bin.csv 2> /dev/null
  python3 scripts/kernel_times.py $R/ncu_$bin.csv --top 12 | tail -8 | sed "s/^/$bin /"
done
