#!/usr/bin/env bash
# Call 26a: CUDA parity with the heads kernels moving column pairs (heads cases d 48, 40, 47).
B=.dev/n26a; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/gpu_parity
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|largest|heads d" $R/parity.log | head -30
