#!/usr/bin/env bash
# Passes without a gradient on the chunk kernels (long 16-bit inputs): parity, eval of the
# embedded model three ways, eval throughput at 1.3B, and recovery (its teacher and forward).
set -u
B=.dev/b43; R=/tmp/res3; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
bash scripts/gpu_bench.sh $B $R/gb parity > $R/gb_parity.log 2>&1; cp /tmp/gpu_bench_results/parity.log $R/parity_full.log 2>/dev/null; pack
grep -E "test result|FAILED|panicked" $R/parity_full.log | head -5
D=$B/shared/data/calib/wiki.jsonl
for how in cpu default fused; do
  case $how in
    cpu) /tmp/statecut eval -m assets/models/gdn-moby --data $D --seqlen 512 --windows 32 --json > $R/moby_$how.json 2>$R/moby_$how.log ;;
    default) /tmp/statecut eval -m assets/models/gdn-moby --data $D --seqlen 512 --windows 32 --device cuda --dtype bf16 --json > $R/moby_$how.json 2>$R/moby_$how.log ;;
    fused) STATECUT_RECURRENCE=fused /tmp/statecut eval -m assets/models/gdn-moby --data $D --seqlen 512 --windows 32 --device cuda --dtype bf16 --json > $R/moby_$how.json 2>$R/moby_$how.log ;;
  esac
  echo "moby $how: $(cat $R/moby_$how.json | cut -c1-200)"
done | tee $R/moby.txt; pack
KERNELS="fused chunked-kernels" bash scripts/gpu_bench.sh $B $R/k kernels:gdn_1p3b kernels:delta_net_1p3b > $R/kernels.log 2>&1
grep -E '^\{' $R/kernels.log | cut -c1-200; pack
for how in fused default; do
  envs=""; [ $how = fused ] && envs="STATECUT_RECURRENCE=fused"
  env $envs RECOVER_REFERENCE=0 RECOVER_STEPS=4 bash scripts/gpu_bench.sh $B $R/rec recover:gdn_1p3b > $R/rec_$how.log 2>&1
  cp /tmp/gpu_bench_results/recover_statecut_gdn_1p3b.json $R/rec_$how.json; cp /tmp/gpu_bench_results/recover_statecut_gdn_1p3b.log $R/rec_${how}_statecut.log
  echo "gdn $how: $(grep -E 'peak_mib' $R/rec_$how.log | cut -c1-100) steps $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print([round(s["seconds"],3) for s in r["history"]], [round(s["loss"],4) for s in r["history"]])' $R/rec_$how.json)"
done | tee $R/recover.txt; pack
