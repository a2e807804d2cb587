#!/usr/bin/env bash
# The sweeps of docs/RESULTS.md: drrqr, grad and l1 at four ratios on the four shared reference
# models and on the recall-trained fixture (tests/fixtures/gdn_recall), on the CPU.
#
#   scripts/sweep_all.sh [SHARED] [OUT]      (defaults: ../shared, results/sweep)
#
# Each sweep writes OUT/NAME/{sweep.json,sweep.md,*.svg}; rerunning resumes from saved cells.
set -euo pipefail
shared=${1:-../shared}
out=${2:-results/sweep}
bin=${STATECUT:-target/release/statecut}
# MODELS="..." picks shared models; FIXTURE=0 skips the fixture.
grid=(--methods drrqr,grad,l1 --ratios 0.25,0.5,0.625,0.75)
# Small calibration and evaluation settings (4 x 256 tokens each, 16 MQAR sequences) keep a
# sweep to minutes on the CPU; these are the settings of the tables in docs/RESULTS.md.
calib=(--calib "$shared/data/calib/wiki.jsonl" --nsamples 4 --seqlen 256 --rows 512)
for m in ${MODELS:-delta_net gated_deltanet mamba2 qwen3_5}; do
  "$bin" sweep -m "$shared/models/$m" "${grid[@]}" "${calib[@]}" \
    --eval "$shared/data/eval/wiki.jsonl,$shared/data/eval/sotu.jsonl" --eval-windows 4 --eval-seqlen 256 \
    --recall mqar --pairs 8 --context-len 128 --samples 16 --budget 5% -o "$out/$m"
done
# The fixture learned MQAR with 1-8 pairs over token ids below 512 in 128-token sequences.
[ "${FIXTURE:-1}" = 1 ] || exit 0
# Its text was assets/calibration.txt (so that perplexity is on its training text); wiki is held out.
"$bin" sweep -m tests/fixtures/gdn_recall "${grid[@]}" --calib "$shared/data/calib/books.jsonl" \
  --nsamples 4 --seqlen 256 --rows 512 \
  --eval assets/calibration.txt,"$shared/data/eval/wiki.jsonl" --eval-windows 4 --eval-seqlen 256 \
  --recall mqar --pairs 8 --context-len 128 --mqar-vocab 512 --samples 64 --budget 5% -o "$out/gdn_recall"
