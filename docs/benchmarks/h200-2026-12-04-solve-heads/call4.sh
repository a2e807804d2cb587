#!/usr/bin/env bash
# Call 4: the CUDA parity tests on the shared DeltaNet model (the binary stays in /tmp for calls 5 and 6).
B=.dev/b4; S=/tmp/sp/shared/models; mkdir -p $S $OUT/5-shared
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity && chmod +x /tmp/gpu_parity
for m in delta_net; do tar -xJf $B/$m.tar.xz -C $S; done
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
STATECUT_TEST_DATA=/tmp/sp/shared STATECUT_REQUIRE_DATA=1 /tmp/gpu_parity --test-threads 1 --nocapture delta_net_gpu_matches_cpu gradients_match_pytorch 2>&1 | tee $OUT/5-shared/parity_dn.log
