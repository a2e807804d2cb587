// The depthwise causal short conv (+ SiLU) and its backward (src/ops/conv.rs).
#pragma once
#include "common.cuh"

// Depthwise causal short convolution over x [B, L, C] (row t of sequence b at (b L + t) xs, so a
// column slice of a wider projection output is read where it lies) with weight [C, K] and bias
// [C], optionally followed by SiLU: y[b,t,c] = act(bias[c] + sum_i w[c,i] x[b, t+i-pad, c]), zero
// outside [0, L); y [B, T_out, C] contiguous. pad = K-1 is a fresh sequence; pad = 0 with the
// last K-1 inputs prepended continues one.
// One thread per channel and CONV_TILE consecutive steps of one sequence. The thread loads the
// CONV_TILE + 7 inputs its steps read into registers before computing any of them: the loads
// are independent, so they are in flight together, where loads interleaved with the outputs'
// stores would each wait for the one before. No index needs a division per element.
#define CONV_TILE 16
template <typename T>
__device__ void conv_silu(const T *__restrict__ x, long long xs, const T *__restrict__ w,
                          const T *__restrict__ bias, T *__restrict__ y, int B, int L, int T_out, int C, int K,
                          int pad, int act) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int tiles = (T_out + CONV_TILE - 1) / CONV_TILE;
  if (c >= C) return;
  const float bc = to_f(bias[c]);
  for (long long bt = blockIdx.y; bt < (long long)B * tiles; bt += gridDim.y) {
    const int b = bt / tiles, t0 = (bt % tiles) * CONV_TILE, t1 = min(t0 + CONV_TILE, T_out);
    const T *xb = x + (long long)b * L * xs + c;
    T *yb = y + (long long)b * T_out * C + c;
    auto in = [&](int s) { return (s >= 0 && s < L) ? to_f(xb[(long long)s * xs]) : 0.0f; };
    if (K <= 8) {
      // Tap i of step t reads x[t + i - pad] = xin[t - t0 + j] with j = i + 8 - K: slot m of xin
      // holds x[t0 - 7 + (K - 1 - pad) + m].
      const int base = t0 - 7 + K - 1 - pad;
      float wa[8], xin[CONV_TILE + 7];
#pragma unroll
      for (int j = 0; j < 8; j++) {
        const int i = j - (8 - K);
        wa[j] = i >= 0 ? to_f(w[c * K + i]) : 0.0f;
      }
#pragma unroll
      for (int m = 0; m < CONV_TILE + 7; m++) xin[m] = in(base + m);
#pragma unroll
      for (int u = 0; u < CONV_TILE; u++) {
        float acc = bc;
#pragma unroll
        for (int j = 0; j < 8; j++)
          if (j >= 8 - K) acc += wa[j] * xin[u + j];
        if (act) acc = acc / (1.0f + expf(-acc));
        if (t0 + u < t1) yb[(long long)(t0 + u) * C] = from_f<T>(acc);
      }
    } else {
      for (int t = t0; t < t1; t++) {
        float acc = bc;
        for (int i = 0; i < K; i++) acc += to_f(w[c * K + i]) * in(t + i - pad);
        if (act) acc = acc / (1.0f + expf(-acc));
        yb[(long long)t * C] = from_f<T>(acc);
      }
    }
  }
}

#define CONV(NAME, T)                                                                               \
  extern "C" __global__ void NAME(const T *x, long long xs, const T *w, const T *bias, T *y, int B,  \
                                  int L, int T_out, int C, int K, int pad, int act) {              \
    conv_silu<T>(x, xs, w, bias, y, B, L, T_out, C, K, pad, act);                                  \
  }
CONV(conv_silu_f32, float)
CONV(conv_silu_bf16, __nv_bfloat16)
CONV(conv_silu_f16, __half)

// conv_silu for K <= 4 with 16-byte accesses: each thread takes V = 16 / sizeof(T) consecutive
// channels of CONV_VT consecutive steps of one sequence, a warp 512 contiguous bytes of a row
// (the scalar kernel's warps read 64 bytes a row and drew 16% of the H200's DRAM bandwidth).
// The caller checks that C, the row stride and x's offset are multiples of V. Slot m of xin
// holds x[t0 - 3 + (K - 1 - pad) + m]; tap i of step t0 + u reads slot u + i + 4 - K. Capped at
// 128 registers (four blocks an SM), where the compiler took 158; 4 steps a thread measured
// slower than 8.
#define CONV_VT 8
template <typename T>
__device__ void conv_silu_vec(const T *__restrict__ x, long long xs, const T *__restrict__ w,
                              const T *__restrict__ bias, T *__restrict__ y, int B, int L, int T_out, int C, int K,
                              int pad, int act) {
  constexpr int V = 16 / sizeof(T);
  const int groups = C / V, tiles = (T_out + CONV_VT - 1) / CONV_VT;
  const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid >= (long long)B * tiles * groups) return;
  const int c0 = (int)(gid % groups) * V;
  const long long bt = gid / groups;
  const int b = (int)(bt / tiles), t0 = (int)(bt % tiles) * CONV_VT;
  float wv[4][V], bv[V];
#pragma unroll
  for (int e = 0; e < V; e++) {
    bv[e] = to_f(bias[c0 + e]);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int i = j - (4 - K);
      wv[j][e] = i >= 0 ? to_f(w[(c0 + e) * K + i]) : 0.0f;
    }
  }
  const int base = t0 - 3 + K - 1 - pad;
  const T *xb = x + (long long)b * L * xs + c0;
  Pack16<T> xin[CONV_VT + 3];
#pragma unroll
  for (int m = 0; m < CONV_VT + 3; m++) {
    const int s = base + m;
    if (s >= 0 && s < L) {
      xin[m] = *reinterpret_cast<const Pack16<T> *>(xb + (long long)s * xs);
    } else {
#pragma unroll
      for (int e = 0; e < V; e++) xin[m].v[e] = from_f<T>(0.0f);
    }
  }
  T *yb = y + (long long)b * T_out * C + c0;
#pragma unroll
  for (int u = 0; u < CONV_VT; u++) {
    if (t0 + u >= T_out) break;
    Pack16<T> out;
#pragma unroll
    for (int e = 0; e < V; e++) {
      float acc = bv[e];
#pragma unroll
      for (int j = 0; j < 4; j++) acc += wv[j][e] * to_f(xin[u + j].v[e]);
      // Hardware exp and reciprocal: IEEE division's slow path was half the kernel's code.
      if (act) acc *= __fdividef(1.0f, 1.0f + __expf(-acc));
      out.v[e] = from_f<T>(acc);
    }
    *reinterpret_cast<Pack16<T> *>(yb + (long long)(t0 + u) * C) = out;
  }
}

#define CONV_VEC(NAME, T)                                                                           \
  extern "C" __global__ void __launch_bounds__(128, 4) NAME(const T *x, long long xs, const T *w, const T *bias, \
                                                            T *y, int B, int L, int T_out, int C, int K, int pad,  \
                                                            int act) {                                            \
    conv_silu_vec<T>(x, xs, w, bias, y, B, L, T_out, C, K, pad, act);                              \
  }
CONV_VEC(conv_silu_vec_f32, float)
CONV_VEC(conv_silu_vec_bf16, __nv_bfloat16)
CONV_VEC(conv_silu_vec_f16, __half)

// The backward of conv_silu's causal form (pad = K - 1, T_out = L, K <= 8): with
// pre[t] = bias + sum_i w[i] x[t-K+1+i] and y = silu(pre) (or pre), it writes dx [B, L, C] in
// x's dtype (the layer's gradient needs no cast afterwards) and, per tile of `tt` steps of one
// sequence, the partial sums of dw and dbias
// (part[(c*(K+1) + i) * ntiles + tile], i = K for the bias), which the caller adds up. One
// thread per channel walks its tile once: dpre is recomputed from a sliding window of W >= K
// steps of x, and dx[s] = sum_i w[i] dpre[s+K-1-i] is emitted W - 1 steps behind, when its dpre
// are all known. Slot j of the windows holds step t - (W - 1) + j (tap i = j - (W - K)), so
// every index is static. W = 4 serves K <= 4 (every released model's conv) within 64 registers
// (four blocks an SM) where W = 8 took 96 (two): twice the warps to hide the loads behind.
template <typename T, int W>
__device__ void conv_silu_bwd(const T *__restrict__ x, long long xs, const float *__restrict__ wb,
                              const T *__restrict__ dy, T *__restrict__ dx, float *__restrict__ part, int B, int L,
                              int C, int K, int act, int tt) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int tiles = (L + tt - 1) / tt;
  const long long ntiles = (long long)B * tiles;
  float wr[W];
#pragma unroll
  for (int j = 0; j < W; j++) {
    const int i = j - (W - K);
    wr[j] = i >= 0 ? wb[c * (K + 1) + i] : 0.0f;
  }
  const float bc = wb[c * (K + 1) + K];
  for (long long bt = blockIdx.y; bt < ntiles; bt += gridDim.y) {
    const int b = bt / tiles, t0 = (bt % tiles) * tt, t1 = min(t0 + tt, L);
    const T *xb = x + (long long)b * L * xs + c;
    const T *gb = dy + (long long)b * L * C + c;
    T *dxb = dx + (long long)b * L * C + c;
    auto in = [&](int s) { return (s >= 0 && s < L) ? to_f(xb[(long long)s * xs]) : 0.0f; };
    float xw[W], dq[W], dwr[W], dbias = 0.0f;
#pragma unroll
    for (int j = 0; j < W; j++) {
      xw[j] = j > 0 ? in(t0 - W + j) : 0.0f;
      dq[j] = 0.0f;
      dwr[j] = 0.0f;
    }
    // Eight steps at a time: their inputs and gradients are loaded together first, so the loads
    // overlap instead of each waiting behind the previous step's store.
    for (int tb = t0; tb < t1 + W - 1; tb += 8) {
      float xg[8], dg[8];
#pragma unroll
      for (int u = 0; u < 8; u++) {
        xg[u] = in(tb + u);
        dg[u] = tb + u < L ? to_f(gb[(long long)(tb + u) * C]) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 8; u++) {
        const int t = tb + u;
        if (t >= t1 + W - 1) break;
#pragma unroll
        for (int j = 0; j < W - 1; j++) {
          xw[j] = xw[j + 1];
          dq[j] = dq[j + 1];
        }
        xw[W - 1] = xg[u];
        float d = dg[u];
        if (t < L && act) {
          float pre = bc;
#pragma unroll
          for (int j = 0; j < W; j++) pre += wr[j] * xw[j];
          const float s = 1.0f / (1.0f + expf(-pre));
          d *= s * (1.0f + pre * (1.0f - s));
        }
        dq[W - 1] = d;
        if (t < t1) {
#pragma unroll
          for (int j = 0; j < W; j++) dwr[j] += d * xw[j];
          dbias += d;
        }
        const int s = t - (W - 1);
        if (s >= t0) {
          float acc = 0.0f;
#pragma unroll
          for (int j = 0; j < W; j++) acc += wr[j] * dq[W - 1 - j];
          dxb[(long long)s * C] = from_f<T>(acc);
        }
      }
    }
    float *pc = part + (long long)c * (K + 1) * ntiles + bt;
#pragma unroll
    for (int j = 0; j < W; j++)
      if (j >= W - K) pc[(long long)(j - (W - K)) * ntiles] = dwr[j];
    pc[(long long)K * ntiles] = dbias;
  }
}

#define CONV_BWD(NAME, T, W, BOUNDS)                                                                  \
  extern "C" __global__ void BOUNDS NAME(const T *x, long long xs, const float *wb, const T *dy, T *dx, float *part, \
                                  int B, int L, int C, int K, int act, int tt) {                     \
    conv_silu_bwd<T, W>(x, xs, wb, dy, dx, part, B, L, C, K, act, tt);                                \
  }
#define CONV_BWD4_BOUNDS __launch_bounds__(256, 4)
CONV_BWD(conv_silu_bwd_f32, float, 8, )
CONV_BWD(conv_silu_bwd_bf16, __nv_bfloat16, 8, )
CONV_BWD(conv_silu_bwd_f16, __half, 8, )
CONV_BWD(conv_silu_bwd4_f32, float, 4, CONV_BWD4_BOUNDS)
CONV_BWD(conv_silu_bwd4_bf16, __nv_bfloat16, 4, CONV_BWD4_BOUNDS)
CONV_BWD(conv_silu_bwd4_f16, __half, 4, CONV_BWD4_BOUNDS)
