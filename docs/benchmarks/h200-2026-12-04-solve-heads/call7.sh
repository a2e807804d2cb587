#!/usr/bin/env bash
# Call 7: parity on the fixtures; calibration with long passes on the chunk kernels (this build)
# against the fused kernel (the same binary under STATECUT_RECURRENCE=fused, i.e. as before);
# the recurrence forward of each kernel over lengths.
B=.dev/c
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $OUT/$d; env "$@" 2>&1 | tee $OUT/$d/stdout.txt; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
step 6-parity bash scripts/gpu_bench.sh $B $OUT/6-parity parity
step 7-calib bash scripts/gpu_bench.sh $B $OUT/7-calib calib:gdn_1p3b calib:delta_net_1p3b
mkdir -p $OUT/8-mixer
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
for s in 1,64,16,128,128 1,128,16,128,128 1,256,16,128,128 1,512,16,128,128 1,2048,16,128,128 8,256,16,128,128 8,2048,16,128,128 8,2048,8,256,256 64,128,16,128,128; do
  timeout 60 /tmp/recurrence --shape $s --decay head --iterations 5 --forms fused,chunked-kernels >> $OUT/8-mixer/mixer.jsonl 2>> $OUT/8-mixer/mixer.log
done
python3 -c 'import json,sys
for l in open(sys.argv[1]):
  r=json.loads(l)
  if r["pass"]=="forward": print(r["b"], r["t"], r["h"], r["dk"], r["dv"], r["form"], round(r["ms"],3))' $OUT/8-mixer/mixer.jsonl
