#!/usr/bin/env bash
# Call 29 (parity): tests/gpu_parity.rs on this tree (q and k normed straight into the chunk layout).
B=.dev/n29p; R=$OUT; mkdir -p $R
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/gpu_parity
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|heads in chunks|largest" $R/parity.log | head -60
