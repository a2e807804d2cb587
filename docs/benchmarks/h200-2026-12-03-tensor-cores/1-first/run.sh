#!/usr/bin/env bash
# Tensor-core chunk kernels: parity, the mixer alone (bf16 = tensor cores, f32 = CUDA cores, fla), then recover before/after.
set -u
B=.dev/b36; R=/tmp/res; mkdir -p $R
pack() { tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
bash scripts/gpu_bench.sh $B $R/gb parity > $R/gb_parity.log 2>&1; pack
grep -E "test result|largest|FAILED|panicked|differ|bf16 values" $R/gb_parity.log | head -30
FORMS=chunked-kernels ITERATIONS=5 bash scripts/gpu_bench.sh $B $R/gb mixer:16,2048,16,128,128/head mixer:16,2048,16,128,128/none > $R/gb_mixer.log 2>&1; pack
cat $R/gb_mixer.log | grep -v '^$' | tail -20
for d in head none; do /tmp/recurrence --shape 16,2048,16,128,128 --decay $d --dtype f32 --iterations 5 --forms chunked-kernels > $R/mixer_f32_$d.jsonl 2>&1; done; cat $R/mixer_f32_*.jsonl; pack
RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/gb recover:gdn_1p3b > $R/gb_rec_gdn.log 2>&1; pack
RECOVER_REFERENCE=0 RECOVER_STEPS=3 bash scripts/gpu_bench.sh $B $R/gb recover:delta_net_1p3b > $R/gb_rec_dn.log 2>&1; pack
cat $R/gb_rec_*.log | grep -E 'statecut|tokens_per'
