#!/usr/bin/env bash
# Call 8: parity on the fixtures; prefill (bench --eager, 2,048-token prompts, batches 1, 2, 4) and eval at
# batch 1 with long passes of few sequences on the chunk kernels (this build) against the fused kernel
# (the same binary under STATECUT_RECURRENCE=fused, i.e. as before), taking turns.
B=.dev/c
step() { d=$1; shift; rm -rf /tmp/gpu_bench_results; mkdir -p $OUT/$d; env "$@" 2>&1 | tee $OUT/$d/stdout.txt; }
step 11-parity bash scripts/gpu_bench.sh $B $OUT/11-parity parity
step 12-prefill EAGER_ROUNDS=2 PROMPT_LEN=2048 BATCHES=1,2,4 bash scripts/gpu_bench.sh $B $OUT/12-prefill eager:delta_net_1p3b eager:gdn_1p3b
mkdir -p $OUT/13-eval
for m in delta_net_1p3b gdn_1p3b; do for r in 1 2; do for bin in before after; do
  exe=/tmp/statecut; [ $bin = before ] && exe=/tmp/statecut_before
  /usr/bin/time -f "%e s" $exe eval -m /tmp/ck/$m --device cuda --dtype bf16 --data $B/shared/data/calib/wiki.jsonl --seqlen 2048 \
    --windows 16 --batch-size 1 --json > $OUT/13-eval/eval_${m}_${bin}_$r.json 2> $OUT/13-eval/eval_${m}_${bin}_$r.log
  echo "$m $bin $r: $(tail -1 $OUT/13-eval/eval_${m}_${bin}_$r.log) $(cat $OUT/13-eval/eval_${m}_${bin}_$r.json | head -c 300)"
done; done; done
