#!/usr/bin/env bash
# The memory pool keeps freed memory: the mixer with and without STATECUT_RELEASE_MEMORY=1 (taking turns);
# recover: this build (pool kept, then released) against 46d4e1c.
set -u
B=.dev/b38; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
xz -dc $B/recurrence.xz > /tmp/recurrence; chmod +x /tmp/recurrence
for d in head none; do for round in 1 2; do for w in keep release; do
  rel=0; [ $w = release ] && rel=1
  STATECUT_RELEASE_MEMORY=$rel /tmp/recurrence --shape 16,2048,16,128,128 --decay $d --iterations 5 --forms chunked-kernels,fused > $R/mixer_${w}_${d}_$round.jsonl 2>>$R/mixer.err
  echo "$d $w $round: $(python3 -c 'import json,sys; print([ (json.loads(l)["form"], json.loads(l)["pass"], round(json.loads(l)["ms"],2)) for l in open(sys.argv[1])])' $R/mixer_${w}_${d}_$round.jsonl)"
done; done; done | tee $R/mixer_ab.txt; pack
for m in gdn_1p3b delta_net_1p3b; do
  BEFORE=1 RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/gb recover:$m > $R/gb_rec_$m.log 2>&1; pack
  mkdir -p $R/rel; STATECUT_RELEASE_MEMORY=1 RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/rel recover:$m > $R/rel_rec_$m.log 2>&1; pack
  grep -E 'statecut|tokens_per' $R/gb_rec_$m.log; echo release:; grep -E 'tokens_per' $R/rel_rec_$m.log
done
