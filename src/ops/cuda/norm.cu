// RMSNorms: the gated norm and its backward, and the residual add fused with the next norm
// (src/ops/norm.rs).
#pragma once
#include "common.cuh"

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
