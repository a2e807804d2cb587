#!/usr/bin/env bash
# 1) Qwen3.5-9B shapes at one batch of 16 with the out-of-memory fallback (3 steps).
# 2) Where a DeltaNet 1.3B recovery step goes: ncu kernel times over one step, --recompute all.
set -u
B=.dev/b48; R=$OUT; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
run() { # tag, then env for gpu_bench
  local tag=$1; shift
  env "$@" RECOVER_REFERENCE=0 bash scripts/gpu_bench.sh $B $R/x recover:$M > $R/${tag}.log 2>&1
  for f in recover_statecut_$M.json recover_statecut_$M.log recover_statecut_${M}_peak.json recover_prune_$M.log make_$M.log; do cp /tmp/gpu_bench_results/$f $R/${tag}_$f 2>/dev/null; done
  grep -E "keep their|recomput|error" $R/${tag}_recover_statecut_$M.log | tail -3; tail -1 $R/${tag}_recover_statecut_$M.log; cat $R/${tag}_recover_statecut_${M}_peak.json
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print([round(s["seconds"],3) for s in r["history"]], [round(s["loss"],4) for s in r["history"]], r.get("peak_memory_bytes",0)/2**30)' $R/${tag}_recover_statecut_$M.json 2>&1 | tail -1
}
M=qwen3_5_9b
run batch16 RECOVER_STEPS=3
rm -rf /tmp/ck/qwen3_5_9b*
M=delta_net_1p3b
run dn RECOVER_STEPS=1
D=$(ls $B/shared/data/calib/*.jsonl | head -1)
timeout 300 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  /tmp/statecut recover -m /tmp/ck/$M-rp50 --teacher /tmp/ck/$M --data $D --steps 1 --batch-size 16 --seqlen 2048 \
  --warmup 0 --device cuda --dtype bf16 --recompute all -q -o /tmp/ck/ncu-rec > $R/ncu_rec.csv 2> $R/ncu.err
echo "ncu rc $?"; tail -3 $R/ncu.err
python3 scripts/kernel_times.py $R/ncu_rec.csv --top 45 --json $R/ncu_rec_summary.json | tee $R/ncu_rec.txt | head -60
xz -9 $R/ncu_rec.csv
rm -rf $R/x
cd $R && tar czf /tmp/all.tgz . && rm -rf $R/* && mv /tmp/all.tgz $R/
