#!/usr/bin/env bash
# Call 4: CUDA parity of this tree: the fixtures (the MLP step and the per-head gated norm against the CPU,
# the fixtures' gradients against PyTorch), then the shared Qwen3.5 reference model.
B=.dev/s; R=$OUT; mkdir -p $R; S=/tmp/sp/shared/models; rm -rf $S; mkdir -p $S
LIBS=$(ls -d /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib | head -1); export LD_LIBRARY_PATH=$LIBS:/usr/local/nvidia/lib64
xz -dc $B/gpu_parity.xz > /tmp/gpu_parity; chmod +x /tmp/gpu_parity
timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture > $R/parity.log 2>&1; echo "parity rc $?"
grep -E "test result|panicked|FAILED|mlp step|by heads|largest|chunk kernels" $R/parity.log | head -40
tar -xJf $B/qwen3_5.tar.xz -C $S
STATECUT_TEST_DATA=/tmp/sp/shared timeout 200 /tmp/gpu_parity --test-threads 1 --nocapture qwen3_5_gpu_matches_cpu > $R/parity_qwen3_5.log 2>&1; echo "qwen3_5 rc $?"
grep -E "test result|panicked|FAILED|error|gradient" $R/parity_qwen3_5.log | head -30
