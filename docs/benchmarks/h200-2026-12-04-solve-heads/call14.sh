#!/usr/bin/env bash
# Call 14: gpu_parity (the review's build: Heads' backward through the in-place op) on the fixtures and the shared DeltaNet.
B=.dev/e; S=/tmp/sp/shared/models; rm -rf $S; mkdir -p $S $OUT
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity && chmod +x /tmp/gpu_parity
tar -xJf $B/delta_net.tar.xz -C $S
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
STATECUT_TEST_DATA=/tmp/sp/shared /tmp/gpu_parity --test-threads 1 --nocapture > $OUT/parity.log 2>&1; echo "rc $?"
grep -E "heads|gradients|delta_net|test result|panicked|FAILED" $OUT/parity.log
