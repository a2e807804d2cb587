#!/usr/bin/env bash
# Call 6 (the machine of call 4, still warm): Qwen3.5, with call 4's binary.
B=.dev/b6; S=/tmp/sp/shared/models; mkdir -p $OUT/5-shared
[ -x /tmp/gpu_parity ] || { echo "FATAL: /tmp/gpu_parity is gone (a fresh machine)"; exit 1; }
rm -rf $S/gated_deltanet $S/mamba2
for m in qwen3_5; do tar -xJf $B/$m.tar.xz -C $S; done
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
STATECUT_TEST_DATA=/tmp/sp/shared STATECUT_REQUIRE_DATA=1 /tmp/gpu_parity --test-threads 1 --nocapture qwen3_5_gpu_matches_cpu gradients_match_pytorch 2>&1 | tee $OUT/5-shared/parity_qwen3_5.log
