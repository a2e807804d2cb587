#!/usr/bin/env bash
# Call 5 (the machine of call 4, still warm): Gated DeltaNet and Mamba-2, with call 4's binary.
B=.dev/b5; S=/tmp/sp/shared/models; mkdir -p $OUT/5-shared
[ -x /tmp/gpu_parity ] || { echo "FATAL: /tmp/gpu_parity is gone (a fresh machine)"; exit 1; }
rm -rf $S/delta_net
for m in gated_deltanet mamba2; do tar -xJf $B/$m.tar.xz -C $S; done
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
STATECUT_TEST_DATA=/tmp/sp/shared STATECUT_REQUIRE_DATA=1 /tmp/gpu_parity --test-threads 1 --nocapture gated_deltanet_gpu_matches_cpu mamba2_gpu_matches_cpu gradients_match_pytorch 2>&1 | tee $OUT/5-shared/parity_gdn_mamba2.log
