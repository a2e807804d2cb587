// One AdamW update in place (src/ops/adamw.rs defines it): state [3n] holds the parameter and its
// two moments, g [n] the gradient. Every rounding is spelled out (no fused multiply-add), so
// that the result is the CPU half's bit for bit.
extern "C" __global__ void adamw_update(float *state, const float *g, long long n, int clip, float scale, float b1,
                                        float omb1, float b2, float omb2, float ibc1, float ibc2, float eps,
                                        float decay, float lr) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float gi = g[i];
    if (clip) gi = __fadd_rn(__fmul_rn(gi, scale), 0.0f);
    const float m = __fadd_rn(__fadd_rn(__fmul_rn(state[n + i], b1), 0.0f), __fadd_rn(__fmul_rn(gi, omb1), 0.0f));
    const float v =
        __fadd_rn(__fadd_rn(__fmul_rn(state[2 * n + i], b2), 0.0f), __fadd_rn(__fmul_rn(__fmul_rn(gi, gi), omb2), 0.0f));
    const float m_hat = __fadd_rn(__fmul_rn(m, ibc1), 0.0f);
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(v, ibc2), 0.0f)), 1.0f), eps);
    const float decayed = __fadd_rn(__fmul_rn(state[i], decay), 0.0f);
    state[i] = __fsub_rn(decayed, __fadd_rn(__fmul_rn(__fdiv_rn(m_hat, denom), lr), 0.0f));
    state[n + i] = m;
    state[2 * n + i] = v;
  }
}
