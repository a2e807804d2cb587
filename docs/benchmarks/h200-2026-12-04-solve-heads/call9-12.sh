#!/usr/bin/env bash
# Calls 9-12: gpu_parity on one shared reference model (the bundle carries the binary and the model).
m=$1; B=.dev/p_$m; S=/tmp/sp/shared/models; rm -rf $S; mkdir -p $S $OUT/14-shared
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity && chmod +x /tmp/gpu_parity
tar -xJf $B/$m.tar.xz -C $S
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
STATECUT_TEST_DATA=/tmp/sp/shared /tmp/gpu_parity --test-threads 1 --nocapture ${m}_gpu_matches_cpu 2>&1 | tee $OUT/14-shared/parity_$m.log
