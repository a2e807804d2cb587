#!/usr/bin/env bash
# The GPU parity tests of the shared reference models in this folder (gpu_parity from .dev/b45,
# kept on the machine from the call before, or carried with it).
set -u
M=$(dirname $0); R=$OUT; S=/tmp/shared; mkdir -p $S
for t in $M/*.tar.xz; do xz -dc $t | tar xf - -C $S; done
[ -d .dev/b46/shared/data ] && ln -sfn $PWD/.dev/b46/shared/data $S/data
ls $S/models
P=/tmp/gpu_parity_m; xz -dc .dev/b45/gpu_parity.xz > $P && chmod +x $P || { echo "no gpu_parity on the machine"; exit 1; }
F=""
for m in $(ls $S/models); do F="$F ${m}_gpu_matches_cpu"; done
for f in $F gradients_match_pytorch; do
  STATECUT_TEST_DATA=$S $P --test-threads 1 --nocapture --exact $f > $R/parity_$f.log 2>&1
  echo "== $f rc $?"; grep -E "relative error|gradients, largest|test result|panicked|SKIPPED|FAILED" $R/parity_$f.log | cut -c1-170 | head -20
done
