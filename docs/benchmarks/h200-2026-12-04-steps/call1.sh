#!/usr/bin/env bash
# Call 1: CUDA parity of this tree (fixtures), then the chunk kernels alone: this tree against the same
# kernels multiplying TF32 operands truncated instead of rounded, taking turns, two rounds.
B=.dev/r; R=$OUT; mkdir -p $R/mixer
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; xz -dc $B/recurrence.xz > /tmp/rec_round; xz -dc $B/recurrence_trunc.xz > /tmp/rec_trunc; chmod +x /tmp/gpu_parity /tmp/rec_*
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED" $R/parity.log | head -20
for round in 1 2; do for bin in round trunc; do for s in 16,2048,16,64,128/none 16,2048,16,128,128/head; do
  timeout 60 /tmp/rec_$bin --shape ${s%/*} --decay ${s#*/} --iterations 5 --forms chunked-kernels >> $R/mixer/mixer_$bin.jsonl 2>> $R/mixer/mixer.log
done; done; done
python3 -c 'import json,sys
for f in ("round","trunc"):
  for l in open(sys.argv[1]+"/mixer/mixer_"+f+".jsonl"):
    r=json.loads(l); print(f, r["b"], r["h"], r["dk"], r["dv"], r["decay"], r["form"], r["pass"], round(r["ms"],3))' $R
