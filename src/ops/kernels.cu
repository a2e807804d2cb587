// CUDA kernels behind statecut's custom ops (launched from src/ops/cuda.rs). Compiled by build.rs
// with `--features cuda`; the CPU halves of the same ops live in Rust and define the semantics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// The sum of x over the 32 lanes of a warp, every lane getting it.
__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Sixteen bytes of T, loaded or stored as one access (the caller checks the alignment).
template <typename T> struct __align__(16) Pack16 {
  T v[16 / sizeof(T)];
};

// The 16 / sizeof(T) values of T at p (16-byte aligned) as floats.
template <typename T> __device__ __forceinline__ void load16(const T *p, float *f) {
  const Pack16<T> pk = *reinterpret_cast<const Pack16<T> *>(p);
#pragma unroll
  for (int e = 0; e < 16 / (int)sizeof(T); e++) f[e] = to_f(pk.v[e]);
}

// N floats (N a multiple of 4) at p, 16-byte aligned, loaded and stored four at a time.
template <int N> __device__ __forceinline__ void load_floats(const float *p, float *f) {
#pragma unroll
  for (int e = 0; e < N; e += 4) {
    const float4 q = *reinterpret_cast<const float4 *>(p + e);
    f[e] = q.x, f[e + 1] = q.y, f[e + 2] = q.z, f[e + 3] = q.w;
  }
}
template <int N> __device__ __forceinline__ void store_floats(float *p, const float *f) {
#pragma unroll
  for (int e = 0; e < N; e += 4) *reinterpret_cast<float4 *>(p + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
}

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

// Gated RMSNorm over rows of width n: y = x / sqrt(mean(x²) + eps) · w · silu(g), in float32,
// rounded once to T (fla FusedRMSNormGated, Qwen3.5's gated norm). One warp per row.
template <typename T>
__device__ void gated_rms(const T *__restrict__ x, const T *__restrict__ g, const float *__restrict__ w,
                          T *__restrict__ y, int rows, int n, float eps, int gated) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T *xr = x + (int64_t)row * n;
  const T *gr = g + (int64_t)row * n;
  T *yr = y + (int64_t)row * n;
  float ss = 0.0f;
  for (int i = lane; i < n; i += 32) {
    const float v = to_f(xr[i]);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float inv = rsqrtf(ss / n + eps);
  for (int i = lane; i < n; i += 32) {
    const float gv = gated ? to_f(gr[i]) : 0.0f;
    yr[i] = from_f<T>(to_f(xr[i]) * inv * w[i] * (gated ? gv / (1.0f + expf(-gv)) : 1.0f));
  }
}

#define GATED_RMS(NAME, T)                                                                          \
  extern "C" __global__ void NAME(const T *x, const T *g, const float *w, T *y, int rows, int n,    \
                                  float eps, int gated) {                                          \
    gated_rms<T>(x, g, w, y, rows, n, eps, gated);                                                  \
  }
GATED_RMS(gated_rms_f32, float)
GATED_RMS(gated_rms_bf16, __nv_bfloat16)
GATED_RMS(gated_rms_f16, __half)

// The backward of gated_rms (gated or not) over rows of width n <= RMS_BWD_MAX_N: with
// x^ = x r, r = (mean(x^2) + eps)^(-1/2), y = x^ w s(g), s = silu (or 1), and u = dy s(g):
// dx = r (u w - x^ mean(u w x^)), dg = dy x^ w silu'(g), dw = sum over rows of u x^. Float32
// out: dx [rows n], then dg [rows n] when gated, then partial dw [blocks * warps, n] (the
// caller adds them up). One warp per row, RMS_BWD_ROWS rows per block; each warp sums dw over
// its rows into its own row of the partials, in a fixed order, so the result does not depend
// on scheduling as shared-memory atomics would.
#define RMS_BWD_ROWS 64
// With `vec` (n a multiple of 16 bytes of T, every operand 16-byte aligned) each lane takes 16
// bytes of a row at a time, a quarter to an eighth of the load and store instructions.
// dx and dg are written in x's dtype, dx as res + dx where `res` is given (a residual step's
// input gradient: the step's output gradient plus the norm's), so that neither is cast or
// added afterwards; `out` holds the dw partials.
template <typename T>
__device__ void rms_bwd(const T *__restrict__ x, const T *__restrict__ g, const float *__restrict__ w,
                        const T *__restrict__ dy, const T *__restrict__ res, T *__restrict__ dxt,
                        T *__restrict__ dgt, float *__restrict__ out, int rows, int n, float eps, int gated, int vec) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float *dw = out + ((int64_t)blockIdx.x * warps + warp) * n;
  const int r0 = blockIdx.x * RMS_BWD_ROWS, r1 = min(r0 + RMS_BWD_ROWS, rows);
  // The lane's first column and step: packs of V when vectorised. A lane zeroes the partial dw
  // it later adds to, so no other lane's write needs to be visible to it.
  const int i0 = vec ? lane * V : lane, step = vec ? 32 * V : 32, width = vec ? V : 1;
  for (int i = i0; i < n; i += step)
    for (int e = 0; e < width; e++) dw[i + e] = 0.0f;
  for (int row = r0 + warp; row < r1; row += warps) {
    const T *xr = x + (int64_t)row * n, *gr = g + (int64_t)row * n, *dr = dy + (int64_t)row * n;
    // Values [i, i + width) of a row of T as floats.
    auto get = [&](const T *r, int i, float *f) {
      if (vec) {
        load16(r + i, f);
      } else {
        f[0] = to_f(r[i]);
      }
    };
    float ss = 0.0f, dot = 0.0f;
    for (int i = i0; i < n; i += step) {
      float xv[V], dv[V], gv[V], wv[V];
      get(xr, i, xv);
      get(dr, i, dv);
      if (gated) get(gr, i, gv);
      if (vec) {
        load_floats<V>(w + i, wv);
      } else {
        wv[0] = w[i];
      }
#pragma unroll
      for (int e = 0; e < V; e++) {
        if (e >= width) break;
        float u = dv[e];
        if (gated) u *= gv[e] / (1.0f + expf(-gv[e]));
        ss += xv[e] * xv[e];
        dot += u * wv[e] * xv[e];
      }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float inv = rsqrtf(ss / n + eps);
    // mean(u w x^) = inv · dot / n
    const float m = inv * dot / n;
    for (int i = i0; i < n; i += step) {
      float xv[V], dv[V], gv[V], wv[V], ox[V], og[V], ow[V];
      get(xr, i, xv);
      get(dr, i, dv);
      if (gated) get(gr, i, gv);
      if (vec) {
        load_floats<V>(w + i, wv);
        load_floats<V>(dw + i, ow);
      } else {
        wv[0] = w[i];
        ow[0] = dw[i];
      }
#pragma unroll
      for (int e = 0; e < V; e++) {
        if (e >= width) break;
        const float xh = xv[e] * inv, d = dv[e];
        float sg = 1.0f;
        if (gated) {
          const float sig = 1.0f / (1.0f + expf(-gv[e]));
          sg = gv[e] * sig;
          og[e] = d * xh * wv[e] * sig * (1.0f + gv[e] * (1.0f - sig));
        }
        const float u = d * sg;
        ox[e] = inv * (u * wv[e] - xh * m);
        ow[e] += u * xh;
      }
      float rv[V] = {};
      if (res) {
        if (vec) {
          load16(res + (int64_t)row * n + i, rv);
        } else {
          rv[0] = to_f(res[(int64_t)row * n + i]);
        }
      }
      T *xt = dxt + (int64_t)row * n + i, *gt = gated ? dgt + (int64_t)row * n + i : nullptr;
      if (vec) {
        Pack16<T> px, pg;
#pragma unroll
        for (int e = 0; e < V; e++) {
          px.v[e] = from_f<T>(rv[e] + ox[e]);
          if (gated) pg.v[e] = from_f<T>(og[e]);
        }
        *reinterpret_cast<Pack16<T> *>(xt) = px;
        if (gated) *reinterpret_cast<Pack16<T> *>(gt) = pg;
        store_floats<V>(dw + i, ow);
      } else {
        *xt = from_f<T>(rv[0] + ox[0]);
        if (gated) *gt = from_f<T>(og[0]);
        dw[i] = ow[0];
      }
    }
  }
}

#define RMS_BWD(SUFFIX, T)                                                                                    \
  extern "C" __global__ void rms_bwd_##SUFFIX(const T *x, const T *g, const float *w, const T *dy, const T *res,  \
                                              T *dxt, T *dgt, float *out, int rows, int n, float eps, int gated, \
                                              int has_res, int vec) {                                          \
    rms_bwd<T>(x, g, w, dy, has_res ? res : nullptr, dxt, dgt, out, rows, n, eps, gated, vec);                \
  }
RMS_BWD(f32, float)
RMS_BWD(bf16, __nv_bfloat16)
RMS_BWD(f16, __half)

// The recovery loss's rows (src/ops/distill.rs): per row of student logits s and teacher
// logits t over a vocabulary of v, out[row] = {ce, kl, lse(s), lse(s/T), lse(t/T)} with
// ce = lse(s) - s[y] and kl = KL(softmax(t/T) || softmax(s/T)) = sum p_t (t - s)/T - lse(t/T)
// + lse(s/T). One block per row; each thread keeps online (max, sums) over its columns, which
// the block then merges, so the row is read once. Without a teacher (kd 0) t is not read.
#define KD_THREADS 256
struct KdPart {
  float m, s1, st, mt, tt, a;
};

__device__ __forceinline__ void kd_merge(KdPart &x, const KdPart &o, float it) {
  if (o.m > -INFINITY) {
    if (o.m > x.m) {
      const float c = x.m > -INFINITY ? expf(x.m - o.m) : 0.0f, ct = x.m > -INFINITY ? expf((x.m - o.m) * it) : 0.0f;
      x.s1 = x.s1 * c + o.s1;
      x.st = x.st * ct + o.st;
      x.m = o.m;
    } else {
      x.s1 += o.s1 * expf(o.m - x.m);
      x.st += o.st * expf((o.m - x.m) * it);
    }
  }
  if (o.mt > -INFINITY) {
    if (o.mt > x.mt) {
      const float c = x.mt > -INFINITY ? expf((x.mt - o.mt) * it) : 0.0f;
      x.tt = x.tt * c + o.tt;
      x.a = x.a * c + o.a;
      x.mt = o.mt;
    } else {
      const float c = expf((o.mt - x.mt) * it);
      x.tt += o.tt * c;
      x.a += o.a * c;
    }
  }
}

template <typename T>
__device__ void kd_rows(const T *__restrict__ s, const T *__restrict__ t, const unsigned *__restrict__ y,
                        float *__restrict__ out, int v, float it, int kd) {
  const int64_t row = blockIdx.x;
  const T *sr = s + row * v, *tr = t + row * v;
  KdPart p = {-INFINITY, 0.0f, 0.0f, -INFINITY, 0.0f, 0.0f};
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    const float xs = to_f(sr[j]);
    KdPart q = {xs, 1.0f, 1.0f, -INFINITY, 0.0f, 0.0f};
    if (kd) {
      const float xt = to_f(tr[j]);
      q.mt = xt;
      q.tt = 1.0f;
      q.a = (xt - xs) * it;
    }
    kd_merge(p, q, it);
  }
  for (int off = 16; off > 0; off >>= 1) {
    KdPart o;
    o.m = __shfl_xor_sync(0xffffffffu, p.m, off);
    o.s1 = __shfl_xor_sync(0xffffffffu, p.s1, off);
    o.st = __shfl_xor_sync(0xffffffffu, p.st, off);
    o.mt = __shfl_xor_sync(0xffffffffu, p.mt, off);
    o.tt = __shfl_xor_sync(0xffffffffu, p.tt, off);
    o.a = __shfl_xor_sync(0xffffffffu, p.a, off);
    kd_merge(p, o, it);
  }
  __shared__ KdPart warps[KD_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warps[warp] = p;
  __syncthreads();
  if (threadIdx.x != 0) return;
  // Merged in a fixed order: the result does not depend on scheduling.
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) kd_merge(p, warps[w], it);
  const float lse1 = p.m + logf(p.s1), lse_s = p.m * it + logf(p.st);
  const unsigned target = y[row];
  float *o = out + row * 5;
  o[0] = target < (unsigned)v ? lse1 - to_f(sr[target]) : __int_as_float(0x7fc00000);
  o[2] = lse1;
  o[3] = lse_s;
  if (kd) {
    const float lse_t = p.mt * it + logf(p.tt);
    o[1] = p.a / p.tt - lse_t + lse_s;
    o[4] = lse_t;
  } else {
    o[1] = 0.0f;
    o[4] = 0.0f;
  }
}

#define KD_ROWS(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *s, const T *t, const unsigned *y, float *out, int v,   \
                                  float it, int kd) {                                              \
    kd_rows<T>(s, t, y, out, v, it, kd);                                                            \
  }
KD_ROWS(kd_rows_f32, float)
KD_ROWS(kd_rows_bf16, __nv_bfloat16)
KD_ROWS(kd_rows_f16, __half)

// The backward of kd_rows: aux[row] = {target, d ce, d kl, lse(s), lse(s/T), lse(t/T)};
// ds = dce (softmax(s) - onehot(y)) + dkl / T (softmax(s/T) - softmax(t/T)), in T.
template <typename T>
__device__ void kd_rows_bwd(const T *__restrict__ s, const T *__restrict__ t, const float *__restrict__ aux,
                            T *__restrict__ ds, int v, float it, int kd) {
  const int64_t row = blockIdx.x;
  const float *a = aux + row * 6;
  const int y = (int)a[0];
  const float dce = a[1], dkl = a[2], lse1 = a[3], lse_s = a[4], lse_t = a[5];
  const T *sr = s + row * v, *tr = t + row * v;
  T *dr = ds + row * v;
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    const float x = to_f(sr[j]);
    float d = dce * (expf(x - lse1) - (j == y ? 1.0f : 0.0f));
    if (kd) d += dkl * it * (expf(x * it - lse_s) - expf(to_f(tr[j]) * it - lse_t));
    dr[j] = from_f<T>(d);
  }
}

#define KD_ROWS_BWD(NAME, T)                                                                       \
  extern "C" __global__ void NAME(const T *s, const T *t, const float *aux, T *ds, int v, float it, \
                                  int kd) {                                                        \
    kd_rows_bwd<T>(s, t, aux, ds, v, it, kd);                                                       \
  }
KD_ROWS_BWD(kd_rows_bwd_f32, float)
KD_ROWS_BWD(kd_rows_bwd_bf16, __nv_bfloat16)
KD_ROWS_BWD(kd_rows_bwd_f16, __half)

// The (gated) delta rule / linear attention recurrence of src/ops/delta_rule.rs, sequential in
// time and float32 throughout, one thread block per (sequence, head, column tile of the state).
// This general kernel serves key widths `recurrence_tiled` below has no instance for.
//
// Inputs, float32 and contiguous: q, k [B, T, H, dk], v [B, T, H, dv], beta, g [B, T, H] (g
// read only when `gated`, else no decay), gk [B, T, H, dk] (only when GK). Each state column j
// (a value channel) is held by R threads of one warp, thread r owning key rows r, r+R, r+2R, ... in registers, so a step needs
// no barrier: two warp-shuffle reductions over the R threads (S'ᵀk and Sᵀq). The block stages
// `tc` time steps of its inputs in shared memory at a time with coalesced loads, which takes the
// global-memory latency off the per-step critical path; interleaved rows keep the R threads of a
// column on distinct banks.
// Output: o [B, T, H, dv] to `out`, the final state [B, H, dk, dv] to `state_out`, which may be
// s0 itself (an in-place step: every thread reads its state before the loop and writes the same
// elements after it).
template <int MAXR, bool GK, bool FULL>
__device__ void recurrence(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                           const float *__restrict__ beta, const float *__restrict__ g,
                           const float *__restrict__ gk, const float *s0, float *__restrict__ out,
                           float *state_out, int B, int T, int H, int dk, int dv, int R, int rows, int gated,
                           int delta, float scale, int tc) {
  extern __shared__ float stage[];
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
          const int64_t tok = ((int64_t)b * T + t0 + st) * H + h;
          if (f < dk) {
            vals[u] = q[tok * dk + f];
          } else if (f < vb) {
            vals[u] = k[tok * dk + f - dk];
          } else if (f < sb) {
            const int j = col0 + f - vb;
            vals[u] = j < dv ? v[tok * dv + j] : 0.0f;
          } else if (f == sb) {
            vals[u] = beta[tok];
          } else if (f == sb + 1) {
            vals[u] = gated ? g[tok] : 0.0f;
          } else {
            vals[u] = gk[tok * dk + f - gkb];
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
      float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
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
        p[m & 3] += s[m] * kk[m];
      }
      float pred = (p[0] + p[1]) + (p[2] + p[3]);
      for (int off = 1; off < R; off <<= 1) pred += __shfl_xor_sync(0xffffffffu, pred, off);
      const float u = delta ? beta * (v - pred) : beta * v;
      p[0] = p[1] = p[2] = p[3] = 0.0f;
#pragma unroll
      for (int m = 0; m < MAXR; m++) {
        const int i = m * R + r;
        const bool in = FULL || (m < rows && i < dk);
        s[m] += kk[m] * u;
        p[m & 3] += s[m] * (in ? xs[i] : 0.0f);
      }
      float acc = (p[0] + p[1]) + (p[2] + p[3]);
      for (int off = 1; off < R; off <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (r == 0 && valid) out[(((int64_t)b * T + t0 + st) * H + h) * dv + col] = scale * acc;
    }
  }
  float *state = state_out + (int64_t)bh * dk * dv;
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
      const float *q, const float *k, const float *v, const float *beta, const float *g,          \
      const float *gk, const float *s0, float *out, float *state_out, int B, int T, int H, int dk, \
      int dv, int R, int rows, int gated, int delta, float scale, int tc) {                        \
    recurrence<MAXR, GK, FULL>(q, k, v, beta, g, gk, s0, out, state_out, B, T, H, dk, dv, R, rows, \
                               gated, delta, scale, tc);                                           \
  }
#define REC(MAXR)                  \
  REC1(MAXR, false, false, 00)     \
  REC1(MAXR, false, true, 01)      \
  REC1(MAXR, true, false, 10)      \
  REC1(MAXR, true, true, 11)
REC(8)
REC(16)
REC(32)

// The same recurrence for the shapes models have: dk = R * ROWS exactly (ROWS a multiple of 4)
// and the decay known at compile time (DECAY 0: none, 1: per step, 2: per step and key channel),
// so the step loop is straight-line code. Thread r of a column owns key rows in groups of four,
// (g R + r) 4 + c, which makes its q/k/gk values of a step ROWS/4 aligned float4 loads from
// consecutive addresses across the R threads. Inputs are staged with cp.async into two shared
// buffers: the next chunk of steps is in flight while the current one is computed.
// Inputs as for `recurrence`. Staged step: q[dk] | k[dk] | gk[dk] (DECAY 2) | v[cols] | beta | g,
// padded to 4 floats.
template <int ROWS, int R, int DECAY>
__device__ void recurrence_tiled(const float *__restrict__ q, const float *__restrict__ k,
                                 const float *__restrict__ v, const float *__restrict__ beta,
                                 const float *__restrict__ g, const float *__restrict__ gk,
                                 const float *s0, float *__restrict__ out, float *state_out, int B, int T,
                                 int H, int dv, int delta, float scale, int tc) {
  constexpr int DK = ROWS * R, CPW = 32 / R, G = ROWS / 4;
  constexpr bool GK = DECAY == 2;
  constexpr int GKB = 2 * DK, VB = GK ? 3 * DK : 2 * DK;
  extern __shared__ __align__(16) float stage[];
  const int nw = blockDim.x >> 5, cols = nw * CPW;
  const int SB = VB + cols, W = (SB + 2 + 3) & ~3;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane % R;
  const int lc = warp * CPW + lane / R;
  const int col0 = blockIdx.x * cols, col = col0 + lc;
  const bool valid = col < dv;
  const int bh = blockIdx.y, b = bh / H, h = bh % H;

  float s[ROWS];
  const float *init = s0 + (int64_t)bh * DK * dv;
#pragma unroll
  for (int g = 0; g < G; g++)
#pragma unroll
    for (int c = 0; c < 4; c++)
      s[4 * g + c] = valid ? init[(int64_t)((g * R + r) * 4 + c) * dv + col] : 0.0f;

  // Start copying steps [t0, t0 + n) into buf: one warp per step, consecutive lanes on
  // consecutive floats.
  auto issue = [&](int t0, int n, float *buf) {
    for (int st = warp; st < n; st += nw) {
      const int64_t tok = ((int64_t)b * T + t0 + st) * H + h;
      float *d = buf + st * W;
      for (int f = lane; f < SB + 2; f += 32) {
        const float *src = nullptr;
        if (f < DK) {
          src = q + tok * DK + f;
        } else if (f < 2 * DK) {
          src = k + tok * DK + f - DK;
        } else if (GK && f < VB) {
          src = gk + tok * DK + f - GKB;
        } else if (f < SB) {
          const int j = col0 + f - VB;
          if (j < dv) src = v + tok * dv + j;
        } else if (f == SB) {
          src = beta + tok;
        } else if (DECAY >= 1) {
          src = g + tok;
        }
        if (src) {
          __pipeline_memcpy_async(d + f, src, sizeof(float));
        } else {
          d[f] = 0.0f;
        }
      }
    }
    __pipeline_commit();
  };

  const int chunks = (T + tc - 1) / tc;
  issue(0, min(tc, T), stage);
  for (int c = 0; c < chunks; c++) {
    const int t0 = c * tc, n = min(tc, T - t0);
    if (c + 1 < chunks) {
      issue(t0 + tc, min(tc, T - t0 - tc), stage + ((c + 1) & 1) * tc * W);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();  // chunk c is in shared memory for every thread
    const float *cur = stage + (c & 1) * tc * W;
    for (int st = 0; st < n; st++) {
      const float *xs = cur + st * W;
      const float beta = xs[SB];
      const float v = xs[VB + lc];
      const float a = DECAY >= 1 ? expf(xs[SB + 1]) : 1.0f;
      float kk[ROWS];
      float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four partial sums: chains of G, not ROWS
#pragma unroll
      for (int g = 0; g < G; g++) {
        const int o = (g * R + r) * 4;
        const float4 k4 = *reinterpret_cast<const float4 *>(xs + DK + o);
        kk[4 * g] = k4.x;
        kk[4 * g + 1] = k4.y;
        kk[4 * g + 2] = k4.z;
        kk[4 * g + 3] = k4.w;
        if (GK) {
          const float4 e = *reinterpret_cast<const float4 *>(xs + GKB + o);
          s[4 * g] *= a * expf(e.x);
          s[4 * g + 1] *= a * expf(e.y);
          s[4 * g + 2] *= a * expf(e.z);
          s[4 * g + 3] *= a * expf(e.w);
        } else if (DECAY == 1) {
#pragma unroll
          for (int c4 = 0; c4 < 4; c4++) s[4 * g + c4] *= a;
        }
#pragma unroll
        for (int c4 = 0; c4 < 4; c4++) p[c4] = fmaf(s[4 * g + c4], kk[4 * g + c4], p[c4]);
      }
      float pred = (p[0] + p[1]) + (p[2] + p[3]);
#pragma unroll
      for (int off = 1; off < R; off <<= 1) pred += __shfl_xor_sync(0xffffffffu, pred, off);
      const float u = delta ? beta * (v - pred) : beta * v;
      p[0] = p[1] = p[2] = p[3] = 0.0f;
#pragma unroll
      for (int g = 0; g < G; g++) {
        const float4 q4 = *reinterpret_cast<const float4 *>(xs + (g * R + r) * 4);
        const float qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int c4 = 0; c4 < 4; c4++) {
          s[4 * g + c4] = fmaf(kk[4 * g + c4], u, s[4 * g + c4]);
          p[c4] = fmaf(s[4 * g + c4], qq[c4], p[c4]);
        }
      }
      float acc = (p[0] + p[1]) + (p[2] + p[3]);
#pragma unroll
      for (int off = 1; off < R; off <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (r == 0 && valid) out[(((int64_t)b * T + t0 + st) * H + h) * dv + col] = scale * acc;
    }
    __syncthreads();  // chunk c is consumed before its buffer is refilled
  }
  float *state = state_out + (int64_t)bh * DK * dv;
  if (valid) {
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
      for (int c = 0; c < 4; c++) state[(int64_t)((g * R + r) * 4 + c) * dv + col] = s[4 * g + c];
  }
}

// recurrence_t{ROWS}_{R}_{DECAY}
#define TILED1(ROWS, R, DECAY)                                                                      \
  extern "C" __global__ void __launch_bounds__(256) recurrence_t##ROWS##_##R##_##DECAY(             \
      const float *q, const float *k, const float *v, const float *beta, const float *g,           \
      const float *gk, const float *s0, float *out, float *state_out, int B, int T, int H, int dv,   \
      int delta, float scale, int tc) {                                                             \
    recurrence_tiled<ROWS, R, DECAY>(q, k, v, beta, g, gk, s0, out, state_out, B, T, H, dv, delta,  \
                                     scale, tc);                                                    \
  }
#define TILED_R(ROWS, R) TILED1(ROWS, R, 0) TILED1(ROWS, R, 1) TILED1(ROWS, R, 2)
#define TILED(ROWS) \
  TILED_R(ROWS, 1) TILED_R(ROWS, 2) TILED_R(ROWS, 4) TILED_R(ROWS, 8) TILED_R(ROWS, 16) TILED_R(ROWS, 32)
TILED(16)
TILED(24)
TILED(32)

// ---- One decoding step of a delta-rule layer (src/ops/decode.rs) ----

// Sum of v over the block; every thread gets the total. `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float *red) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < warps; w++) t += red[w];
  return t;
}

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

// SwiGLU on the stacked gate|up projection: y[r, i] = silu(x[r, i]) · x[r, n + i], in float32,
// rounded once to T. x [rows, 2n], y [rows, n]. Columns on x of the grid, rows on y (strided
// past 65535), so no element needs a 64-bit division. With `vec` (n a multiple of 16 bytes of T
// and x 16-byte aligned) a thread takes 16 bytes of columns with one load of each half and one
// store: a memory-bound kernel then moves its bytes in full lines.
template <typename T>
__device__ void swiglu(const T *__restrict__ x, T *__restrict__ y, long long rows, int n, int vec) {
  constexpr int V = 16 / sizeof(T);
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * (vec ? V : 1);
  if (i >= n) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const T *g = x + r * 2 * n + i, *u = g + n;
    T *o = y + r * n + i;
    if (vec) {
      const Pack16<T> gp = *reinterpret_cast<const Pack16<T> *>(g), up = *reinterpret_cast<const Pack16<T> *>(u);
      Pack16<T> op;
#pragma unroll
      for (int e = 0; e < V; e++) {
        const float gv = to_f(gp.v[e]);
        op.v[e] = from_f<T>(gv / (1.0f + expf(-gv)) * to_f(up.v[e]));
      }
      *reinterpret_cast<Pack16<T> *>(o) = op;
    } else {
      const float gv = to_f(*g);
      *o = from_f<T>(gv / (1.0f + expf(-gv)) * to_f(*u));
    }
  }
}

#define SWIGLU(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *x, T *y, long long rows, int n, int vec) {             \
    swiglu<T>(x, y, rows, n, vec);                                                                 \
  }
SWIGLU(swiglu_f32, float)
SWIGLU(swiglu_bf16, __nv_bfloat16)
SWIGLU(swiglu_f16, __half)

// The backward of swiglu: d[gate | up] = [dy · up · silu'(gate) | dy · silu(gate)], float32
// inside, rounded once to T; the grid and `vec` as swiglu's (dy 16-byte aligned too).
template <typename T>
__device__ __forceinline__ void swiglu_grad(float gv, float up, float d, T &dg, T &du) {
  const float sig = 1.0f / (1.0f + expf(-gv));
  dg = from_f<T>(d * up * sig * (1.0f + gv * (1.0f - sig)));
  du = from_f<T>(d * gv * sig);
}

template <typename T>
__device__ void swiglu_bwd(const T *__restrict__ x, const T *__restrict__ dy, T *__restrict__ dx, long long rows,
                           int n, int vec) {
  constexpr int V = 16 / sizeof(T);
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * (vec ? V : 1);
  if (i >= n) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const T *g = x + r * 2 * n + i, *u = g + n, *d = dy + r * n + i;
    T *dg = dx + r * 2 * n + i, *du = dg + n;
    if (vec) {
      const Pack16<T> gp = *reinterpret_cast<const Pack16<T> *>(g), up = *reinterpret_cast<const Pack16<T> *>(u),
                      dp = *reinterpret_cast<const Pack16<T> *>(d);
      Pack16<T> gq, uq;
#pragma unroll
      for (int e = 0; e < V; e++) swiglu_grad<T>(to_f(gp.v[e]), to_f(up.v[e]), to_f(dp.v[e]), gq.v[e], uq.v[e]);
      *reinterpret_cast<Pack16<T> *>(dg) = gq;
      *reinterpret_cast<Pack16<T> *>(du) = uq;
    } else {
      swiglu_grad<T>(to_f(*g), to_f(*u), to_f(*d), *dg, *du);
    }
  }
}

#define SWIGLU_BWD(NAME, T)                                                                        \
  extern "C" __global__ void NAME(const T *x, const T *dy, T *dx, long long rows, int n, int vec) { \
    swiglu_bwd<T>(x, dy, dx, rows, n, vec);                                                        \
  }
SWIGLU_BWD(swiglu_bwd_f32, float)
SWIGLU_BWD(swiglu_bwd_bf16, __nv_bfloat16)
SWIGLU_BWD(swiglu_bwd_f16, __half)

// Per-column sums of squares of x [rows, n] (row r at r · xs), in float32, over chunks of
// `chunk` rows: part [ceil(rows / chunk), n]. The caller adds the chunks up in a fixed order, so
// the result does not depend on scheduling (atomics would make the S-Wanda scores, and with
// them the kept channels, vary between runs).
template <typename T>
__device__ void col_sumsq(const T *__restrict__ x, long long xs, float *__restrict__ part, long long rows, int n,
                          int chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  const long long r0 = (long long)blockIdx.y * chunk, r1 = min(r0 + chunk, rows);
  float s = 0.0f;
  for (long long r = r0; r < r1; r++) {
    const float v = to_f(x[r * xs + c]);
    s += v * v;
  }
  part[(long long)blockIdx.y * n + c] = s;
}

#define COL_SUMSQ(NAME, T)                                                                          \
  extern "C" __global__ void NAME(const T *x, long long xs, float *part, long long rows, int n,      \
                                  int chunk) {                                                     \
    col_sumsq<T>(x, xs, part, rows, n, chunk);                                                      \
  }
COL_SUMSQ(col_sumsq_f32, float)
COL_SUMSQ(col_sumsq_bf16, __nv_bfloat16)
COL_SUMSQ(col_sumsq_f16, __half)

// The recurrence's float32 inputs from the short conv's output x [rows, 2·H·dk + Hv·dv] (row r
// at r · xs): q and k of each key head L2-normed (x / sqrt(Σx² + eps)) and repeated for the
// r = Hv / H value heads that read it, v widened. out: q [rows, Hv, dk] | k [rows, Hv, dk] |
// v [rows, Hv, dv], each contiguous. One warp per (row, key head).
template <typename T>
__device__ void qkv_prep(const T *__restrict__ x, long long xs, float *__restrict__ out, long long rows, int H,
                         int Hv, int dk, int dv, float eps) {
  const int lane = threadIdx.x & 31;
  const long long wid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (wid >= rows * H) return;
  const long long row = wid / H;
  const int kh = wid % H, r = Hv / H, kd = H * dk;
  const T *xq = x + row * xs + kh * dk, *xk = xq + kd;
  const long long qk_n = rows * Hv * dk;
  float *q = out + (row * Hv + (long long)kh * r) * dk, *k = q + qk_n;
  float *v = out + 2 * qk_n + (row * Hv + (long long)kh * r) * dv;
  float sq = 0.0f, sk = 0.0f;
  for (int i = lane; i < dk; i += 32) {
    const float qi = to_f(xq[i]), ki = to_f(xk[i]);
    sq += qi * qi;
    sk += ki * ki;
  }
  sq = warp_sum(sq);
  sk = warp_sum(sk);
  const float nq = sqrtf(sq + eps), nk = sqrtf(sk + eps);
  for (int i = lane; i < dk; i += 32) {
    const float qi = to_f(xq[i]) / nq, ki = to_f(xk[i]) / nk;
    for (int j = 0; j < r; j++) {
      q[j * dk + i] = qi;
      k[j * dk + i] = ki;
    }
  }
  const T *xv = x + row * xs + 2 * kd + (long long)kh * r * dv;
  for (int j = lane; j < r * dv; j += 32) v[j] = to_f(xv[j]);
}

#define QKV_PREP(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *x, long long xs, float *out, long long rows, int H, int Hv, \
                                  int dk, int dv, float eps) {                                     \
    qkv_prep<T>(x, xs, out, rows, H, Hv, dk, dv, eps);                                              \
  }
QKV_PREP(qkv_prep_f32, float)
QKV_PREP(qkv_prep_bf16, __nv_bfloat16)
QKV_PREP(qkv_prep_f16, __half)

// Heads from columns of a layer's stacked rows, and their backward (src/ops/prep.rs `Heads`): x
// rows at r·xs, head h at columns off + h·d. Forward: out [rows, H·rep, d], each head written
// rep times, L2-normed (x / sqrt(Σx² + eps)) into float32 when `norm`, else copied as T. Backward:
// dx [rows, C] as T (allocated zero: only the heads' columns are written) from dy [rows, H·rep,
// d] (float32 when `norm`, else T): g = Σ over the copies, and with the norm
// dx = (g − y (y·g)) / n for y = x / n, n = sqrt(Σx² + eps). One warp per (row, head).
// P elements of T at once (P·sizeof(T)-byte aligned, which the caller checks).
template <typename T, int P> struct __align__(P * sizeof(T)) PackN {
  T v[P];
};
template <typename T, int P> __device__ __forceinline__ PackN<T, P> load_n(const T *p) {
  return *reinterpret_cast<const PackN<T, P> *>(p);
}

// Where output row `row`'s head `hr` (of HR) starts: [rows, HR, d] when C == 0, else the chunked
// recurrence's layout [N, B·HR, C, W] at column `col`, row b·T + t being position t % C of
// chunk t / C (rows past T in the last chunk are the caller's zeros).
struct HeadsDst {
  int C;
  long long T;
  int W, col;
};
__device__ __forceinline__ long long heads_at(const HeadsDst &o, long long row, int hr, int HR, int d,
                                              long long rows) {
  if (o.C == 0) return (row * HR + hr) * (long long)d;
  const long long b = row / o.T, t = row % o.T, B = rows / o.T;
  return (((t / o.C) * B + b) * HR + hr) * (long long)o.C * o.W + (t % o.C) * (long long)o.W + o.col;
}

// P = 2: every lane moves pairs of columns (d, the row stride, W, col and every offset even), a
// warp twice the bytes an access of P = 1's single columns. With `out2` (normed heads in chunks)
// the output goes there too, in chunks of width d at column 0: the keys alone, which the chunked
// recurrence reads besides the [q | k] pairs.
template <typename T, int P>
__device__ void heads_fwd(const T *__restrict__ x, long long xs, int off, void *__restrict__ out, long long rows,
                          int H, int d, int rep, int norm, float eps, HeadsDst dst, float *__restrict__ out2) {
  const int lane = threadIdx.x & 31;
  const long long wid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (wid >= rows * H) return;
  const long long row = wid / H;
  const int h = wid % H;
  const T *xr = x + row * xs + off + (long long)h * d;
  const HeadsDst dst2 = {dst.C, dst.T, d, 0};
  float n = 1.0f;
  if (norm) {
    float ss = 0.0f;
    for (int i = P * lane; i < d; i += 32 * P) {
      const PackN<T, P> p = load_n<T, P>(xr + i);
#pragma unroll
      for (int e = 0; e < P; e++) ss += to_f(p.v[e]) * to_f(p.v[e]);
    }
    ss = warp_sum(ss);
    n = sqrtf(ss + eps);
  }
  for (int i = P * lane; i < d; i += 32 * P) {
    const PackN<T, P> p = load_n<T, P>(xr + i);
    for (int j = 0; j < rep; j++) {
      const long long o = heads_at(dst, row, h * rep + j, H * rep, d, rows) + i;
      if (norm) {
        PackN<float, P> y;
#pragma unroll
        for (int e = 0; e < P; e++) y.v[e] = to_f(p.v[e]) / n;
        *reinterpret_cast<PackN<float, P> *>(static_cast<float *>(out) + o) = y;
        if (out2) *reinterpret_cast<PackN<float, P> *>(out2 + heads_at(dst2, row, h * rep + j, H * rep, d, rows) + i) = y;
      } else {
        *reinterpret_cast<PackN<T, P> *>(static_cast<T *>(out) + o) = p;
      }
    }
  }
}

// dy laid out as heads_fwd's output `src`.
template <typename T, int P>
__device__ void heads_bwd(const T *__restrict__ x, long long xs, int off, const void *__restrict__ dy,
                          T *__restrict__ dx, long long rows, int C, int H, int d, int rep, int norm, float eps,
                          HeadsDst src) {
  const int lane = threadIdx.x & 31;
  const long long wid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (wid >= rows * H) return;
  const long long row = wid / H;
  const int h = wid % H;
  const T *xr = x + row * xs + off + (long long)h * d;
  T *out = dx + row * C + off + (long long)h * d;
  // g = the output gradient at columns i..i+P, summed over the copies.
  auto grad = [&](int i, float g[P]) {
#pragma unroll
    for (int e = 0; e < P; e++) g[e] = 0.0f;
    for (int j = 0; j < rep; j++) {
      const long long o = heads_at(src, row, h * rep + j, H * rep, d, rows) + i;
      if (norm) {
        const PackN<float, P> q = load_n<float, P>(static_cast<const float *>(dy) + o);
#pragma unroll
        for (int e = 0; e < P; e++) g[e] += q.v[e];
      } else {
        const PackN<T, P> q = load_n<T, P>(static_cast<const T *>(dy) + o);
#pragma unroll
        for (int e = 0; e < P; e++) g[e] += to_f(q.v[e]);
      }
    }
  };
  float g[P];
  PackN<T, P> r;
  if (!norm) {
    for (int i = P * lane; i < d; i += 32 * P) {
      grad(i, g);
#pragma unroll
      for (int e = 0; e < P; e++) r.v[e] = from_f<T>(g[e]);
      *reinterpret_cast<PackN<T, P> *>(out + i) = r;
    }
    return;
  }
  float ss = 0.0f, dot = 0.0f;
  for (int i = P * lane; i < d; i += 32 * P) {
    const PackN<T, P> p = load_n<T, P>(xr + i);
    grad(i, g);
#pragma unroll
    for (int e = 0; e < P; e++) {
      const float v = to_f(p.v[e]);
      ss += v * v;
      dot += v * g[e];
    }
  }
  ss = warp_sum(ss);
  dot = warp_sum(dot);
  const float n = sqrtf(ss + eps), yg = dot / n;
  for (int i = P * lane; i < d; i += 32 * P) {
    const PackN<T, P> p = load_n<T, P>(xr + i);
    grad(i, g);
#pragma unroll
    for (int e = 0; e < P; e++) r.v[e] = from_f<T>((g[e] - to_f(p.v[e]) / n * yg) / n);
    *reinterpret_cast<PackN<T, P> *>(out + i) = r;
  }
}

#define HEADS_P(SUFFIX, T, P, FWD, BWD)                                                             \
  extern "C" __global__ void FWD##_##SUFFIX(const T *x, long long xs, int off, void *out, long long rows, \
                                            int H, int d, int rep, int norm, float eps, int cc,      \
                                            long long ct, int cw, int ccol, float *out2) {          \
    heads_fwd<T, P>(x, xs, off, out, rows, H, d, rep, norm, eps, HeadsDst{cc, ct, cw, ccol}, out2);  \
  }                                                                                                 \
  extern "C" __global__ void BWD##_##SUFFIX(const T *x, long long xs, int off, const void *dy, T *dx,  \
                                            long long rows, int C, int H, int d, int rep, int norm, \
                                            float eps, int cc, long long ct, int cw, int ccol) {    \
    heads_bwd<T, P>(x, xs, off, dy, dx, rows, C, H, d, rep, norm, eps, HeadsDst{cc, ct, cw, ccol});  \
  }
#define HEADS(SUFFIX, T)                      \
  HEADS_P(SUFFIX, T, 1, heads_fwd, heads_bwd) \
  HEADS_P(SUFFIX, T, 2, heads_fwd2, heads_bwd2)
HEADS(f32, float)
HEADS(bf16, __nv_bfloat16)
HEADS(f16, __half)

// Residual add and RMSNorm in one pass: h = a + b rounded to T (as a separate add rounds), then
// y = h / sqrt(mean(h²) + eps) · w in float32, rounded once. One block per row of width n (a
// decoding step has as few rows as sequences, so a row is spread over the whole block);
// out [2, rows, n] = h | y.
template <typename T>
__device__ void add_rms(const T *__restrict__ a, const T *__restrict__ b, const float *__restrict__ w,
                        T *__restrict__ out, int rows, int n, float eps) {
  __shared__ float red[32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const long long o = (long long)row * n;
  T *hr = out + o, *yr = out + (long long)rows * n + o;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const T h = from_f<T>(to_f(a[o + i]) + to_f(b[o + i]));
    hr[i] = h;
    ss += to_f(h) * to_f(h);
  }
  ss = block_sum(ss, red);
  const float inv = rsqrtf(ss / n + eps);
  // each thread reads back only the elements it wrote
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = from_f<T>(to_f(hr[i]) * inv * w[i]);
}

#define ADD_RMS(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *a, const T *b, const float *w, T *out, int rows, int n, \
                                  float eps) {                                                    \
    add_rms<T>(a, b, w, out, rows, n, eps);                                                        \
  }
ADD_RMS(add_rms_f32, float)
ADD_RMS(add_rms_bf16, __nv_bfloat16)
ADD_RMS(add_rms_f16, __half)

// The chunked form's layout (src/ops/chunk_layout.rs): x [B, T, H, d] in T against y [N, B·H, c,
// width] float32 at columns off..off+d, N = ⌈T / c⌉, zero past T. Blocks of 32 x 8 threads: each
// threadIdx.y takes one row of the side being written (its indices found once, in 32-bit
// arithmetic: row counts stay below 2^31), and its 32 threads step along d, so both sides are
// read and written in runs.
#define LAYOUT_ROWS 8
template <typename T>
__device__ void to_chunks(const T *x, float *y, int B, int Tn, int H, int d, int c, int width, int off, int rows) {
  const int row = blockIdx.x * LAYOUT_ROWS + threadIdx.y;
  if (row >= rows) return;
  const int tt = row % c, q = row / c, bh = q % (B * H), n = q / (B * H);
  const int time = n * c + tt, b = bh / H, h = bh % H;
  float *yr = y + (long long)row * width + off;
  const T *xr = x + (((long long)b * Tn + time) * H + h) * d;
  for (int r = threadIdx.x; r < d; r += 32) yr[r] = time < Tn ? to_f(xr[r]) : 0.0f;
}

template <typename T>
__device__ void from_chunks(const float *y, T *x, int B, int Tn, int H, int d, int c, int width, int off, int rows) {
  const int row = blockIdx.x * LAYOUT_ROWS + threadIdx.y;
  if (row >= rows) return;
  const int h = row % H, q = row / H, time = q % Tn, b = q / Tn;
  const int n = time / c, tt = time % c;
  const float *yr = y + (((long long)n * B * H + b * H + h) * c + tt) * width + off;
  T *xr = x + (long long)row * d;
  for (int r = threadIdx.x; r < d; r += 32) xr[r] = from_f<T>(yr[r]);
}

// The layout kernels with 16-byte float32 accesses, four columns a thread, where the scalar
// kernels' warps moved 64-128 bytes an access (bf16 in) and ran at a third of the H200's DRAM
// bandwidth. Rows of g = d / 4 < 32 column groups share a warp (32 / g rows of it), wider rows
// loop over theirs. The caller checks that d, width, off and both sides' offsets are multiples
// of 4, so that every access is aligned.
template <typename T> struct __align__(4 * sizeof(T)) Pack4 {
  T v[4];
};

// This lane's row and first column group (layout_vec_config in cuda.rs sizes the grid to match);
// false for the lanes left over where g does not divide 32.
__device__ __forceinline__ bool layout_vec_lane(int d, int rows, int &row, int &g0) {
  const int g = d / 4, rpw = g < 32 ? 32 / g : 1, lane = threadIdx.x;
  const int sub = g < 32 ? lane / g : 0;
  row = (blockIdx.x * LAYOUT_ROWS + threadIdx.y) * rpw + sub;
  g0 = g < 32 ? lane % g : lane;
  return sub < rpw && row < rows;
}

template <typename T>
__device__ void to_chunks_vec(const T *x, float *y, int B, int Tn, int H, int d, int c, int width, int off,
                              int rows) {
  int row, g0;
  if (!layout_vec_lane(d, rows, row, g0)) return;
  const int tt = row % c, q = row / c, bh = q % (B * H), n = q / (B * H);
  const int time = n * c + tt, b = bh / H, h = bh % H;
  float *yr = y + (long long)row * width + off;
  const T *xr = x + (((long long)b * Tn + time) * H + h) * d;
  for (int gi = g0; gi < d / 4; gi += 32) {
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (time < Tn) {
      const Pack4<T> p = *reinterpret_cast<const Pack4<T> *>(xr + 4 * gi);
      o = make_float4(to_f(p.v[0]), to_f(p.v[1]), to_f(p.v[2]), to_f(p.v[3]));
    }
    *reinterpret_cast<float4 *>(yr + 4 * gi) = o;
  }
}

template <typename T>
__device__ void from_chunks_vec(const float *y, T *x, int B, int Tn, int H, int d, int c, int width, int off,
                                int rows) {
  int row, g0;
  if (!layout_vec_lane(d, rows, row, g0)) return;
  const int h = row % H, q = row / H, time = q % Tn, b = q / Tn;
  const int n = time / c, tt = time % c;
  const float *yr = y + (((long long)n * B * H + b * H + h) * c + tt) * width + off;
  T *xr = x + (long long)row * d;
  for (int gi = g0; gi < d / 4; gi += 32) {
    const float4 f = *reinterpret_cast<const float4 *>(yr + 4 * gi);
    Pack4<T> p;
    p.v[0] = from_f<T>(f.x);
    p.v[1] = from_f<T>(f.y);
    p.v[2] = from_f<T>(f.z);
    p.v[3] = from_f<T>(f.w);
    *reinterpret_cast<Pack4<T> *>(xr + 4 * gi) = p;
  }
}

#define CHUNK_LAYOUT(SUFFIX, T)                                                                          \
  extern "C" __global__ void to_chunks_##SUFFIX(const T *x, float *y, int B, int Tn, int H, int d, int c,  \
                                                int width, int off, int rows) {                            \
    to_chunks<T>(x, y, B, Tn, H, d, c, width, off, rows);                                                  \
  }                                                                                                        \
  extern "C" __global__ void from_chunks_##SUFFIX(const float *y, T *x, int B, int Tn, int H, int d, int c, \
                                                  int width, int off, int rows) {                          \
    from_chunks<T>(y, x, B, Tn, H, d, c, width, off, rows);                                                \
  }                                                                                                        \
  extern "C" __global__ void to_chunks_vec_##SUFFIX(const T *x, float *y, int B, int Tn, int H, int d, int c, \
                                                    int width, int off, int rows) {                        \
    to_chunks_vec<T>(x, y, B, Tn, H, d, c, width, off, rows);                                              \
  }                                                                                                        \
  extern "C" __global__ void from_chunks_vec_##SUFFIX(const float *y, T *x, int B, int Tn, int H, int d,     \
                                                      int c, int width, int off, int rows) {               \
    from_chunks_vec<T>(y, x, B, Tn, H, d, c, width, off, rows);                                            \
  }
CHUNK_LAYOUT(f32, float)
CHUNK_LAYOUT(bf16, __nv_bfloat16)
CHUNK_LAYOUT(f16, __half)

// The keys' gradient of the chunked recurrence joined in place (src/ops/chunk_recurrence.rs):
// dqk [rows, 2 dk] holds the outputs' gradients of the queries then the keys; the keys' columns
// gain the solve's dki [rows, dk] (when has_intra) and the walk's diag(e) dkend. Blocks and
// rows as the layout kernels'.
extern "C" __global__ void chunk_join_keys(float *dqk, const float *dki, const float *dkend, const float *e, int rows,
                                           int dk, int has_intra) {
  const int row = blockIdx.x * LAYOUT_ROWS + threadIdx.y;
  if (row >= rows) return;
  const long long base = (long long)row * dk;
  const float s = e[row];
  float *out = dqk + 2 * base + dk;
  for (int r = threadIdx.x; r < dk; r += 32) out[r] += s * dkend[base + r] + (has_intra ? dki[base + r] : 0.0f);
}

// The walk over chunks of the chunked delta rule (src/ops/chunk_walk.rs has the math and the CPU
// half). Grid (column tiles of WALK_TV state columns, B·H); 256 threads = WALK_TV columns x
// WALK_RG row groups. A block keeps its columns of the state S [dk, WALK_TV] (the backward: of
// G) and of the chunk's U [c, WALK_TV] (dU) in shared memory (row stride WALK_TV + 1), and stages
// each chunk's keys KK [c, kkw] there with coalesced loads (Kc at column 0 under the delta rule,
// Kend = diag(e) K at `koff`): in the products every thread of a warp then reads the same key
// element (a broadcast), and each thread carries WALK_ACC independent sums so that the loads
// overlap.
#define WALK_TV 32
#define WALK_RG 8
#define WALK_ACC 8

// Chunk `blk`'s keys into shared memory KK [c, kkw]: Kc (delta rule) and Kend = e_t k_t.
__device__ __forceinline__ void walk_stage(const float *kc, const float *k, const float *e, float *KK, long long blk,
                                           int c, int dk, int delta) {
  const int kkw = delta ? 2 * dk : dk, koff = delta ? dk : 0;
  const float *kcs = kc + blk * c * dk, *ks = k + blk * c * dk, *es = e + blk * c;
  for (int i = threadIdx.x; i < c * dk; i += blockDim.x) {
    const int t = i / dk, r = i % dk;
    if (delta) KK[t * kkw + r] = kcs[i];
    KK[t * kkw + koff + r] = es[t] * ks[i];
  }
}

// out[x] (x = row0 + WALK_RG i for i < WALK_ACC and x < rows) = init(x) + sign Σ_y A[x, y] B[y]
// for one column: A read from shared memory with row stride `as` along x and `ys` along y,
// B[y] = Bm[y * WALK_TV+1 + tx]. Rows spaced WALK_RG apart belong to this thread.
template <typename Init>
__device__ __forceinline__ void walk_rows(float *out, int ostride, int rows, int row0, const float *A, int xs,
                                          int ys, int ny, const float *Bm, int tx, float sign, Init init) {
  const int P = WALK_TV + 1;
  for (int base = row0; base < rows; base += WALK_RG * WALK_ACC) {
    float acc[WALK_ACC];
#pragma unroll
    for (int i = 0; i < WALK_ACC; ++i) acc[i] = 0.0f;
    for (int y = 0; y < ny; ++y) {
      const float b = Bm[y * P + tx];
#pragma unroll
      for (int i = 0; i < WALK_ACC; ++i) {
        const int x = base + WALK_RG * i;
        if (x < rows) acc[i] += A[x * xs + y * ys] * b;
      }
    }
#pragma unroll
    for (int i = 0; i < WALK_ACC; ++i) {
      const int x = base + WALK_RG * i;
      if (x < rows) out[x * ostride + tx] = init(x) + sign * acc[i];
    }
  }
}

// walk_rows with A read along y in rows of stride xs (A[x xs + y]), four y at a time as one float4
// per row: a quarter of the shared-memory reads of A. Needs ny % 4 == 0, xs % 4 == 0 and A
// 16-byte aligned. The sums run in the same order as walk_rows'.
template <typename Init>
__device__ __forceinline__ void walk_rows_y4(float *out, int ostride, int rows, int row0, const float *A, int xs,
                                             int ny, const float *Bm, int tx, float sign, Init init) {
  const int P = WALK_TV + 1;
  for (int base = row0; base < rows; base += WALK_RG * WALK_ACC) {
    float acc[WALK_ACC];
#pragma unroll
    for (int i = 0; i < WALK_ACC; ++i) acc[i] = 0.0f;
    for (int y = 0; y < ny; y += 4) {
      const float b0 = Bm[y * P + tx], b1 = Bm[(y + 1) * P + tx], b2 = Bm[(y + 2) * P + tx],
                  b3 = Bm[(y + 3) * P + tx];
#pragma unroll
      for (int i = 0; i < WALK_ACC; ++i) {
        const int x = base + WALK_RG * i;
        if (x < rows) {
          const float4 a = *reinterpret_cast<const float4 *>(A + x * xs + y);
          acc[i] = fmaf(a.w, b3, fmaf(a.z, b2, fmaf(a.y, b1, fmaf(a.x, b0, acc[i]))));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < WALK_ACC; ++i) {
      const int x = base + WALK_RG * i;
      if (x < rows) out[x * ostride + tx] = init(x) + sign * acc[i];
    }
  }
}

// walk_rows with A read along x (A[x + y ys]) and the thread owning WALK_ACC consecutive rows
// (WALK_ACC row0 + WALK_RG WALK_ACC j + i) instead of rows WALK_RG apart: its rows of A are two
// float4 per y. Needs rows % WALK_ACC == 0, ys % 4 == 0 and A 16-byte aligned.
template <typename Init>
__device__ __forceinline__ void walk_rows_x8(float *out, int ostride, int rows, int row0, const float *A, int ys,
                                             int ny, const float *Bm, int tx, float sign, Init init) {
  const int P = WALK_TV + 1;
  for (int base = WALK_ACC * row0; base < rows; base += WALK_RG * WALK_ACC) {
    float acc[WALK_ACC];
#pragma unroll
    for (int i = 0; i < WALK_ACC; ++i) acc[i] = 0.0f;
    for (int y = 0; y < ny; ++y) {
      const float b = Bm[y * P + tx];
      const float4 a0 = *reinterpret_cast<const float4 *>(A + base + y * ys);
      const float4 a1 = *reinterpret_cast<const float4 *>(A + base + 4 + y * ys);
      acc[0] = fmaf(a0.x, b, acc[0]);
      acc[1] = fmaf(a0.y, b, acc[1]);
      acc[2] = fmaf(a0.z, b, acc[2]);
      acc[3] = fmaf(a0.w, b, acc[3]);
      acc[4] = fmaf(a1.x, b, acc[4]);
      acc[5] = fmaf(a1.y, b, acc[5]);
      acc[6] = fmaf(a1.z, b, acc[6]);
      acc[7] = fmaf(a1.w, b, acc[7]);
    }
#pragma unroll
    for (int i = 0; i < WALK_ACC; ++i) out[(base + i) * ostride + tx] = init(base + i) + sign * acc[i];
  }
}

// The walk's two kinds of product over a chunk's staged keys KK [c, kkw]: by rows of the keys
// (A[x kkw + y], x a token) and by their columns (A[x + y kkw], x a key channel). Vectorised
// when the key width is a multiple of 8 (every model's), which also makes KK's rows and column
// offsets 16-byte aligned; the scalar form otherwise.
template <typename Init>
__device__ __forceinline__ void walk_by_rows(bool vec, float *out, int rows, int row0, const float *A, int kkw,
                                             int ny, const float *Bm, int tx, float sign, Init init) {
  if (vec)
    walk_rows_y4(out, WALK_TV + 1, rows, row0, A, kkw, ny, Bm, tx, sign, init);
  else
    walk_rows(out, WALK_TV + 1, rows, row0, A, kkw, 1, ny, Bm, tx, sign, init);
}

template <typename Init>
__device__ __forceinline__ void walk_by_cols(bool vec, float *out, int rows, int row0, const float *A, int kkw,
                                             int ny, const float *Bm, int tx, float sign, Init init) {
  if (vec)
    walk_rows_x8(out, WALK_TV + 1, rows, row0, A, kkw, ny, Bm, tx, sign, init);
  else
    walk_rows(out, WALK_TV + 1, rows, row0, A, 1, kkw, ny, Bm, tx, sign, init);
}

// Where the staged keys start in a walk kernel's shared memory: after `floats` floats, rounded
// up to a 16-byte boundary (src/ops/cuda.rs sizes the shared memory the same way).
__device__ __forceinline__ float *walk_keys(float *smem, int floats) { return smem + (floats + 3) / 4 * 4; }

// w [N,BH,c,dv], kc and k [N,BH,c,dk] (kc read only under the delta rule), e [N,BH,c], s0
// [BH,dk,dv], a [N,BH,dk]; U [N,BH,c,dv] and the states [N+1,BH,dk,dv] out.
extern "C" __global__ void __launch_bounds__(256)
    chunk_walk_fwd_f32(const float *w, const float *kc, const float *k, const float *e, const float *s0,
                       const float *a, float *u_out, float *states, int n, int bh, int c, int dk, int dv, int delta) {
  extern __shared__ float wsm[];
  const int P = WALK_TV + 1;
  const int kkw = delta ? 2 * dk : dk, koff = delta ? dk : 0;
  float *S = wsm, *U = S + dk * P, *KK = walk_keys(wsm, (dk + c) * P);
  const bool vec = dk % 8 == 0;
  const int tx = threadIdx.x % WALK_TV, ty = threadIdx.x / WALK_TV;
  const int h = blockIdx.y, col = blockIdx.x * WALK_TV + tx;
  const bool ok = col < dv;
  for (int r = ty; r < dk; r += WALK_RG) S[r * P + tx] = ok ? s0[((long long)h * dk + r) * dv + col] : 0.0f;
  for (int i = 0; i < n; ++i) {
    const long long blk = (long long)i * bh + h;
    walk_stage(kc, k, e, KK, blk, c, dk, delta);
    __syncthreads();
    if (ok)
      for (int r = ty; r < dk; r += WALK_RG) states[(blk * dk + r) * dv + col] = S[r * P + tx];
    // U = W − Kc S
    const float *wi = w + blk * c * dv;
    if (delta)
      walk_by_rows(vec, U, c, ty, KK, kkw, dk, S, tx, -1.0f, [&](int t) { return ok ? wi[t * dv + col] : 0.0f; });
    else
      for (int t = ty; t < c; t += WALK_RG) U[t * P + tx] = ok ? wi[t * dv + col] : 0.0f;
    __syncthreads();
    if (ok)
      for (int t = ty; t < c; t += WALK_RG) u_out[(blk * c + t) * dv + col] = U[t * P + tx];
    // S ← diag(a) S + Kendᵀ U (each thread reads and writes only its own rows of S)
    const float *ai = a + blk * dk;
    walk_by_cols(vec, S, dk, ty, KK + koff, kkw, c, U, tx, 1.0f, [&](int r) { return ai[r] * S[r * P + tx]; });
    __syncthreads();
  }
  if (ok)
    for (int r = ty; r < dk; r += WALK_RG) states[(((long long)n * bh + h) * dk + r) * dv + col] = S[r * P + tx];
}

// Its backward's sequential part: the chunks in reverse with G (the gradient reaching S_{i+1})
// in shared memory beside dU_i and the chunk's keys. Writes dW = dU, every chunk's G_{i+1}
// (gend [N,BH,dk,dv]: the caller forms the terms that sum over columns from it in batched
// products) and ds0. Columns past dv hold zeros throughout.
extern "C" __global__ void __launch_bounds__(256)
    chunk_walk_bwd_f32(const float *kc, const float *k, const float *e, const float *a, const float *gu,
                       const float *gs, float *dw, float *gend, float *ds0, int n, int bh, int c, int dk, int dv,
                       int delta) {
  extern __shared__ float wsm[];
  const int P = WALK_TV + 1;
  const int kkw = delta ? 2 * dk : dk, koff = delta ? dk : 0;
  float *G = wsm, *dU = G + dk * P, *KK = walk_keys(wsm, (dk + c) * P);
  const bool vec = dk % 8 == 0;
  const int tx = threadIdx.x % WALK_TV, ty = threadIdx.x / WALK_TV;
  const int h = blockIdx.y, col = blockIdx.x * WALK_TV + tx;
  const bool ok = col < dv;
  for (int r = ty; r < dk; r += WALK_RG)
    G[r * P + tx] = ok ? gs[(((long long)n * bh + h) * dk + r) * dv + col] : 0.0f;
  for (int i = n - 1; i >= 0; --i) {
    const long long blk = (long long)i * bh + h;
    walk_stage(kc, k, e, KK, blk, c, dk, delta);
    __syncthreads();
    // dU = gU + Kend G
    const float *gui = gu + blk * c * dv;
    walk_by_rows(vec, dU, c, ty, KK + koff, kkw, dk, G, tx, 1.0f,
                 [&](int t) { return ok ? gui[t * dv + col] : 0.0f; });
    if (ok)
      for (int r = ty; r < dk; r += WALK_RG) gend[(blk * dk + r) * dv + col] = G[r * P + tx];
    __syncthreads();
    if (ok)
      for (int t = ty; t < c; t += WALK_RG) dw[(blk * c + t) * dv + col] = dU[t * P + tx];
    // G ← diag(a) G − Kcᵀ dU + gS_i (each thread reads and writes only its own rows of G)
    const float *ai = a + blk * dk;
    const float *gsi = gs + blk * dk * dv;
    auto keep = [&](int r) { return ai[r] * G[r * P + tx] + (ok ? gsi[r * dv + col] : 0.0f); };
    if (delta)
      walk_by_cols(vec, G, dk, ty, KK, kkw, c, dU, tx, -1.0f, keep);
    else
      for (int r = ty; r < dk; r += WALK_RG) G[r * P + tx] = keep(r);
    __syncthreads();
  }
  if (ok)
    for (int r = ty; r < dk; r += WALK_RG) ds0[((long long)h * dk + r) * dv + col] = G[r * P + tx];
}

// The intra-chunk solve of the chunked delta rule (src/ops/chunk_intra.rs has the math and the
// CPU half). One block of 256 threads per chunk and head, chunks of c ≤ 64 tokens. The [c, c]
// matrices (G = K Kᵀ, T = (I − A)⁻¹ and the backward's) live in shared memory with row stride
// 65; the key and value columns pass through in tiles of INTRA_TW. For the [c, c] products a
// thread owns a 4 x 4 block (16 x 16 blocks cover 64 x 64); for the [c, width] ones it owns a
// column of the tile in every eighth row, so a warp shares one row (a broadcast read of T).
#define INTRA_C 64
#define INTRA_P (INTRA_C + 1)
#define INTRA_TW 32
#define INTRA_TP (INTRA_TW + 1)

// tile[t][r] = src[t·ld + col0 + r] · scale[t] (scale absent: 1) for t < rows, zero from `valid`
// rows and from `width` columns on; the tile's rows `tp` apart.
__device__ __forceinline__ void chunk_stage(const float *src, int ld, int width, int col0, int valid, int rows,
                                            const float *scale, float *tile, int tp = INTRA_TP) {
  for (int e = threadIdx.x; e < rows * INTRA_TW; e += blockDim.x) {
    const int t = e / INTRA_TW, r = e % INTRA_TW;
    float x = 0.0f;
    if (t < valid && col0 + r < width) x = src[(long long)t * ld + col0 + r] * (scale ? scale[t] : 1.0f);
    tile[t * tp + r] = x;
  }
}

// A chunk's c rows of a [c, width] matrix (INTRA_C tile rows, zero past c).
__device__ __forceinline__ void intra_stage(const float *src, int width, int col0, int c, const float *scale,
                                            float *tile) {
  chunk_stage(src, width, width, col0, c, INTRA_C, scale, tile);
}

// acc[q][s] += Σ_{r<n} a[(4 bi + q) ra + r ca] b[(4 bj + s) rb + r cb]: a thread's 4 x 4 block of
// a product of two shared-memory matrices, either read by rows or by columns.
__device__ __forceinline__ void block_product(const float *a, int ra, int ca, const float *b, int rb, int cb, int n,
                                              int bi, int bj, float acc[4][4]) {
#pragma unroll 4
  for (int r = 0; r < n; ++r) {
    float x[4], y[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      x[q] = a[(4 * bi + q) * ra + r * ca];
      y[q] = b[(4 * bj + q) * rb + r * cb];
    }
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int s = 0; s < 4; ++s) acc[q][s] += x[q] * y[s];
  }
}

// acc[q][s] += Σ_r a[4 bi + q][r] b[4 bj + s][r] over one staged tile pair.
__device__ __forceinline__ void intra_pairs(const float *a, const float *b, int bi, int bj, float acc[4][4]) {
  block_product(a, INTRA_TP, 1, b, INTRA_TP, 1, INTRA_TW, bi, bj, acc);
}

// acc += A Bᵀ on the thread's 4 x 4 block where it is on or below the diagonal, for A and B
// [c, width] with row strides lda and ldb, staged a column tile at a time through ta and tb.
__device__ void lower_products(const float *a, int lda, const float *b, int ldb, int width, int c, float *ta,
                               float *tb, float acc[4][4]) {
  const int bi = threadIdx.x / 16, bj = threadIdx.x % 16;
  for (int col0 = 0; col0 < width; col0 += INTRA_TW) {
    chunk_stage(a, lda, width, col0, c, INTRA_C, nullptr, ta);
    chunk_stage(b, ldb, width, col0, c, INTRA_C, nullptr, tb);
    __syncthreads();
    if (bj <= bi) intra_pairs(ta, tb, bi, bj, acc);
    __syncthreads();
  }
}

// G = K Kᵀ (every entry of the thread's 4 x 4 block; only j < t is read), staging K in `tile`.
__device__ void intra_gram(const float *k, int c, int dk, float *tile, float *G) {
  const int bi = threadIdx.x / 16, bj = threadIdx.x % 16;
  float acc[4][4] = {};
  for (int col0 = 0; col0 < dk; col0 += INTRA_TW) {
    intra_stage(k, dk, col0, c, nullptr, tile);
    __syncthreads();
    if (bj <= bi) intra_pairs(tile, tile, bi, bj, acc);
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int s = 0; s < 4; ++s) G[(4 * bi + q) * INTRA_P + 4 * bj + s] = acc[q][s];
}

// T = (I − A)⁻¹ for A strictly lower triangular with rows c.. zero, by 16 x 16 blocks (as fla's
// `solve_tril` merges its blocks): forward substitution inside the four diagonal blocks (one
// thread per block column: chains of at most 15 terms, where one thread per column of the
// whole 64 x 64 ran chains of up to 2016 while the other warps of the block waited), then
// block row by block row T_ij = T_ii Σ_{j≤k<i} A_ik T_kj, each element by one thread. R_ij is
// held in T's block (j, i), above the diagonal, until T_ii multiplies it; those blocks are
// zeroed last. Every thread of the block must call it.
#define INV_B 16
__device__ void intra_invert(const float *A, int c, float *T, int ld = INTRA_P) {
  (void)c;  // rows c.. of A are zero, so those of T are the identity's
  const int tid = threadIdx.x;
  if (tid < INTRA_C) {
    const int o = (tid / INV_B) * INV_B, col = tid % INV_B;
    for (int i = 0; i < INV_B; ++i) {
      float x = i == col ? 1.0f : 0.0f;
      for (int j = col; j < i; ++j) x += A[(o + i) * ld + o + j] * T[(o + j) * ld + o + col];
      T[(o + i) * ld + o + col] = x;
    }
  }
  __syncthreads();
  for (int bi = 1; bi < INTRA_C / INV_B; ++bi) {
    const int n = bi * INV_B * INV_B;
    for (int e = tid; e < n; e += blockDim.x) {
      const int bj = e / (INV_B * INV_B), r = e / INV_B % INV_B, s = e % INV_B;
      const float *a = A + (bi * INV_B + r) * ld;
      float x = 0.0f;
      for (int m = bj * INV_B; m < bi * INV_B; ++m) x += a[m] * T[m * ld + bj * INV_B + s];
      T[(bj * INV_B + r) * ld + bi * INV_B + s] = x;
    }
    __syncthreads();
    for (int e = tid; e < n; e += blockDim.x) {
      const int bj = e / (INV_B * INV_B), r = e / INV_B % INV_B, s = e % INV_B;
      const float *t = T + (bi * INV_B + r) * ld + bi * INV_B;
      float x = 0.0f;
      for (int m = 0; m <= r; ++m) x += t[m] * T[(bj * INV_B + m) * ld + bi * INV_B + s];
      T[(bi * INV_B + r) * ld + bj * INV_B + s] = x;
    }
    __syncthreads();
  }
  for (int e = tid; e < INTRA_C * INTRA_C; e += blockDim.x) {
    const int i = e / INTRA_C, j = e % INTRA_C;
    if (j / INV_B > i / INV_B) T[i * ld + j] = 0.0f;
  }
}

// A_tj = −β_t e^{γ_t − γ_j} G_tj below the diagonal, 0 elsewhere.
__device__ __forceinline__ float intra_a(const float *G, const float *bet, const float *gam, int t, int j) {
  return j < t ? -bet[t] * __expf(gam[t] - gam[j]) * G[t * INTRA_P + j] : 0.0f;
}

// out = T · diag(scale) src over every column, tile by tile.
__device__ void intra_apply(const float *T, const float *src, int width, int c, const float *scale, float *tile,
                            float *out) {
  const int cc = threadIdx.x % 32, row0 = threadIdx.x / 32;
  for (int col0 = 0; col0 < width; col0 += INTRA_TW) {
    intra_stage(src, width, col0, c, scale, tile);
    __syncthreads();
    for (int t = row0; t < c; t += 8) {
      float acc = 0.0f;
      for (int j = 0; j <= t; ++j) acc += T[t * INTRA_P + j] * tile[j * INTRA_TP + cc];
      if (col0 + cc < width) out[(long long)t * width + col0 + cc] = acc;
    }
    __syncthreads();
  }
}

// scal = [β (blocks x c) | γ (blocks x c)]; W [blocks, c, dv] and Kc [blocks, c, dk] out.
extern "C" __global__ void __launch_bounds__(256)
    chunk_intra_fwd_f32(const float *k, const float *v, const float *scal, float *w_out, float *kc_out,
                        long long blocks, int c, int dk, int dv) {
  extern __shared__ float ism[];
  float *G = ism, *T = G + INTRA_C * INTRA_P, *tile = T + INTRA_C * INTRA_P;
  float *bet = tile + INTRA_C * INTRA_TP, *gam = bet + INTRA_C, *ys = gam + INTRA_C;
  const long long blk = blockIdx.x;
  const float *kb = k + blk * c * dk, *vb = v + blk * c * dv;
  for (int i = threadIdx.x; i < INTRA_C; i += blockDim.x) {
    bet[i] = i < c ? scal[blk * c + i] : 0.0f;
    gam[i] = i < c ? scal[(blocks + blk) * c + i] : 0.0f;
    ys[i] = bet[i] * __expf(gam[i]);
  }
  intra_gram(kb, c, dk, tile, G);
  __syncthreads();
  // A over G in place: each entry is read and written by one thread.
  for (int e = threadIdx.x; e < INTRA_C * INTRA_C; e += blockDim.x) {
    const int t = e / INTRA_C, j = e % INTRA_C;
    G[t * INTRA_P + j] = t < c ? intra_a(G, bet, gam, t, j) : 0.0f;
  }
  __syncthreads();
  intra_invert(G, c, T);
  __syncthreads();
  intra_apply(T, vb, dv, c, bet, tile, w_out + blk * c * dv);
  intra_apply(T, kb, dk, c, ys, tile, kc_out + blk * c * dk);
}

// The backward, recomputing G and T: out = [dk (blocks x c x dk) | dv | dβ | dγ] from dW and
// kc_sign · dKc (the walk's backward hands over −dKc's product as it comes).
extern "C" __global__ void __launch_bounds__(256)
    chunk_intra_bwd_f32(const float *k, const float *v, const float *scal, const float *grad_w,
                        const float *grad_kc, float *out, long long blocks, int c, int dk, int dv, float kc_sign) {
  extern __shared__ float ism[];
  const int SQ = INTRA_C * INTRA_P, TL = INTRA_C * INTRA_TP;
  float *G = ism, *T = G + SQ, *D = T + SQ, *M = D + SQ, *ta = M + SQ, *tb = ta + TL;
  float *bet = tb + TL, *gam = bet + INTRA_C, *ys = gam + INTRA_C, *dbet = ys + INTRA_C, *dgam = dbet + INTRA_C;
  const long long blk = blockIdx.x;
  const float *kb = k + blk * c * dk, *vb = v + blk * c * dv;
  const float *gw = grad_w + blk * c * dv, *gkc = grad_kc + blk * c * dk;
  float *dk_out = out + blk * c * dk, *dv_out = out + blocks * c * dk + blk * c * dv;
  float *db_out = out + blocks * c * (dk + dv) + blk * c, *dg_out = db_out + blocks * c;
  const int tid = threadIdx.x, bi = tid / 16, bj = tid % 16, cc = tid % 32, row0 = tid / 32;
  for (int i = tid; i < INTRA_C; i += blockDim.x) {
    bet[i] = i < c ? scal[blk * c + i] : 0.0f;
    gam[i] = i < c ? scal[(blocks + blk) * c + i] : 0.0f;
    ys[i] = bet[i] * __expf(gam[i]);
    dbet[i] = 0.0f;
    dgam[i] = 0.0f;
  }
  intra_gram(kb, c, dk, ta, G);
  __syncthreads();
  for (int e = tid; e < INTRA_C * INTRA_C; e += blockDim.x) {
    const int t = e / INTRA_C, j = e % INTRA_C;
    M[t * INTRA_P + j] = t < c ? intra_a(G, bet, gam, t, j) : 0.0f;
  }
  __syncthreads();
  intra_invert(M, c, T);
  __syncthreads();

  // dT = dW (βV)ᵀ + dKc (β e^γ K)ᵀ, with dX = Tᵀ dW (→ dV, and v·dX into dβ) on the way.
  float ax[4][4] = {}, ay[4][4] = {};
  for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
    intra_stage(gw, dv, col0, c, nullptr, ta);
    intra_stage(vb, dv, col0, c, nullptr, tb);
    __syncthreads();
    if (bj <= bi) intra_pairs(ta, tb, bi, bj, ax);
    for (int j = row0; j < c; j += 8) {
      float dx = 0.0f;
      for (int t = j; t < c; ++t) dx += T[t * INTRA_P + j] * ta[t * INTRA_TP + cc];
      if (col0 + cc < dv) dv_out[(long long)j * dv + col0 + cc] = bet[j] * dx;
      const float s = warp_sum(dx * tb[j * INTRA_TP + cc]);
      if (cc == 0) dbet[j] += s;
    }
    __syncthreads();
  }
  lower_products(gkc, dk, kb, dk, dk, c, ta, tb, ay);
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int t = 4 * bi + q, j = 4 * bj + s;
      D[t * INTRA_P + j] = j < t && t < c ? bet[j] * ax[q][s] + kc_sign * ys[j] * ay[q][s] : 0.0f;
    }
  __syncthreads();

  // M = Tᵀ dT, then dA = M Tᵀ over dT.
  {
    float m[4][4] = {};
    block_product(T, 1, INTRA_P, D, 1, INTRA_P, c, bi, bj, m);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int s = 0; s < 4; ++s) M[(4 * bi + q) * INTRA_P + 4 * bj + s] = m[q][s];
  }
  __syncthreads();
  {
    float m[4][4] = {};
    block_product(M, INTRA_P, 1, T, INTRA_P, 1, c, bi, bj, m);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int s = 0; s < 4; ++s) D[(4 * bi + q) * INTRA_P + 4 * bj + s] = m[q][s];
  }
  __syncthreads();

  // Per entry below the diagonal: dG into M, P = dA · A over dA in D; row sums of P and the
  // G term of dβ by the row's thread.
  if (tid < c) {
    const int t = tid;
    float pb = 0.0f, pg = 0.0f;
    for (int j = 0; j < INTRA_C; ++j) {
      if (j < t) {
        const float e = __expf(gam[t] - gam[j]), da = D[t * INTRA_P + j], g = G[t * INTRA_P + j];
        const float p = da * (-bet[t] * e * g);
        pb -= da * e * g;
        pg += p;
        M[t * INTRA_P + j] = -bet[t] * e * da;
        D[t * INTRA_P + j] = p;
      } else {
        M[t * INTRA_P + j] = 0.0f;
      }
    }
    dbet[t] += pb;
    dgam[t] += pg;
  }
  __syncthreads();
  if (tid < c) {
    float s = 0.0f;
    for (int r = tid + 1; r < c; ++r) s += D[r * INTRA_P + tid];
    dgam[tid] -= s;
  }
  __syncthreads();

  // dK = dG K + dGᵀ K + diag(β e^γ) Tᵀ dKc, with k·dY into dβ and dγ.
  for (int col0 = 0; col0 < dk; col0 += INTRA_TW) {
    intra_stage(gkc, dk, col0, c, nullptr, ta);
    intra_stage(kb, dk, col0, c, nullptr, tb);
    __syncthreads();
    for (int j = row0; j < c; j += 8) {
      float dy = 0.0f, dgk = 0.0f;
      for (int t = j; t < c; ++t) dy += T[t * INTRA_P + j] * ta[t * INTRA_TP + cc];
      dy *= kc_sign;
      for (int s = 0; s < c; ++s) dgk += (M[j * INTRA_P + s] + M[s * INTRA_P + j]) * tb[s * INTRA_TP + cc];
      if (col0 + cc < dk) dk_out[(long long)j * dk + col0 + cc] = ys[j] * dy + dgk;
      const float s = warp_sum(dy * tb[j * INTRA_TP + cc]);
      if (cc == 0) {
        dbet[j] += __expf(gam[j]) * s;
        dgam[j] += ys[j] * s;
      }
    }
    __syncthreads();
  }
  for (int i = tid; i < c; i += blockDim.x) {
    db_out[i] = dbet[i];
    dg_out[i] = dgam[i];
  }
}

// The chunked delta rule's outputs (src/ops/chunk_out.rs has the math and the CPU half). One
// block of 256 threads per chunk and head; qk [blocks, c, 2dk] (queries, then keys), walked =
// [U (blocks x c x dv) | states ((n + 1) bh x dk x dv)], γ [blocks, c]. P = Q̃Kᵀ ∘ D stays in
// shared memory; the products with U and S run over column tiles as in the solve above.

// acc[i] += Σ_{r<INTRA_TW} ta[row0 + 8i][r] tb[r rb + cc cb]: a thread's eight rows of a staged
// tile times a staged tile read by rows (rb = INTRA_TP, cb = 1) or transposed (rb = 1).
__device__ __forceinline__ void rows_by_tile(const float *ta, const float *tb, int rb, int cb, int row0, int cc,
                                             float acc[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float *a = ta + (row0 + 8 * i) * INTRA_TP;
    float x = 0.0f;
    for (int r = 0; r < INTRA_TW; ++r) x += a[r] * tb[r * rb + cc * cb];
    acc[i] += x;
  }
}

// P[t][j] = scale (q_t·k_j) e^{γ_t − γ_j} for j ≤ t < c, else 0, staging q and k in ta, tb.
__device__ void out_scores(const float *qk, int c, int dk, float scale, const float *gam, float *ta, float *tb,
                           float *P) {
  const int bi = threadIdx.x / 16, bj = threadIdx.x % 16;
  float acc[4][4] = {};
  lower_products(qk, 2 * dk, qk + dk, 2 * dk, dk, c, ta, tb, acc);
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int t = 4 * bi + q, j = 4 * bj + s;
      P[t * INTRA_P + j] = j <= t && t < c ? scale * acc[q][s] * __expf(gam[t] - gam[j]) : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(256)
    chunk_out_fwd_f32(const float *qk, const float *walked, const float *gamma, float *out, long long blocks, int c,
                      int dk, int dv, float scale) {
  extern __shared__ float osm[];
  float *P = osm, *ta = P + INTRA_C * INTRA_P, *tb = ta + INTRA_C * INTRA_TP, *gam = tb + INTRA_C * INTRA_TP;
  const long long blk = blockIdx.x;
  const float *q = qk + blk * c * 2 * dk, *u = walked + blk * c * dv, *S = walked + blocks * c * dv + blk * dk * dv;
  float *o = out + blk * c * dv;
  const int cc = threadIdx.x % 32, row0 = threadIdx.x / 32;
  for (int i = threadIdx.x; i < INTRA_C; i += blockDim.x) gam[i] = i < c ? gamma[blk * c + i] : 0.0f;
  __syncthreads();
  out_scores(q, c, dk, scale, gam, ta, tb, P);
  __syncthreads();
  for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
    float acc[8] = {};
    // e^γ Q̃ S over key tiles: ta holds Q's columns r0.., tb rows r0.. of S.
    for (int r0 = 0; r0 < dk; r0 += INTRA_TW) {
      chunk_stage(q, 2 * dk, dk, r0, c, INTRA_C, nullptr, ta);
      chunk_stage(S + (long long)r0 * dv, dv, dv, col0, dk - r0, INTRA_TW, nullptr, tb);
      __syncthreads();
      rows_by_tile(ta, tb, INTRA_TP, 1, row0, cc, acc);
      __syncthreads();
    }
    intra_stage(u, dv, col0, c, nullptr, tb);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = row0 + 8 * i;
      if (t >= c) continue;
      float x = scale * __expf(gam[t]) * acc[i];
      for (int j = 0; j <= t; ++j) x += P[t * INTRA_P + j] * tb[j * INTRA_TP + cc];
      if (col0 + cc < dv) o[(long long)t * dv + col0 + cc] = x;
    }
    __syncthreads();
  }
}

// The backward: dqk_out, and out = [dU | dS (the last chunk-start state's stays as allocated,
// zero) | dγ]. dqk has a buffer of its own, so that dU | dS can be freed once the walk's backward
// has read them while dqk lives on.
extern "C" __global__ void __launch_bounds__(256)
    chunk_out_bwd_f32(const float *qk, const float *walked, const float *gamma, const float *grad, float *dqk_out,
                      float *out, long long blocks, long long walked_len, int c, int dk, int dv, float scale) {
  extern __shared__ float osm[];
  float *P = osm, *ED = P + INTRA_C * INTRA_P, *ta = ED + INTRA_C * INTRA_P, *tb = ta + INTRA_C * INTRA_TP;
  float *gam = tb + INTRA_C * INTRA_TP, *qs = gam + INTRA_C, *dg = qs + INTRA_C;
  const long long blk = blockIdx.x;
  const float *q = qk + blk * c * 2 * dk, *u = walked + blk * c * dv, *S = walked + blocks * c * dv + blk * dk * dv;
  const float *go = grad + blk * c * dv;
  float *dqk = dqk_out + blk * c * 2 * dk, *du = out + blk * c * dv;
  float *ds = out + blocks * c * dv + blk * dk * dv, *dgo = out + walked_len + blk * c;
  const int tid = threadIdx.x, bi = tid / 16, bj = tid % 16, cc = tid % 32, row0 = tid / 32;
  for (int i = tid; i < INTRA_C; i += blockDim.x) {
    gam[i] = i < c ? gamma[blk * c + i] : 0.0f;
    qs[i] = scale * __expf(gam[i]);
    dg[i] = 0.0f;
  }
  __syncthreads();
  out_scores(q, c, dk, scale, gam, ta, tb, P);
  __syncthreads();

  // E = dO Uᵀ, and dU = Pᵀ dO on the way.
  float e[4][4] = {};
  for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
    intra_stage(go, dv, col0, c, nullptr, ta);
    intra_stage(u, dv, col0, c, nullptr, tb);
    __syncthreads();
    if (bj <= bi) intra_pairs(ta, tb, bi, bj, e);
    for (int j = row0; j < c; j += 8) {
      float x = 0.0f;
      for (int t = j; t < c; ++t) x += P[t * INTRA_P + j] * ta[t * INTRA_TP + cc];
      if (col0 + cc < dv) du[(long long)j * dv + col0 + cc] = x;
    }
    __syncthreads();
  }
  // ED = E ∘ D; F = E ∘ P over P (strictly below the diagonal: the diagonal's terms cancel).
#pragma unroll
  for (int q4 = 0; q4 < 4; ++q4)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int t = 4 * bi + q4, j = 4 * bj + s;
      const bool in = j <= t && t < c;
      ED[t * INTRA_P + j] = in ? e[q4][s] * __expf(gam[t] - gam[j]) : 0.0f;
      P[t * INTRA_P + j] = in && j < t ? e[q4][s] * P[t * INTRA_P + j] : 0.0f;
    }
  __syncthreads();
  if (tid < c) {
    float x = 0.0f;
    for (int j = 0; j < tid; ++j) x += P[tid * INTRA_P + j];
    dg[tid] += x;
  }
  __syncthreads();
  if (tid < c) {
    float x = 0.0f;
    for (int t = tid + 1; t < c; ++t) x += P[t * INTRA_P + tid];
    dg[tid] -= x;
  }
  __syncthreads();

  // dS = (diag(scale e^γ) Q)ᵀ dO, by key tile and column tile.
  for (int r0 = 0; r0 < dk; r0 += INTRA_TW)
    for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
      chunk_stage(q, 2 * dk, dk, r0, c, INTRA_C, qs, ta);
      intra_stage(go, dv, col0, c, nullptr, tb);
      __syncthreads();
      for (int r = row0; r < INTRA_TW; r += 8) {
        float x = 0.0f;
        for (int t = 0; t < c; ++t) x += ta[t * INTRA_TP + r] * tb[t * INTRA_TP + cc];
        if (r0 + r < dk && col0 + cc < dv) ds[(long long)(r0 + r) * dv + col0 + cc] = x;
      }
      __syncthreads();
    }

  // dQ̃ = diag(e^γ) dO Sᵀ + ED K and dK = EDᵀ Q̃, by key tile; e^γ q̃·(dO Sᵀ) into dγ.
  for (int r0 = 0; r0 < dk; r0 += INTRA_TW) {
    float acc[8] = {};
    for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
      intra_stage(go, dv, col0, c, nullptr, ta);
      chunk_stage(S + (long long)r0 * dv, dv, dv, col0, dk - r0, INTRA_TW, nullptr, tb);
      __syncthreads();
      rows_by_tile(ta, tb, 1, INTRA_TP, row0, cc, acc);
      __syncthreads();
    }
    chunk_stage(q + dk, 2 * dk, dk, r0, c, INTRA_C, nullptr, ta);
    chunk_stage(q, 2 * dk, dk, r0, c, INTRA_C, nullptr, tb);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = row0 + 8 * i;
      if (t >= c) continue;
      const float inter = __expf(gam[t]) * acc[i];
      float intra = 0.0f, dkey = 0.0f;
      for (int j = 0; j <= t; ++j) intra += ED[t * INTRA_P + j] * ta[j * INTRA_TP + cc];
      for (int s = t; s < c; ++s) dkey += ED[s * INTRA_P + t] * tb[s * INTRA_TP + cc];
      const float x = warp_sum(inter * tb[t * INTRA_TP + cc]);
      if (cc == 0) dg[t] += scale * x;
      if (r0 + cc < dk) {
        dqk[(long long)t * 2 * dk + r0 + cc] = scale * (inter + intra);
        dqk[(long long)t * 2 * dk + dk + r0 + cc] = scale * dkey;
      }
    }
    __syncthreads();
  }
  for (int i = tid; i < c; i += blockDim.x) dgo[i] = dg[i];
}

// ---- The chunk kernels on tensor cores (the `_tc` forms, for bf16 and f16 models) ----
// The same ops as the float32 kernels above, with their products on mma.sync m16n8k8: operands
// as TF32 (10-bit mantissa, finer than the bf16 the model's inputs were), sums and state in
// float32. The mma reads a float's top 19 bits, so the operands go in as they are, truncated:
// rounding them first (cvt.rna) cost a conversion per element, 2-5% of the kernels' time. A
// warp multiplies 16 x 8 tiles of an M x N product; its tiles are warp + 8 s for slot s < S,
// accumulated in registers across calls (one call per staged slice of K). Operands are strided
// views of shared memory, so a transpose is a choice of strides. Staged tiles use row stride
// TC_TP (≡ 4 mod 32, so a warp's row-major fragment reads hit 32 distinct banks) and the [c, c]
// matrices TC_P.
#define TC_TP 36
#define TC_P 68

struct TcView {
  const float *p;
  int rs, cs;
  __device__ __forceinline__ float at(int i, int j) const { return p[i * rs + j * cs]; }
};

__device__ __forceinline__ unsigned tc_bits(float x) { return __float_as_uint(x); }

// c += A[m0.., k0..k0+8] B[k0..k0+8, n0..] for one 16 x 8 tile (g = lane / 4, t = lane % 4).
__device__ __forceinline__ void tc_mma(float c[4], const TcView &a, int m0, const TcView &b, int n0, int k0, int g,
                                       int t) {
#if __CUDA_ARCH__ >= 800
  const unsigned a0 = tc_bits(a.at(m0 + g, k0 + t)), a1 = tc_bits(a.at(m0 + g + 8, k0 + t)),
                 a2 = tc_bits(a.at(m0 + g, k0 + t + 4)), a3 = tc_bits(a.at(m0 + g + 8, k0 + t + 4));
  const unsigned b0 = tc_bits(b.at(k0 + t, n0 + g)), b1 = tc_bits(b.at(k0 + t + 4, n0 + g));
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // src/ops/cuda.rs launches the _tc kernels only on compute capability 8.0 and above
#endif
}

// The warp's tile in slot s of an M x N product (M % 16 == 0, N % 8 == 0), if it has one.
__device__ __forceinline__ bool tc_tile(int M, int N, int s, int &m0, int &n0) {
  const int tile = threadIdx.x / 32 + (blockDim.x / 32) * s, tn = N / 8;
  if (tile >= (M / 16) * tn) return false;
  m0 = tile / tn * 16;
  n0 = tile % tn * 8;
  return true;
}

// acc += A B over K (K % 8 == 0) on the warp's tiles; `lower` skips tiles wholly above the
// diagonal, which stay as they are (zero for products that are causal).
template <int S>
__device__ __forceinline__ void tc_acc(float acc[S][4], int M, int N, int K, TcView a, TcView b, bool lower) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    int m0, n0;
    if (!tc_tile(M, N, s, m0, n0) || (lower && n0 > m0 + 15)) continue;
    for (int k0 = 0; k0 < K; k0 += 8) tc_mma(acc[s], a, m0, b, n0, k0, g, t);
  }
}

template <int S> __device__ __forceinline__ void tc_zero(float acc[S][4]) {
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[s][i] = 0.0f;
}

// f(row, col, x, y) for the element pairs (col, col + 1) of the warp's tiles (col even).
template <int S, typename F> __device__ __forceinline__ void tc_each_pair(float acc[S][4], int M, int N, F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    int m0, n0;
    if (!tc_tile(M, N, s, m0, n0)) continue;
    f(m0 + g, n0 + 2 * t, acc[s][0], acc[s][1]);
    f(m0 + g + 8, n0 + 2 * t, acc[s][2], acc[s][3]);
  }
}

// f(row, col, value) for every element of the warp's tiles, in tc_each_pair's order.
template <int S, typename F> __device__ __forceinline__ void tc_each(float acc[S][4], int M, int N, F f) {
  tc_each_pair<S>(acc, M, N, [&](int r, int c, float x, float y) {
    f(r, c, x);
    f(r, c + 1, y);
  });
}

// x and y to row[col] and row[col + 1] where those columns are below width (col even): one 8-byte
// store when both are and the width is even (rows 8-byte aligned), so that a warp's stores fill
// the 32-byte sectors they touch, where single floats filled half of each.
__device__ __forceinline__ void tc_store2(float *row, int col, int width, float x, float y) {
  if ((width & 1) == 0 && col + 1 < width) {
    *reinterpret_cast<float2 *>(row + col) = make_float2(x, y);
  } else {
    if (col < width) row[col] = x;
    if (col + 1 < width) row[col + 1] = y;
  }
}

// chunk_stage at row stride TC_TP, four columns a load where the rows are 16-byte aligned.
__device__ __forceinline__ void tc_stage(const float *src, int ld, int width, int col0, int valid, int rows,
                                         const float *scale, float *tile) {
  if (((ld | width | col0) & 3) == 0 && ((uintptr_t)src & 15) == 0) {
    for (int e = threadIdx.x; e < rows * (INTRA_TW / 4); e += blockDim.x) {
      const int t = e / (INTRA_TW / 4), r = e % (INTRA_TW / 4) * 4;
      float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (t < valid && col0 + r < width) {
        x = *reinterpret_cast<const float4 *>(src + (long long)t * ld + col0 + r);
        if (scale) {
          const float f = scale[t];
          x = make_float4(x.x * f, x.y * f, x.z * f, x.w * f);
        }
      }
      *reinterpret_cast<float4 *>(tile + t * TC_TP + r) = x;
    }
    return;
  }
  chunk_stage(src, ld, width, col0, valid, rows, scale, tile, TC_TP);
}

// Row-major [rows, TC_TP] and [c, c] views, and their transposes.
__device__ __forceinline__ TcView tc_rows(const float *p) { return TcView{p, TC_TP, 1}; }
__device__ __forceinline__ TcView tc_cols(const float *p) { return TcView{p, 1, TC_TP}; }
__device__ __forceinline__ TcView tc_sq(const float *p) { return TcView{p, TC_P, 1}; }
__device__ __forceinline__ TcView tc_sq_t(const float *p) { return TcView{p, 1, TC_P}; }

// acc (64 x 64, S = 4) += A Bᵀ below and on the diagonal for A, B [c, width] (row strides lda,
// ldb), staged 32 columns at a time through ta and tb.
__device__ void tc_lower_products(const float *a, int lda, const float *b, int ldb, int width, int c, float *ta,
                                  float *tb, float acc[4][4]) {
  for (int col0 = 0; col0 < width; col0 += INTRA_TW) {
    tc_stage(a, lda, width, col0, c, INTRA_C, nullptr, ta);
    tc_stage(b, ldb, width, col0, c, INTRA_C, nullptr, tb);
    __syncthreads();
    tc_acc<4>(acc, INTRA_C, INTRA_C, INTRA_TW, tc_rows(ta), tc_cols(tb), true);
    __syncthreads();
  }
}

// P = scale (Q Kᵀ) ∘ D (zero above the diagonal and past c) into P [64, TC_P].
__device__ void tc_out_scores(const float *qk, int c, int dk, float scale, const float *gam, float *ta, float *tb,
                              float *P) {
  float acc[4][4];
  tc_zero<4>(acc);
  tc_lower_products(qk, 2 * dk, qk + dk, 2 * dk, dk, c, ta, tb, acc);
  tc_each<4>(acc, INTRA_C, INTRA_C, [&](int t, int j, float x) {
    P[t * TC_P + j] = j <= t && t < c ? scale * x * __expf(gam[t] - gam[j]) : 0.0f;
  });
}

// chunk_out_fwd_f32 on tensor cores; shared memory P [64, TC_P], two tiles [64, TC_TP], γ and
// scale·e^γ.
extern "C" __global__ void __launch_bounds__(256)
    chunk_out_fwd_tc(const float *qk, const float *walked, const float *gamma, float *out, long long blocks, int c,
                     int dk, int dv, float scale) {
  extern __shared__ float osm[];
  float *P = osm, *ta = P + INTRA_C * TC_P, *tb = ta + INTRA_C * TC_TP, *gam = tb + INTRA_C * TC_TP;
  float *qs = gam + INTRA_C;
  const long long blk = blockIdx.x;
  const float *q = qk + blk * c * 2 * dk, *u = walked + blk * c * dv, *S = walked + blocks * c * dv + blk * dk * dv;
  float *o = out + blk * c * dv;
  for (int i = threadIdx.x; i < INTRA_C; i += blockDim.x) {
    gam[i] = i < c ? gamma[blk * c + i] : 0.0f;
    qs[i] = scale * __expf(gam[i]);
  }
  __syncthreads();
  tc_out_scores(q, c, dk, scale, gam, ta, tb, P);
  __syncthreads();
  for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
    float acc[2][4];
    tc_zero<2>(acc);
    // diag(scale e^γ) Q S over key tiles: ta holds Q's columns r0.., tb rows r0.. of S.
    for (int r0 = 0; r0 < dk; r0 += INTRA_TW) {
      tc_stage(q, 2 * dk, dk, r0, c, INTRA_C, qs, ta);
      tc_stage(S + (long long)r0 * dv, dv, dv, col0, dk - r0, INTRA_TW, nullptr, tb);
      __syncthreads();
      tc_acc<2>(acc, INTRA_C, INTRA_TW, INTRA_TW, tc_rows(ta), tc_rows(tb), false);
      __syncthreads();
    }
    tc_stage(u, dv, dv, col0, c, INTRA_C, nullptr, tb);
    __syncthreads();
    tc_acc<2>(acc, INTRA_C, INTRA_TW, INTRA_C, tc_sq(P), tc_rows(tb), false);
    tc_each_pair<2>(acc, INTRA_C, INTRA_TW, [&](int t, int j, float x, float y) {
      if (t < c) tc_store2(o + (long long)t * dv, col0 + j, dv, x, y);
    });
    __syncthreads();
  }
}

// chunk_out_bwd_f32 on tensor cores; shared memory P and E ∘ D [64, TC_P], three tiles [64,
// TC_TP], γ, scale·e^γ and dγ.
extern "C" __global__ void __launch_bounds__(256)
    chunk_out_bwd_tc(const float *qk, const float *walked, const float *gamma, const float *grad, float *dqk_out,
                     float *out, long long blocks, long long walked_len, int c, int dk, int dv, float scale) {
  extern __shared__ float osm[];
  const int SQ = INTRA_C * TC_P, TL = INTRA_C * TC_TP;
  float *P = osm, *ED = P + SQ, *ta = ED + SQ, *tb = ta + TL, *X = tb + TL;
  float *gam = X + TL, *qs = gam + INTRA_C, *dg = qs + INTRA_C;
  const long long blk = blockIdx.x;
  const float *q = qk + blk * c * 2 * dk, *u = walked + blk * c * dv, *S = walked + blocks * c * dv + blk * dk * dv;
  const float *go = grad + blk * c * dv;
  float *dqk = dqk_out + blk * c * 2 * dk, *du = out + blk * c * dv;
  float *ds = out + blocks * c * dv + blk * dk * dv, *dgo = out + walked_len + blk * c;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int i = tid; i < INTRA_C; i += blockDim.x) {
    gam[i] = i < c ? gamma[blk * c + i] : 0.0f;
    qs[i] = scale * __expf(gam[i]);
    dg[i] = 0.0f;
  }
  __syncthreads();
  tc_out_scores(q, c, dk, scale, gam, ta, tb, P);
  __syncthreads();

  // E = dO Uᵀ, and dU = Pᵀ dO on the way.
  float e[4][4];
  tc_zero<4>(e);
  for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
    tc_stage(go, dv, dv, col0, c, INTRA_C, nullptr, ta);
    tc_stage(u, dv, dv, col0, c, INTRA_C, nullptr, tb);
    __syncthreads();
    tc_acc<4>(e, INTRA_C, INTRA_C, INTRA_TW, tc_rows(ta), tc_cols(tb), true);
    float x[2][4];
    tc_zero<2>(x);
    tc_acc<2>(x, INTRA_C, INTRA_TW, INTRA_C, tc_sq_t(P), tc_rows(ta), false);
    tc_each_pair<2>(x, INTRA_C, INTRA_TW, [&](int j, int col, float v, float w) {
      if (j < c) tc_store2(du + (long long)j * dv, col0 + col, dv, v, w);
    });
    __syncthreads();
  }
  // ED = E ∘ D; F = E ∘ P over P (strictly below the diagonal: the diagonal's terms cancel).
  // Each element is read and written by the thread that holds it.
  tc_each<4>(e, INTRA_C, INTRA_C, [&](int t, int j, float x) {
    const bool in = j <= t && t < c;
    ED[t * TC_P + j] = in ? x * __expf(gam[t] - gam[j]) : 0.0f;
    P[t * TC_P + j] = in && j < t ? x * P[t * TC_P + j] : 0.0f;
  });
  __syncthreads();
  if (tid < c) {
    float x = 0.0f;
    for (int j = 0; j < tid; ++j) x += P[tid * TC_P + j];
    for (int t = tid + 1; t < c; ++t) x -= P[t * TC_P + tid];
    dg[tid] += x;
  }
  __syncthreads();

  // dS = (diag(scale e^γ) Q)ᵀ dO, by key tile and column tile (32 x 32: one tile a warp).
  for (int r0 = 0; r0 < dk; r0 += INTRA_TW)
    for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
      tc_stage(q, 2 * dk, dk, r0, c, INTRA_C, qs, ta);
      tc_stage(go, dv, dv, col0, c, INTRA_C, nullptr, tb);
      __syncthreads();
      float x[1][4];
      tc_zero<1>(x);
      tc_acc<1>(x, INTRA_TW, INTRA_TW, INTRA_C, tc_cols(ta), tc_rows(tb), false);
      tc_each_pair<1>(x, INTRA_TW, INTRA_TW, [&](int r, int col, float v, float w) {
        if (r0 + r < dk) tc_store2(ds + (long long)(r0 + r) * dv, col0 + col, dv, v, w);
      });
      __syncthreads();
    }

  // By key tile: X = diag(e^γ) dO Sᵀ, dQ̃ = X + ED K, dK = EDᵀ Q̃, and e^γ q̃·(dO Sᵀ) into dγ.
  for (int r0 = 0; r0 < dk; r0 += INTRA_TW) {
    float x[2][4];
    tc_zero<2>(x);
    for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
      tc_stage(go, dv, dv, col0, c, INTRA_C, nullptr, ta);
      tc_stage(S + (long long)r0 * dv, dv, dv, col0, dk - r0, INTRA_TW, nullptr, tb);
      __syncthreads();
      tc_acc<2>(x, INTRA_C, INTRA_TW, INTRA_TW, tc_rows(ta), tc_cols(tb), false);
      __syncthreads();
    }
    tc_each<2>(x, INTRA_C, INTRA_TW, [&](int t, int r, float v) { X[t * TC_TP + r] = __expf(gam[t]) * v; });
    tc_stage(q + dk, 2 * dk, dk, r0, c, INTRA_C, nullptr, ta);
    tc_stage(q, 2 * dk, dk, r0, c, INTRA_C, nullptr, tb);
    __syncthreads();
    for (int t = warp; t < c; t += blockDim.x / 32) {
      const float s = warp_sum(X[t * TC_TP + lane] * tb[t * TC_TP + lane]);
      if (lane == 0) dg[t] += scale * s;
    }
    float y[2][4], z[2][4];
    tc_zero<2>(y);
    tc_zero<2>(z);
    tc_acc<2>(y, INTRA_C, INTRA_TW, INTRA_C, tc_sq(ED), tc_rows(ta), false);
    tc_acc<2>(z, INTRA_C, INTRA_TW, INTRA_C, tc_sq_t(ED), tc_rows(tb), false);
    tc_each_pair<2>(y, INTRA_C, INTRA_TW, [&](int t, int r, float v, float w) {
      const float *xr = X + t * TC_TP + r;
      if (t < c) tc_store2(dqk + (long long)t * 2 * dk + r0, r, dk - r0, scale * (xr[0] + v), scale * (xr[1] + w));
    });
    tc_each_pair<2>(z, INTRA_C, INTRA_TW, [&](int t, int r, float v, float w) {
      if (t < c) tc_store2(dqk + (long long)t * 2 * dk + dk + r0, r, dk - r0, scale * v, scale * w);
    });
    __syncthreads();
  }
  for (int i = tid; i < c; i += blockDim.x) dgo[i] = dg[i];
}

// out = T · diag(scale) src over every column, tile by tile (intra_apply on tensor cores).
__device__ void tc_intra_apply(const float *T, const float *src, int width, int c, const float *scale, float *tile,
                               float *out) {
  for (int col0 = 0; col0 < width; col0 += INTRA_TW) {
    tc_stage(src, width, width, col0, c, INTRA_C, scale, tile);
    __syncthreads();
    float acc[2][4];
    tc_zero<2>(acc);
    tc_acc<2>(acc, INTRA_C, INTRA_TW, INTRA_C, tc_sq(T), tc_rows(tile), false);
    tc_each_pair<2>(acc, INTRA_C, INTRA_TW, [&](int t, int j, float x, float y) {
      if (t < c) tc_store2(out + (long long)t * width, col0 + j, width, x, y);
    });
    __syncthreads();
  }
}

// A = −β_t e^{γ_t − γ_j} (K Kᵀ)_tj below the diagonal into A [64, TC_P] (zero elsewhere); the
// Gram matrix itself into G when given.
__device__ void tc_intra_system(const float *k, int c, int dk, const float *bet, const float *gam, float *ta,
                                float *tb, float *A, float *G) {
  float acc[4][4];
  tc_zero<4>(acc);
  tc_lower_products(k, dk, k, dk, dk, c, ta, tb, acc);
  tc_each<4>(acc, INTRA_C, INTRA_C, [&](int t, int j, float x) {
    if (G) G[t * TC_P + j] = x;
    A[t * TC_P + j] = j < t && t < c ? -bet[t] * __expf(gam[t] - gam[j]) * x : 0.0f;
  });
}

// chunk_intra_fwd_f32 on tensor cores; shared memory A and T [64, TC_P], two tiles [64, TC_TP],
// β, γ, β e^γ.
extern "C" __global__ void __launch_bounds__(256)
    chunk_intra_fwd_tc(const float *k, const float *v, const float *scal, float *w_out, float *kc_out,
                       long long blocks, int c, int dk, int dv) {
  extern __shared__ float ism[];
  const int SQ = INTRA_C * TC_P, TL = INTRA_C * TC_TP;
  float *A = ism, *T = A + SQ, *ta = T + SQ, *tb = ta + TL;
  float *bet = tb + TL, *gam = bet + INTRA_C, *ys = gam + INTRA_C;
  const long long blk = blockIdx.x;
  const float *kb = k + blk * c * dk, *vb = v + blk * c * dv;
  for (int i = threadIdx.x; i < INTRA_C; i += blockDim.x) {
    bet[i] = i < c ? scal[blk * c + i] : 0.0f;
    gam[i] = i < c ? scal[(blocks + blk) * c + i] : 0.0f;
    ys[i] = bet[i] * __expf(gam[i]);
  }
  __syncthreads();
  tc_intra_system(kb, c, dk, bet, gam, ta, tb, A, nullptr);
  __syncthreads();
  intra_invert(A, c, T, TC_P);
  __syncthreads();
  tc_intra_apply(T, vb, dv, c, bet, ta, w_out + blk * c * dv);
  tc_intra_apply(T, kb, dk, c, ys, ta, kc_out + blk * c * dk);
}

// chunk_intra_bwd_f32 on tensor cores; shared memory G, T, D, M [64, TC_P], three tiles [64,
// TC_TP] and five per-token scalars.
extern "C" __global__ void __launch_bounds__(256)
    chunk_intra_bwd_tc(const float *k, const float *v, const float *scal, const float *grad_w,
                       const float *grad_kc, float *out, long long blocks, int c, int dk, int dv, float kc_sign) {
  extern __shared__ float ism[];
  const int SQ = INTRA_C * TC_P, TL = INTRA_C * TC_TP;
  float *G = ism, *T = G + SQ, *D = T + SQ, *M = D + SQ, *ta = M + SQ, *tb = ta + TL, *X = tb + TL;
  float *bet = X + TL, *gam = bet + INTRA_C, *ys = gam + INTRA_C, *dbet = ys + INTRA_C, *dgam = dbet + INTRA_C;
  const long long blk = blockIdx.x;
  const float *kb = k + blk * c * dk, *vb = v + blk * c * dv;
  const float *gw = grad_w + blk * c * dv, *gkc = grad_kc + blk * c * dk;
  float *dk_out = out + blk * c * dk, *dv_out = out + blocks * c * dk + blk * c * dv;
  float *db_out = out + blocks * c * (dk + dv) + blk * c, *dg_out = db_out + blocks * c;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
  for (int i = tid; i < INTRA_C; i += blockDim.x) {
    bet[i] = i < c ? scal[blk * c + i] : 0.0f;
    gam[i] = i < c ? scal[(blocks + blk) * c + i] : 0.0f;
    ys[i] = bet[i] * __expf(gam[i]);
    dbet[i] = 0.0f;
    dgam[i] = 0.0f;
  }
  __syncthreads();
  tc_intra_system(kb, c, dk, bet, gam, ta, tb, M, G);
  __syncthreads();
  intra_invert(M, c, T, TC_P);
  __syncthreads();

  // dT = dW (βV)ᵀ + dKc (β e^γ K)ᵀ, with dX = Tᵀ dW (→ dV, and v·dX into dβ) on the way.
  float ax[4][4], ay[4][4];
  tc_zero<4>(ax);
  tc_zero<4>(ay);
  for (int col0 = 0; col0 < dv; col0 += INTRA_TW) {
    tc_stage(gw, dv, dv, col0, c, INTRA_C, nullptr, ta);
    tc_stage(vb, dv, dv, col0, c, INTRA_C, nullptr, tb);
    __syncthreads();
    tc_acc<4>(ax, INTRA_C, INTRA_C, INTRA_TW, tc_rows(ta), tc_cols(tb), true);
    float x[2][4];
    tc_zero<2>(x);
    tc_acc<2>(x, INTRA_C, INTRA_TW, INTRA_C, tc_sq_t(T), tc_rows(ta), false);
    tc_each<2>(x, INTRA_C, INTRA_TW, [&](int j, int r, float y) { X[j * TC_TP + r] = y; });
    __syncthreads();
    for (int j = warp; j < c; j += warps) {
      const float dx = X[j * TC_TP + lane];
      if (col0 + lane < dv) dv_out[(long long)j * dv + col0 + lane] = bet[j] * dx;
      const float s = warp_sum(dx * tb[j * TC_TP + lane]);
      if (lane == 0) dbet[j] += s;
    }
    __syncthreads();
  }
  tc_lower_products(gkc, dk, kb, dk, dk, c, ta, tb, ay);
  // ax and ay hold the same elements in the same threads.
  tc_each<4>(ax, INTRA_C, INTRA_C, [&](int t, int j, float x) { D[t * TC_P + j] = x; });
  tc_each<4>(ay, INTRA_C, INTRA_C, [&](int t, int j, float y) {
    D[t * TC_P + j] = j < t && t < c ? bet[j] * D[t * TC_P + j] + kc_sign * ys[j] * y : 0.0f;
  });
  __syncthreads();

  // M = Tᵀ dT, then dA = M Tᵀ over dT.
  {
    float m[4][4];
    tc_zero<4>(m);
    tc_acc<4>(m, INTRA_C, INTRA_C, INTRA_C, tc_sq_t(T), tc_sq(D), false);
    tc_each<4>(m, INTRA_C, INTRA_C, [&](int t, int j, float x) { M[t * TC_P + j] = x; });
  }
  __syncthreads();
  {
    float m[4][4];
    tc_zero<4>(m);
    tc_acc<4>(m, INTRA_C, INTRA_C, INTRA_C, tc_sq(M), tc_sq_t(T), false);
    __syncthreads();
    tc_each<4>(m, INTRA_C, INTRA_C, [&](int t, int j, float x) { D[t * TC_P + j] = x; });
  }
  __syncthreads();

  // Per entry below the diagonal: dG into M, P = dA · A over dA in D; row sums of P and the
  // G term of dβ by the row's thread.
  if (tid < c) {
    const int t = tid;
    float pb = 0.0f, pg = 0.0f;
    for (int j = 0; j < INTRA_C; ++j) {
      if (j < t) {
        const float e = __expf(gam[t] - gam[j]), da = D[t * TC_P + j], g = G[t * TC_P + j];
        const float p = da * (-bet[t] * e * g);
        pb -= da * e * g;
        pg += p;
        M[t * TC_P + j] = -bet[t] * e * da;
        D[t * TC_P + j] = p;
      } else {
        M[t * TC_P + j] = 0.0f;
      }
    }
    dbet[t] += pb;
    dgam[t] += pg;
  } else if (tid < INTRA_C) {
    for (int j = 0; j < INTRA_C; ++j) M[tid * TC_P + j] = 0.0f;
  }
  __syncthreads();
  if (tid < c) {
    float s = 0.0f;
    for (int r = tid + 1; r < c; ++r) s += D[r * TC_P + tid];
    dgam[tid] -= s;
  }
  __syncthreads();

  // dK = dG K + dGᵀ K + diag(β e^γ) Tᵀ dKc, with k·dY into dβ and dγ (dY = Tᵀ dKc).
  for (int col0 = 0; col0 < dk; col0 += INTRA_TW) {
    tc_stage(gkc, dk, dk, col0, c, INTRA_C, nullptr, ta);
    tc_stage(kb, dk, dk, col0, c, INTRA_C, nullptr, tb);
    __syncthreads();
    float y[2][4], z[2][4];
    tc_zero<2>(y);
    tc_zero<2>(z);
    tc_acc<2>(y, INTRA_C, INTRA_TW, INTRA_C, tc_sq_t(T), tc_rows(ta), false);
    tc_acc<2>(z, INTRA_C, INTRA_TW, INTRA_C, tc_sq(M), tc_rows(tb), false);
    tc_acc<2>(z, INTRA_C, INTRA_TW, INTRA_C, tc_sq_t(M), tc_rows(tb), false);
    // y and z hold the same elements in the same threads.
    tc_each<2>(y, INTRA_C, INTRA_TW, [&](int j, int r, float x) { X[j * TC_TP + r] = kc_sign * x; });
    tc_each_pair<2>(z, INTRA_C, INTRA_TW, [&](int j, int r, float x, float y) {
      const float *xr = X + j * TC_TP + r;
      if (j < c) tc_store2(dk_out + (long long)j * dk + col0, r, dk - col0, ys[j] * xr[0] + x, ys[j] * xr[1] + y);
    });
    __syncthreads();
    for (int j = warp; j < c; j += warps) {
      const float s = warp_sum(X[j * TC_TP + lane] * tb[j * TC_TP + lane]);
      if (lane == 0) {
        dbet[j] += __expf(gam[j]) * s;
        dgam[j] += ys[j] * s;
      }
    }
    __syncthreads();
  }
  for (int i = tid; i < c; i += blockDim.x) {
    db_out[i] = dbet[i];
    dg_out[i] = dgam[i];
  }
}

// The chunk walk on tensor cores. Grid and block as chunk_walk_*_f32's; the state (G) and U (dU)
// tiles [rows, 32] at row stride TC_SW (≡ 8 mod 32: their fragment reads by row hit distinct
// banks), a chunk's raw keys KK [64, kks] with Kc | K at columns 0 | koff and rows past c zero,
// and its key scales e [64]. Kend = diag(e) K is never formed: e scales U's rows instead (Kendᵀ U
// = Kᵀ diag(e) U) and the backward's Kend G. So the keys are plain copies, issued as 16-byte
// asynchronous copies all at once, and each product's epilogue operands are loaded before its
// products run. Needs dk % 16 == 0 (the state's rows are the product's 16-row tiles).
#define TC_SW 40

// v[s][i] = f(row, col) at the positions tc_each visits: an epilogue's operands, loaded before
// the products so that their latency overlaps them.
template <int S, typename F> __device__ __forceinline__ void tc_fill(float v[S][4], int M, int N, F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    int m0, n0;
    if (!tc_tile(M, N, s, m0, n0)) continue;
    v[s][0] = f(m0 + g, n0 + 2 * t);
    v[s][1] = f(m0 + g, n0 + 2 * t + 1);
    v[s][2] = f(m0 + g + 8, n0 + 2 * t);
    v[s][3] = f(m0 + g + 8, n0 + 2 * t + 1);
  }
}

// f(row, col, value, other) for every element of the warp's tiles, `other` v's element there.
template <int S, typename F>
__device__ __forceinline__ void tc_each_with(float acc[S][4], float v[S][4], int M, int N, F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    int m0, n0;
    if (!tc_tile(M, N, s, m0, n0)) continue;
    f(m0 + g, n0 + 2 * t, acc[s][0], v[s][0]);
    f(m0 + g, n0 + 2 * t + 1, acc[s][1], v[s][1]);
    f(m0 + g + 8, n0 + 2 * t, acc[s][2], v[s][2]);
    f(m0 + g + 8, n0 + 2 * t + 1, acc[s][3], v[s][3]);
  }
}

// Chunk `blk`'s keys into KK and its key scales into es_out (rows c..rows zero), then wait for
// them and synchronise. `vec`: every key row is 16-byte aligned (dk % 4 == 0 and aligned bases).
__device__ __forceinline__ void tc_walk_stage(const float *kc, const float *k, const float *e, float *KK,
                                              float *es_out, long long blk, int c, int rows, int dk, int delta,
                                              int kks, bool vec) {
  const int koff = delta ? dk : 0;
  const float *kcs = kc + blk * c * dk, *ks = k + blk * c * dk, *es = e + blk * c;
  if (vec) {
    const int q = dk / 4;
    for (int i = threadIdx.x; i < rows * q; i += blockDim.x) {
      const int t = i / q, r = (i % q) * 4;
      float *dst = KK + t * kks + r;
      if (t < c) {
        if (delta) __pipeline_memcpy_async(dst, kcs + (long long)t * dk + r, 16);
        __pipeline_memcpy_async(dst + koff, ks + (long long)t * dk + r, 16);
      } else {
        if (delta) *reinterpret_cast<float4 *>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        *reinterpret_cast<float4 *>(dst + koff) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    __pipeline_commit();
  } else {
    for (int i = threadIdx.x; i < rows * dk; i += blockDim.x) {
      const int t = i / dk, r = i % dk;
      const bool in = t < c;
      if (delta) KK[t * kks + r] = in ? kcs[i] : 0.0f;
      KK[t * kks + koff + r] = in ? ks[i] : 0.0f;
    }
  }
  for (int t = threadIdx.x; t < INTRA_C; t += blockDim.x) es_out[t] = t < c ? es[t] : 0.0f;
  if (vec) __pipeline_wait_prior(0);
  __syncthreads();
}

// Whether the walk's key rows can be copied 16 bytes at a time.
__device__ __forceinline__ bool tc_walk_vec(const float *kc, const float *k, int dk, int delta) {
  return dk % 4 == 0 && ((uintptr_t)k & 15) == 0 && (!delta || ((uintptr_t)kc & 15) == 0);
}

// x[r][j] of a [rows, 32] tile at row stride TC_SW to dst[r * dv + j] for the columns below dv.
__device__ __forceinline__ void tc_walk_out(const float *x, int rows, float *dst, int dv, int col0) {
  for (int i = threadIdx.x; i < rows * WALK_TV; i += blockDim.x) {
    const int r = i / WALK_TV, j = i % WALK_TV;
    if (col0 + j < dv) dst[(long long)r * dv + col0 + j] = x[r * TC_SW + j];
  }
}

extern "C" __global__ void __launch_bounds__(256)
    chunk_walk_fwd_tc(const float *w, const float *kc, const float *k, const float *e, const float *s0,
                      const float *a, float *u_out, float *states, int n, int bh, int c, int dk, int dv, int delta) {
  extern __shared__ float wsm[];
  const int kks = (delta ? 2 * dk : dk) + 4, koff = delta ? dk : 0;
  const int cm = (c + 15) / 16 * 16, ck = (c + 7) / 8 * 8;
  float *S = wsm, *U = S + dk * TC_SW, *KK = U + INTRA_C * TC_SW, *es = KK + INTRA_C * kks;
  const int h = blockIdx.y, col0 = blockIdx.x * WALK_TV;
  const bool vec = tc_walk_vec(kc, k, dk, delta);
  for (int i = threadIdx.x; i < dk * WALK_TV; i += blockDim.x) {
    const int r = i / WALK_TV, j = i % WALK_TV;
    S[r * TC_SW + j] = col0 + j < dv ? s0[((long long)h * dk + r) * dv + col0 + j] : 0.0f;
  }
  for (int i = 0; i < n; ++i) {
    const long long blk = (long long)i * bh + h;
    const float *wi = w + blk * c * dv, *ai = a + blk * dk;
    float wv[2][4];
    tc_fill<2>(wv, cm, WALK_TV, [&](int t, int j) {
      return t < c && col0 + j < dv ? wi[(long long)t * dv + col0 + j] : 0.0f;
    });
    tc_walk_stage(kc, k, e, KK, es, blk, c, cm, dk, delta, kks, vec);
    tc_walk_out(S, dk, states + blk * dk * dv, dv, col0);
    // U = W − Kc S, kept as diag(e) U for the state's update
    float acc[2][4];
    tc_zero<2>(acc);
    if (delta) tc_acc<2>(acc, cm, WALK_TV, dk, TcView{KK, kks, 1}, TcView{S, TC_SW, 1}, false);
    float *ui = u_out + blk * c * dv;
    tc_each_with<2>(acc, wv, cm, WALK_TV, [&](int t, int j, float x, float wtj) {
      const float u = wtj - x;
      U[t * TC_SW + j] = es[t] * u;
      if (t < c && col0 + j < dv) ui[(long long)t * dv + col0 + j] = u;
    });
    float av[8][4];
    tc_fill<8>(av, dk, WALK_TV, [&](int r, int) { return ai[r]; });
    __syncthreads();
    // S ← diag(a) S + Kᵀ diag(e) U (each element read and written by the thread that holds it)
    float sacc[8][4];
    tc_zero<8>(sacc);
    tc_acc<8>(sacc, dk, WALK_TV, ck, TcView{KK + koff, 1, kks}, TcView{U, TC_SW, 1}, false);
    tc_each_with<8>(sacc, av, dk, WALK_TV,
                    [&](int r, int j, float x, float ar) { S[r * TC_SW + j] = ar * S[r * TC_SW + j] + x; });
    __syncthreads();
  }
  tc_walk_out(S, dk, states + ((long long)n * bh + h) * dk * dv, dv, col0);
}

// The backward also sums the column terms of da and de over its 32 columns, for the caller to
// add up over the tiles: da_i[r] = Σ_j S_i[r][j] G_{i+1}[r][j] and de_i[t] = Σ_j U_i[t][j] (K_i
// G_{i+1})[t][j] (= rowsum(K ∘ U Gᵀ)), from the walk's U and states (ures, sres), into da_part
// [tiles, N, BH, dk] and de_part [tiles, N, BH, c].
extern "C" __global__ void __launch_bounds__(256)
    chunk_walk_bwd_tc(const float *kc, const float *k, const float *e, const float *a, const float *gu,
                      const float *gs, float *dw, float *gend, float *ds0, int n, int bh, int c, int dk, int dv,
                      int delta, const float *ures, const float *sres, float *da_part, float *de_part) {
  extern __shared__ float wsm[];
  const int kks = (delta ? 2 * dk : dk) + 4, koff = delta ? dk : 0;
  const int cm = (c + 15) / 16 * 16, ck = (c + 7) / 8 * 8;
  float *G = wsm, *dU = G + dk * TC_SW, *KK = dU + INTRA_C * TC_SW, *es = KK + INTRA_C * kks;
  float *red = es + INTRA_C;  // [64, 4]: each row's sums over the tile's four 8-column groups
  const int h = blockIdx.y, col0 = blockIdx.x * WALK_TV;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const long long part0 = (long long)blockIdx.x * n * bh;
  const bool vec = tc_walk_vec(kc, k, dk, delta);
  for (int i = threadIdx.x; i < dk * WALK_TV; i += blockDim.x) {
    const int r = i / WALK_TV, j = i % WALK_TV;
    G[r * TC_SW + j] = col0 + j < dv ? gs[(((long long)n * bh + h) * dk + r) * dv + col0 + j] : 0.0f;
  }
  for (int i = n - 1; i >= 0; --i) {
    const long long blk = (long long)i * bh + h;
    const float *gui = gu + blk * c * dv, *ai = a + blk * dk, *gsi = gs + blk * dk * dv;
    const float *ui = ures + blk * c * dv, *si = sres + blk * dk * dv;
    float gv[2][4], uv[2][4];
    tc_fill<2>(gv, cm, WALK_TV, [&](int t, int j) {
      return t < c && col0 + j < dv ? gui[(long long)t * dv + col0 + j] : 0.0f;
    });
    tc_fill<2>(uv, cm, WALK_TV, [&](int t, int j) {
      return t < c && col0 + j < dv ? ui[(long long)t * dv + col0 + j] : 0.0f;
    });
    tc_walk_stage(kc, k, e, KK, es, blk, c, cm, dk, delta, kks, vec);
    // dU = gU + diag(e) K G
    float acc[2][4];
    tc_zero<2>(acc);
    tc_acc<2>(acc, cm, WALK_TV, dk, TcView{KK + koff, kks, 1}, TcView{G, TC_SW, 1}, false);
    // de: U ∘ (K G) summed over each fragment row's 8 columns (a quad of lanes), into red
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      int m0, n0;
      if (!tc_tile(cm, WALK_TV, s, m0, n0)) continue;
      float lo = uv[s][0] * acc[s][0] + uv[s][1] * acc[s][1], hi = uv[s][2] * acc[s][2] + uv[s][3] * acc[s][3];
      lo += __shfl_xor_sync(0xffffffffu, lo, 1);
      lo += __shfl_xor_sync(0xffffffffu, lo, 2);
      hi += __shfl_xor_sync(0xffffffffu, hi, 1);
      hi += __shfl_xor_sync(0xffffffffu, hi, 2);
      if (lane % 4 == 0) {
        red[(m0 + lane / 4) * 4 + n0 / 8] = lo;
        red[(m0 + lane / 4 + 8) * 4 + n0 / 8] = hi;
      }
    }
    tc_each_with<2>(acc, gv, cm, WALK_TV,
                    [&](int t, int j, float x, float gtj) { dU[t * TC_SW + j] = gtj + es[t] * x; });
    tc_walk_out(G, dk, gend + blk * dk * dv, dv, col0);
    // da: S_i ∘ G_{i+1} summed over the tile's columns, a row per warp at a time
    for (int r = warp; r < dk; r += warps) {
      const float x = col0 + lane < dv ? si[(long long)r * dv + col0 + lane] * G[r * TC_SW + lane] : 0.0f;
      const float sum = warp_sum(x);
      if (lane == 0) da_part[(part0 + blk) * dk + r] = sum;
    }
    // G's update: diag(a) G + gS_i, less Kcᵀ dU below
    float keep[8][4];
    tc_fill<8>(keep, dk, WALK_TV, [&](int r, int j) {
      return ai[r] * G[r * TC_SW + j] + (col0 + j < dv ? gsi[(long long)r * dv + col0 + j] : 0.0f);
    });
    __syncthreads();
    for (int t = threadIdx.x; t < c; t += blockDim.x)
      de_part[(part0 + blk) * c + t] = red[t * 4] + red[t * 4 + 1] + red[t * 4 + 2] + red[t * 4 + 3];
    tc_walk_out(dU, c, dw + blk * c * dv, dv, col0);
    // G ← diag(a) G − Kcᵀ dU + gS_i (each element read and written by the thread that holds it)
    float g[8][4];
    tc_zero<8>(g);
    if (delta) tc_acc<8>(g, dk, WALK_TV, ck, TcView{KK, 1, kks}, TcView{dU, TC_SW, 1}, false);
    tc_each_with<8>(g, keep, dk, WALK_TV, [&](int r, int j, float x, float kp) { G[r * TC_SW + j] = kp - x; });
    __syncthreads();
  }
  tc_walk_out(G, dk, ds0 + (long long)h * dk * dv, dv, col0);
}
