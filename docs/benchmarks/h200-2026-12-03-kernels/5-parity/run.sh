#!/usr/bin/env bash
# GPU parity on 9358deb's kernels with the heads test's v-style case inside the rows.
set -u
B=.dev/b52; R=$OUT; mkdir -p $R
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/gpu_parity
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$LIBS:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
STATECUT_TEST_DATA=$B/shared /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1
echo "parity rc $?"; grep -E "test result|panicked" $R/parity.log; grep -E "^(heads|trained)" $R/parity.log
