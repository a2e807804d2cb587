#!/usr/bin/env bash
# Call 20: CUDA parity with paired 8-byte stores in the chunk kernels epilogues, then the
# chunk kernels alone, before and after, taking turns, two rounds.
B=.dev/n20b; R=$OUT; mkdir -p $R/mixer
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; xz -dc $B/recurrence_before.xz > /tmp/rec_before; xz -dc $B/recurrence.xz > /tmp/rec_after; chmod +x /tmp/gpu_parity /tmp/rec_*
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|largest" $R/parity.log | head -20
for round in 1 2; do for bin in before after; do for s in 16,2048,16,64,128/none 16,2048,16,128,128/head; do
  timeout 60 /tmp/rec_$bin --shape ${s%/*} --decay ${s#*/} --iterations 5 --forms chunked-kernels >> $R/mixer/mixer_$bin.jsonl 2>> $R/mixer/mixer.log
done; done; done
python3 -c 'import json,sys
for f in ("before","after"):
  for l in open(sys.argv[1]+"/mixer/mixer_"+f+".jsonl"):
    r=json.loads(l); print(f, r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["form"], r["pass"], round(r["ms"],3))' $R
NCU=/usr/local/cuda/bin/ncu
timeout 200 $NCU -k regex:'chunk_.*_tc' --launch-skip 6 --launch-count 6 /tmp/rec_after --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu_after.txt 2>&1
timeout 200 $NCU -k regex:'chunk_.*_tc' --launch-skip 6 --launch-count 6 /tmp/rec_before --shape 16,2048,16,64,128 --decay none --iterations 1 --forms chunked-kernels > $R/ncu_before.txt 2>&1
grep -E "^  chunk_|Duration" $R/ncu_before.txt $R/ncu_after.txt
