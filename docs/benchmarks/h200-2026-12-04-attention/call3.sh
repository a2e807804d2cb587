#!/usr/bin/env bash
# Call 3: the chunk kernels' products with B's fragment shared across a warp's tiles and fixed strides:
# parity on the fixtures, the recurrence before (ca208e0) and after taking turns (two rounds), ncu kernel times.
B=.dev/i; R=$OUT; mkdir -p $R
xz -dc $B/recurrence.xz > /tmp/rec_after; xz -dc $B/recurrence_before.xz > /tmp/rec_before; xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/rec_* /tmp/gpu_parity
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture recurrence_kernels_match_cpu_on_random_shapes chunk_kernel_gradients_match_cpu prefill_kernels_match_cpu > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED" $R/parity.log
for round in 1 2; do for bin in before after; do for s in 16,2048,16,64,128/none 16,2048,16,128,128/head 16,2048,16,64,128/head 1,2048,8,256,512/head; do
  /tmp/rec_$bin --shape ${s%/*} --decay ${s#*/} --iterations 5 --forms chunked-kernels >> $R/mixer_$bin.jsonl 2>> $R/mixer.log
done; done; done
python3 -c 'import json,sys
for f in ("before","after"):
  for l in open(sys.argv[1]+"/mixer_"+f+".jsonl"):
    r=json.loads(l); print(f, r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["pass"], round(r["ms"],3))' $R
NCU="/usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base -k regex:chunk_"
for bin in before after; do
  timeout 100 $NCU /tmp/rec_$bin --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu_$bin.csv 2> /dev/null
  python3 scripts/kernel_times.py $R/ncu_$bin.csv --top 12 | tail -14 | sed "s/^/$bin /"
done
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity_all.log 2>&1; echo "parity (all, fixtures) rc $?"
grep -E "test result|panicked|FAILED|^test " $R/parity_all.log | head -30
