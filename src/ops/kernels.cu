// CUDA kernels behind statecut's custom ops (launched from src/ops/cuda.rs). Compiled by build.rs
// with `--features cuda`; the CPU halves of the same ops live in Rust and define the semantics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// Depthwise causal short convolution over x [B, L, C] with weight [C, K] and bias [C], optionally
// followed by SiLU: y[b,t,c] = act(bias[c] + sum_i w[c,i] x[b, t+i-pad, c]), zero outside [0, L).
// pad = K-1 is a fresh sequence; pad = 0 with the last K-1 inputs prepended continues one.
template <typename T>
__device__ void conv_silu(const T *x, const T *w, const T *bias, T *y, int B, int L, int T_out, int C,
                          int K, int pad, int act) {
  int64_t n = (int64_t)B * T_out * C;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
       idx += (int64_t)gridDim.x * blockDim.x) {
    int c = idx % C;
    int64_t bt = idx / C;
    int t = bt % T_out;
    int b = bt / T_out;
    float acc = to_f(bias[c]);
    for (int i = 0; i < K; i++) {
      int s = t + i - pad;
      if (s >= 0 && s < L) acc += to_f(w[c * K + i]) * to_f(x[((int64_t)b * L + s) * C + c]);
    }
    if (act) acc = acc / (1.0f + expf(-acc));
    y[idx] = from_f<T>(acc);
  }
}

#define CONV(NAME, T)                                                                               \
  extern "C" __global__ void NAME(const T *x, const T *w, const T *bias, T *y, int B, int L,         \
                                  int T_out, int C, int K, int pad, int act) {                     \
    conv_silu<T>(x, w, bias, y, B, L, T_out, C, K, pad, act);                                      \
  }
CONV(conv_silu_f32, float)
CONV(conv_silu_bf16, __nv_bfloat16)
CONV(conv_silu_f16, __half)

// The (gated) delta rule / linear attention recurrence of src/ops/delta_rule.rs, sequential in
// time and float32 throughout, one thread block per (sequence, head, column tile of the state).
//
// Input x is the packed [B, T, H, P] layout of that module: q | k | v | beta | g | gk (gk only
// when has_gk), P = 2dk + dv + 2 (+ dk). Each state column j (a value channel) is held by R
// threads of one warp, thread r owning key rows r, r+R, r+2R, ... in registers, so a step needs
// no barrier: two warp-shuffle reductions over the R threads (S'ᵀk and Sᵀq). The block stages
// `tc` time steps of its inputs in shared memory at a time with coalesced loads, which takes the
// global-memory latency off the per-step critical path; interleaved rows keep the R threads of a
// column on distinct banks.
// Output: o [B, T, H, dv] followed by the final state [B, H, dk, dv].
template <int MAXR, bool GK, bool FULL>
__device__ void recurrence(const float *__restrict__ x, const float *__restrict__ s0, float *__restrict__ out,
                           int B, int T, int H, int dk, int dv, int R, int rows, int delta, float scale, int tc) {
  extern __shared__ float stage[];
  const int P = 2 * dk + dv + 2 + (GK ? dk : 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane % R;
  const int cols_per_warp = 32 / R;
  const int cols = (blockDim.x >> 5) * cols_per_warp;  // state columns of this block
  const int col0 = blockIdx.x * cols;
  const int lc = warp * cols_per_warp + lane / R;      // this thread's column within the block
  const int col = col0 + lc;
  const bool valid = col < dv;
  const int bh = blockIdx.y, b = bh / H, h = bh % H;
  // One staged step: q[dk] | k[dk] | v[cols] | beta | g | gk[dk]
  const int W = 2 * dk + cols + 2 + (GK ? dk : 0);
  const int vb = 2 * dk, sb = 2 * dk + cols, gkb = sb + 2;

  float s[MAXR];
  const float *init = s0 + (int64_t)bh * dk * dv;
#pragma unroll
  for (int m = 0; m < MAXR; m++) {
    const int i = m * R + r;
    s[m] = ((FULL || (m < rows && i < dk)) && valid) ? init[(int64_t)i * dv + col] : 0.0f;
  }
  for (int t0 = 0; t0 < T; t0 += tc) {
    const int n = min(tc, T - t0);
    __syncthreads();  // the previous chunk is consumed
    // UNROLL independent loads in flight per thread before any is stored.
    constexpr int UNROLL = 8;
    for (int base = 0; base < n * W; base += UNROLL * blockDim.x) {
      float vals[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int e = base + u * blockDim.x + threadIdx.x;
        vals[u] = 0.0f;
        if (e < n * W) {
          const int st = e / W, f = e - st * W;
          const float *xt = x + (((int64_t)b * T + t0 + st) * H + h) * P;
          if (f < vb) {
            vals[u] = xt[f];
          } else if (f < sb) {
            const int j = col0 + f - vb;
            vals[u] = j < dv ? xt[2 * dk + j] : 0.0f;
          } else {
            vals[u] = xt[2 * dk + dv + (f - sb)];  // beta, g, then gk
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int e = base + u * blockDim.x + threadIdx.x;
        if (e < n * W) stage[e] = vals[u];
      }
    }
    __syncthreads();
    for (int st = 0; st < n; st++) {
      const float *xs = stage + st * W;
      const float beta = xs[sb];
      const float a = expf(xs[sb + 1]);
      const float v = xs[vb + lc];
      // GK and FULL are compile-time: the unrolled loops below have no branches, so the
      // shared-memory loads can be issued ahead of the arithmetic that uses them.
      float kk[MAXR];
      // Four partial sums shorten the dependent FMA chains from MAXR to MAXR / 4.
      float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
#pragma unroll
      for (int m = 0; m < MAXR; m++) {
        const int i = m * R + r;
        const bool in = FULL || (m < rows && i < dk);
        kk[m] = in ? xs[dk + i] : 0.0f;
        if (GK) {
          s[m] *= in ? a * expf(xs[gkb + i]) : a;
        } else {
          s[m] *= a;
        }
        const float d = s[m] * kk[m];
        if ((m & 3) == 0) p0 += d;
        else if ((m & 3) == 1) p1 += d;
        else if ((m & 3) == 2) p2 += d;
        else p3 += d;
      }
      float pred = (p0 + p1) + (p2 + p3);
      for (int off = 1; off < R; off <<= 1) pred += __shfl_xor_sync(0xffffffffu, pred, off);
      const float u = delta ? beta * (v - pred) : beta * v;
      p0 = p1 = p2 = p3 = 0.0f;
#pragma unroll
      for (int m = 0; m < MAXR; m++) {
        const int i = m * R + r;
        const bool in = FULL || (m < rows && i < dk);
        s[m] += kk[m] * u;
        const float d = s[m] * (in ? xs[i] : 0.0f);
        if ((m & 3) == 0) p0 += d;
        else if ((m & 3) == 1) p1 += d;
        else if ((m & 3) == 2) p2 += d;
        else p3 += d;
      }
      float acc = (p0 + p1) + (p2 + p3);
      for (int off = 1; off < R; off <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (r == 0 && valid) out[(((int64_t)b * T + t0 + st) * H + h) * dv + col] = scale * acc;
    }
  }
  float *state = out + (int64_t)B * T * H * dv + (int64_t)bh * dk * dv;
#pragma unroll
  for (int m = 0; m < MAXR; m++) {
    const int i = m * R + r;
    if ((FULL || (m < rows && i < dk)) && valid) state[(int64_t)i * dv + col] = s[m];
  }
}

// recurrence_{MAXR}_{gk}{full}: gk = per-key-channel decay, full = every thread owns exactly
// MAXR rows (dk = R * MAXR), so no row needs a bounds check.
#define REC1(MAXR, GK, FULL, SUFFIX)                                                               \
  extern "C" __global__ void recurrence_##MAXR##_##SUFFIX(                                         \
      const float *x, const float *s0, float *out, int B, int T, int H, int dk, int dv, int R,     \
      int rows, int delta, float scale, int tc) {                                                  \
    recurrence<MAXR, GK, FULL>(x, s0, out, B, T, H, dk, dv, R, rows, delta, scale, tc);            \
  }
#define REC(MAXR)                  \
  REC1(MAXR, false, false, 00)     \
  REC1(MAXR, false, true, 01)      \
  REC1(MAXR, true, false, 10)      \
  REC1(MAXR, true, true, 11)
REC(8)
REC(16)
REC(32)
