#!/usr/bin/env bash
# Call 18: CUDA parity of the final tree (vectorised short conv; hardware exp and reciprocal in the conv's
# forward and backward): the fixtures, then the shared DeltaNet model against the CPU and PyTorch.
B=.dev/n18; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/gpu_parity
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|conv at column|largest" $R/parity.log | head -40
S=/tmp/sp/shared/models; rm -rf $S; mkdir -p $S; tar -xJf $B/delta_net.tar.xz -C $S
STATECUT_TEST_DATA=/tmp/sp/shared timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture delta_net_gpu_matches_cpu gradients_match_pytorch > $R/parity_delta_net.log 2>&1; echo "delta_net rc $?"
grep -E "test result|panicked|FAILED|delta_net" $R/parity_delta_net.log | head -20
