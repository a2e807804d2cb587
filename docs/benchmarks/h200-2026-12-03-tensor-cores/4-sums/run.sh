#!/usr/bin/env bash
# da/de summed in the tensor-core walk backward: parity; the mixer; recover with the pool kept vs released (taking turns).
set -u
B=.dev/b39; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
bash scripts/gpu_bench.sh $B $R/gb parity > $R/gb_parity.log 2>&1; cp /tmp/gpu_bench_results/parity.log $R/parity_full.log 2>/dev/null; pack
grep -E "test result|FAILED|panicked|bf16 values" $R/gb_parity.log $R/parity_full.log | head -20
for d in head none; do for round in 1 2; do
  /tmp/recurrence --shape 16,2048,16,128,128 --decay $d --iterations 5 --forms chunked-kernels,fused > $R/mixer_${d}_$round.jsonl 2>>$R/mixer.err
  echo "$d $round: $(python3 -c 'import json,sys; print([ (json.loads(l)["form"], json.loads(l)["pass"], round(json.loads(l)["ms"],2)) for l in open(sys.argv[1])])' $R/mixer_${d}_$round.jsonl)"
done; done | tee $R/mixer.txt
/tmp/recurrence --shape 1,2048,8,256,512 --decay head --iterations 5 --forms chunked-kernels,fused | cut -c1-100 | tee $R/mixer_wide.txt; pack
for m in gdn_1p3b delta_net_1p3b; do for round in 1 2; do for w in keep release; do
  [ $m = delta_net_1p3b ] && [ $round = 2 ] && continue
  rel=0; [ $w = release ] && rel=1
  STATECUT_RELEASE_MEMORY=$rel RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/$w recover:$m > $R/rec_${m}_${w}_$round.log 2>&1
  cp /tmp/gpu_bench_results/recover_statecut_$m.log $R/rec_${m}_${w}_${round}_statecut.log 2>/dev/null
  echo "$m $w $round: $(grep -E 'tokens_per' $R/rec_${m}_${w}_$round.log | cut -c1-200)"
done; done; done | tee $R/recover.txt; pack
