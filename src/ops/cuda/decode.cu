// One decoding step of a delta-rule layer (src/ops/decode.rs): its inputs, and the output norm.
#pragma once
#include "common.cuh"

__device__ __forceinline__ float softplus_f(float x) { return fmaxf(x, 0.0f) + logf(1.0f + expf(-fabsf(x))); }

// The inputs of one recurrence step from a layer's projections, for one (sequence b, key head
// kh) per block and the r = Hv / H value heads that read it: the short conv over [q | k | v]
// continued from the float32 history conv_state [B, K-1, C], SiLU (rounded to T, as the conv's
// output is), L2-normed q and k (repeated for each of the r value heads), β = beta_scale ·
// sigmoid(b) and g = neg_a · softplus(a + dt_bias).
// x, b, a are rows of B (the row strides given). flags: 1 bias, 2 b (else β = 1), 4 a (else g = 0);
// an absent input's pointer is never read.
// out (float32): q [B,Hv,dk] | k [B,Hv,dk] | v [B,Hv,dv] | β [B,Hv] | g [B,Hv]; the shifted history
// [B,K-1,C] goes to st_out, which may be conv_state itself (an in-place step): each channel is
// read and written by one thread alone.
template <typename T>
__device__ void delta_decode_prep(const T *__restrict__ x, long long xs, const float *conv_state,
                                  const T *__restrict__ w, const T *__restrict__ bias, const T *__restrict__ bv,
                                  long long bs, const T *__restrict__ av, long long as, const float *__restrict__ neg_a,
                                  const float *__restrict__ dt_bias, float *__restrict__ out, float *st_out, int B,
                                  int H, int Hv, int dk, int dv, int K, int flags, float beta_scale, float eps) {
  extern __shared__ float qk[];  // 2 dk
  __shared__ float red[32];
  const int b = blockIdx.y, kh = blockIdx.x, r = Hv / H, hv0 = kh * r;
  const int kd = H * dk, C = 2 * kd + Hv * dv;
  const T *xr = x + (long long)b * xs;
  const float *st = conv_state + (long long)b * (K - 1) * C;
  float *sto = st_out + (long long)b * (K - 1) * C;
  float *q_out = out, *k_out = out + (long long)B * Hv * dk, *v_out = k_out + (long long)B * Hv * dk;
  float *beta_out = v_out + (long long)B * Hv * dv, *g_out = beta_out + (long long)B * Hv;
  // Channel c's conv output, rounded to T, and its history shifted by one step (every read of
  // the history comes before the write that could overwrite it).
  auto conv = [&](int c) {
    const float xc = to_f(xr[c]);
    float acc = (flags & 1) ? to_f(bias[c]) : 0.0f;
    for (int i = 0; i < K - 1; i++) acc += to_f(w[c * K + i]) * st[(long long)i * C + c];
    acc += to_f(w[c * K + K - 1]) * xc;
    for (int i = 0; i + 1 < K - 1; i++) sto[(long long)i * C + c] = st[(long long)(i + 1) * C + c];
    if (K > 1) sto[(long long)(K - 2) * C + c] = xc;
    return to_f(from_f<T>(acc / (1.0f + expf(-acc))));
  };
  float sq = 0.0f, sk = 0.0f;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    const float qi = conv(kh * dk + i), ki = conv(kd + kh * dk + i);
    qk[i] = qi;
    qk[dk + i] = ki;
    sq += qi * qi;
    sk += ki * ki;
  }
  // The value heads hv0 .. hv0 + r - 1 own consecutive channels.
  for (int j = threadIdx.x; j < r * dv; j += blockDim.x)
    v_out[((long long)b * Hv + hv0) * dv + j] = conv(2 * kd + hv0 * dv + j);
  sq = block_sum(sq, red);
  sk = block_sum(sk, red);
  const float iq = rsqrtf(sq + eps), ik = rsqrtf(sk + eps);
  for (int e = threadIdx.x; e < r * dk; e += blockDim.x) {
    const int i = e % dk;
    q_out[((long long)b * Hv + hv0) * dk + e] = qk[i] * iq;
    k_out[((long long)b * Hv + hv0) * dk + e] = qk[dk + i] * ik;
  }
  for (int j = threadIdx.x; j < r; j += blockDim.x) {
    const int hv = hv0 + j;
    const long long o = (long long)b * Hv + hv;
    beta_out[o] = (flags & 2) ? beta_scale / (1.0f + expf(-to_f(bv[(long long)b * bs + hv]))) : 1.0f;
    g_out[o] = (flags & 4) ? neg_a[hv] * softplus_f(to_f(av[(long long)b * as + hv]) + dt_bias[hv]) : 0.0f;
  }
}

#define DECODE_PREP(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *x, long long xs, const float *conv_state, const T *w,       \
                                  const T *bias, const T *bv, long long bs, const T *av, long long as,  \
                                  const float *neg_a, const float *dt_bias, float *out, float *st_out,  \
                                  int B, int H, int Hv, int dk, int dv, int K, int flags,               \
                                  float beta_scale, float eps) {                                        \
    delta_decode_prep<T>(x, xs, conv_state, w, bias, bv, bs, av, as, neg_a, dt_bias, out, st_out, B, H,  \
                         Hv, dk, dv, K, flags, beta_scale, eps);                                         \
  }
DECODE_PREP(delta_decode_prep_f32, float)
DECODE_PREP(delta_decode_prep_bf16, __nv_bfloat16)
DECODE_PREP(delta_decode_prep_f16, __half)

// The recurrence's float32 output o [rows = B·Hv, n] rounded to T (as the layer's output is),
// RMS-normed with the float32 weight w and, when g is given, gated by silu(g): g's row
// b·Hv + h starts at g + b·gs + h·n (read only when `gated`). One warp per row; y [rows, n] in T.
template <typename T>
__device__ void out_norm(const float *__restrict__ x, const T *__restrict__ g, long long gs, int heads, int gated,
                         const float *__restrict__ w, T *__restrict__ y, int rows, int n, float eps) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float *xr = x + (long long)row * n;
  const T *gr = gated ? g + (long long)(row / heads) * gs + (long long)(row % heads) * n : nullptr;
  T *yr = y + (long long)row * n;
  float ss = 0.0f;
  for (int i = lane; i < n; i += 32) {
    const float v = to_f(from_f<T>(xr[i]));
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float inv = rsqrtf(ss / n + eps);
  for (int i = lane; i < n; i += 32) {
    float v = to_f(from_f<T>(xr[i])) * inv * w[i];
    if (gr) {
      const float gv = to_f(gr[i]);
      v *= gv / (1.0f + expf(-gv));
    }
    yr[i] = from_f<T>(v);
  }
}

#define OUT_NORM(NAME, T)                                                                            \
  extern "C" __global__ void NAME(const float *x, const T *g, long long gs, int heads, int gated,      \
                                  const float *w, T *y, int rows, int n, float eps) {                \
    out_norm<T>(x, g, gs, heads, gated, w, y, rows, n, eps);                                         \
  }
OUT_NORM(out_norm_f32, float)
OUT_NORM(out_norm_bf16, __nv_bfloat16)
OUT_NORM(out_norm_f16, __half)
