// RMSNorms: the gated norm and its backward, and the residual add fused with the next norm
// (src/ops/norm.rs).
#pragma once
#include "common.cuh"

// In gated_rms a row of width n is taken by g lanes of a warp (g a power of two), 32 / g rows a
// warp: g = 32 for wide rows, n / V where 16-byte packs of V elements give fewer than 32 a row
// (a head's 128-wide norm: two rows a warp, where a lane a pack left half of each warp idle).
// The host picks g (norm_lanes in norm.rs); g = 32 and element by element where n is not a
// multiple of V or an operand is not 16-byte aligned.

// The sum of x over the g lanes of a group (g a power of two), every lane of it getting it.
__device__ __forceinline__ float group_sum(float x, int g) {
  for (int off = g >> 1; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Gated RMSNorm over rows of width n: y = x / sqrt(mean(x²) + eps) · w · silu(g), in float32,
// rounded once to T (fla FusedRMSNormGated, Qwen3.5's gated norm). With `vec` (n a multiple of
// 16 bytes of T, operands 16-byte aligned) each lane takes 16 bytes at a time, in the order
// rms_bwd sums the squares in; g lanes a row.
template <typename T>
__device__ void gated_rms(const T *__restrict__ x, const T *__restrict__ gate, const float *__restrict__ w,
                          T *__restrict__ y, int rows, int n, float eps, int gated, int vec, int g) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, rpw = 32 / g;
  const int row = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw + lane / g, l = lane % g;
  // Every lane takes part in the group's shuffles; a row past the end reads nothing.
  const bool live = row < rows;
  const T *xr = x + (int64_t)row * n;
  const T *gr = gate + (int64_t)row * n;
  T *yr = y + (int64_t)row * n;
  float ss = 0.0f;
  if (live && vec) {
    for (int i = l * V; i < n; i += g * V) {
      float xv[V];
      load16(xr + i, xv);
#pragma unroll
      for (int e = 0; e < V; e++) ss += xv[e] * xv[e];
    }
  } else if (live) {
    for (int i = l; i < n; i += g) {
      const float v = to_f(xr[i]);
      ss += v * v;
    }
  }
  ss = group_sum(ss, g);
  if (!live) return;
  const float inv = rsqrtf(ss / n + eps);
  const auto one = [&](float xv, float gv, float wv) {
    return from_f<T>(xv * inv * wv * (gated ? gv / (1.0f + expf(-gv)) : 1.0f));
  };
  if (vec) {
    for (int i = l * V; i < n; i += g * V) {
      float xv[V], gv[V] = {}, wv[V];
      load16(xr + i, xv);
      if (gated) load16(gr + i, gv);
      load_floats<V>(w + i, wv);
      Pack16<T> out;
#pragma unroll
      for (int e = 0; e < V; e++) out.v[e] = one(xv[e], gv[e], wv[e]);
      *reinterpret_cast<Pack16<T> *>(yr + i) = out;
    }
  } else {
    for (int i = l; i < n; i += g) yr[i] = one(to_f(xr[i]), gated ? to_f(gr[i]) : 0.0f, w[i]);
  }
}
#define GATED_RMS(NAME, T)                                                                          \
  extern "C" __global__ void NAME(const T *x, const T *gate, const float *w, T *y, int rows, int n, \
                                  float eps, int gated, int vec, int g) {                          \
    gated_rms<T>(x, gate, w, y, rows, n, eps, gated, vec, g);                                       \
  }
GATED_RMS(gated_rms_f32, float)
GATED_RMS(gated_rms_bf16, __nv_bfloat16)
GATED_RMS(gated_rms_f16, __half)

// The backward of gated_rms (gated or not) over rows of width n <= RMS_BWD_MAX_N: with
// x^ = x r, r = (mean(x^2) + eps)^(-1/2), y = x^ w s(g), s = silu (or 1), and u = dy s(g):
// dx = r (u w - x^ mean(u w x^)), dg = dy x^ w silu'(g), dw = sum over rows of u x^. Float32
// out: dx [rows n], then dg [rows n] when gated, then partial dw [blocks * warps, n], or
// [blocks, n] where PK > 0 (the caller adds them up). One warp per row, RMS_BWD_ROWS rows per block; each warp sums dw over
// its rows into its own row of the partials, in a fixed order, so the result does not depend
// on scheduling as shared-memory atomics would. (Two 128-wide rows a warp, as gated_rms takes
// them, measured slower here: 0.39 against 0.34 ms a launch at 524,288 rows on an H100.)
#define RMS_BWD_ROWS 64
// With `vec` (n a multiple of 16 bytes of T, every operand 16-byte aligned) each lane takes 16
// bytes of a row at a time, a quarter to an eighth of the load and store instructions.
// dx and dg are written in x's dtype, dx as res + dx where `res` is given (a residual step's
// input gradient: the step's output gradient plus the norm's), so that neither is cast or
// added afterwards; `out` holds the dw partials. With PK > 0 (vec, and at most PK packs a
// lane) a lane keeps its partial dw in registers until its last row, where at PK = 0 it loads
// and stores it at every row: 16 KB of traffic a row of 2048, as much as the row's own reads
// and writes. PK is the fewest of 1, 2, 4, 8 that holds the lane's packs, and PK = 0 where a
// row has fewer packs than a warp has lanes: at 128 wide (bf16) the register path measured 0.60
// to 0.71 ms a launch on an H100 against 0.34 for PK = 0 in a kernel of its own.
#define RMS_BWD_PACKS 8
template <typename T, int PK>
__device__ void rms_bwd_rows(const T *__restrict__ x, const T *__restrict__ gate, const float *__restrict__ w,
                             const T *__restrict__ dy, const T *__restrict__ res, T *__restrict__ dxt,
                             T *__restrict__ dgt, float *__restrict__ out, int rows, int n, float eps, int gated,
                             int vec) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float *dw = out + ((int64_t)blockIdx.x * warps + warp) * n;
  const int r0 = blockIdx.x * RMS_BWD_ROWS, r1 = min(r0 + RMS_BWD_ROWS, rows);
  // The lane's first column and step: packs of V when vectorised. A lane zeroes the partial dw
  // it later adds to, so no other lane's write needs to be visible to it.
  const int i0 = vec ? lane * V : lane, step = vec ? 32 * V : 32, width = vec ? V : 1;
  float acc[PK > 0 ? PK : 1][V];
  if (PK > 0) {
#pragma unroll
    for (int k = 0; k < (PK > 0 ? PK : 1); k++)
#pragma unroll
      for (int e = 0; e < V; e++) acc[k][e] = 0.0f;
  } else {
    for (int i = i0; i < n; i += step)
      for (int e = 0; e < width; e++) dw[i + e] = 0.0f;
  }
  for (int row = r0 + warp; row < r1; row += warps) {
    const T *xr = x + (int64_t)row * n, *gr = gate + (int64_t)row * n, *dr = dy + (int64_t)row * n;
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
    // dx (and dg) at columns [i, i + width), ow the lane's partial dw there.
    auto cols = [&](int i, float *ow) {
      float xv[V], dv[V], gv[V], wv[V], ox[V], og[V];
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
      } else {
        *xt = from_f<T>(rv[0] + ox[0]);
        if (gated) *gt = from_f<T>(og[0]);
      }
    };
    if (PK > 0) {
#pragma unroll
      for (int k = 0; k < (PK > 0 ? PK : 1); k++)
        if (i0 + k * step < n) cols(i0 + k * step, acc[k]);
    } else {
      for (int i = i0; i < n; i += step) {
        float ow[V];
        if (vec) {
          load_floats<V>(dw + i, ow);
        } else {
          ow[0] = dw[i];
        }
        cols(i, ow);
        if (vec) {
          store_floats<V>(dw + i, ow);
        } else {
          dw[i] = ow[0];
        }
      }
    }
  }
  if (PK > 0) {
    // The block's warps add their partials into one row, warp by warp in order (a fixed order,
    // as the partials' own), so the caller sums a row a block, not eight: the eight took a
    // transposed copy of 33 MB at 2048 wide. Lanes touch only their own columns, so one
    // barrier a warp orders the adds.
    BLOCK_SHARED float rowsum[32 * 8 * RMS_BWD_PACKS];
    float *bw = out + (int64_t)blockIdx.x * n;
    for (int w = 0; w < warps; w++) {
      if (warp == w) {
#pragma unroll
        for (int k = 0; k < (PK > 0 ? PK : 1); k++) {
          const int i = i0 + k * step;
          if (i >= n) continue;
#pragma unroll
          for (int e = 0; e < V; e++) rowsum[i + e] = (w == 0 ? 0.0f : rowsum[i + e]) + acc[k][e];
          if (w == warps - 1) store_floats<V>(bw + i, &rowsum[i]);
        }
      }
      __syncthreads();
    }
  }
}

template <typename T>
__device__ void rms_bwd(const T *x, const T *gate, const float *w, const T *dy, const T *res, T *dxt, T *dgt,
                        float *out, int rows, int n, float eps, int gated, int vec) {
  constexpr int V = 16 / sizeof(T);
  const int packs = vec ? (n + 32 * V - 1) / (32 * V) : 0;
#define RMS_BWD_PK(PK) rms_bwd_rows<T, PK>(x, gate, w, dy, res, dxt, dgt, out, rows, n, eps, gated, vec)
  if (!vec || n < 32 * V || packs > RMS_BWD_PACKS)
    RMS_BWD_PK(0);
  else if (packs == 1)
    RMS_BWD_PK(1);
  else if (packs == 2)
    RMS_BWD_PK(2);
  else if (packs <= 4)
    RMS_BWD_PK(4);
  else
    RMS_BWD_PK(RMS_BWD_PACKS);
#undef RMS_BWD_PK
}

// Two kernels: the dispatcher (every width; the host sends it the rows the register path takes)
// and the memory path alone (every other width). Inside the dispatcher the memory path runs
// with the register path's 166 registers a thread, one block a multiprocessor: 0.60 ms a launch
// at 524,288 rows of 128 on an H100, against 0.33 as a kernel of its own (122 registers). A
// kernel of the register path alone came out at 211 registers and 0.44 ms a launch at 2048
// wide, against the dispatcher's 0.36, so the register path stays in the dispatcher.
#define RMS_BWD(SUFFIX, T)                                                                                    \
  extern "C" __global__ void rms_bwd_##SUFFIX(const T *x, const T *gate, const float *w, const T *dy,          \
                                              const T *res, T *dxt, T *dgt, float *out, int rows, int n,       \
                                              float eps, int gated, int has_res, int vec) {                    \
    rms_bwd<T>(x, gate, w, dy, has_res ? res : nullptr, dxt, dgt, out, rows, n, eps, gated, vec);             \
  }                                                                                                           \
  extern "C" __global__ void rms_bwd_mem_##SUFFIX(const T *x, const T *gate, const float *w, const T *dy,      \
                                                  const T *res, T *dxt, T *dgt, float *out, int rows, int n,   \
                                                  float eps, int gated, int has_res, int vec) {                \
    rms_bwd_rows<T, 0>(x, gate, w, dy, has_res ? res : nullptr, dxt, dgt, out, rows, n, eps, gated, vec);     \
  }
RMS_BWD(f32, float)
RMS_BWD(bf16, __nv_bfloat16)
RMS_BWD(f16, __half)

// Residual add and RMSNorm in one pass: h = a + b rounded to T (as a separate add rounds), then
// y = h / sqrt(mean(h²) + eps) · w in float32, rounded once. One block per row of width n (a
// decoding step has as few rows as sequences, so a row is spread over the whole block); the
// sum to h and the norm to y (add_rms_rows' arguments).
template <typename T>
__device__ void add_rms(const T *__restrict__ a, const T *__restrict__ b, const float *__restrict__ w,
                        T *__restrict__ h, T *__restrict__ y, int rows, int n, float eps) {
  BLOCK_SHARED float red[32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const long long o = (long long)row * n;
  T *hr = h + o, *yr = y + o;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const T s = from_f<T>(to_f(a[o + i]) + to_f(b[o + i]));
    hr[i] = s;
    ss += to_f(s) * to_f(s);
  }
  ss = block_sum(ss, red);
  const float inv = rsqrtf(ss / n + eps);
  // each thread reads back only the elements it wrote
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = from_f<T>(to_f(hr[i]) * inv * w[i]);
}

#define ADD_RMS(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *a, const T *b, const float *w, T *h, T *y, int rows, int n, \
                                  float eps) {                                                    \
    add_rms<T>(a, b, w, h, y, rows, n, eps);                                                       \
  }
ADD_RMS(add_rms_f32, float)
ADD_RMS(add_rms_bf16, __nv_bfloat16)
ADD_RMS(add_rms_f16, __half)

// add_rms over many rows: one warp per row, 16 bytes a lane (n a multiple of 16 bytes of T,
// operands 16-byte aligned), the sum to h and the norm to y, which may lie apart. The squares
// are summed in gated_rms's vectorised order, so y equals that kernel's norm of h bit for bit,
// where add_rms spreads a row over a block for the few rows of a decoding step.
template <typename T>
__device__ void add_rms_rows(const T *__restrict__ a, const T *__restrict__ b, const float *__restrict__ w,
                             T *__restrict__ h, T *__restrict__ y, int rows, int n, float eps) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t o = (int64_t)row * n;
  float ss = 0.0f;
  for (int i = lane * V; i < n; i += 32 * V) {
    float av[V], bv[V];
    load16(a + o + i, av);
    load16(b + o + i, bv);
    Pack16<T> hp;
#pragma unroll
    for (int e = 0; e < V; e++) {
      hp.v[e] = from_f<T>(av[e] + bv[e]);
      const float hv = to_f(hp.v[e]);
      ss += hv * hv;
    }
    *reinterpret_cast<Pack16<T> *>(h + o + i) = hp;
  }
  ss = warp_sum(ss);
  const float inv = rsqrtf(ss / n + eps);
  // each lane reads back only the packs it wrote
  for (int i = lane * V; i < n; i += 32 * V) {
    float hv[V], wv[V];
    load16(h + o + i, hv);
    load_floats<V>(w + i, wv);
    Pack16<T> yp;
#pragma unroll
    for (int e = 0; e < V; e++) yp.v[e] = from_f<T>(hv[e] * inv * wv[e]);
    *reinterpret_cast<Pack16<T> *>(y + o + i) = yp;
  }
}
#define ADD_RMS_ROWS(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *a, const T *b, const float *w, T *h, T *y, int rows, int n, \
                                  float eps) {                                                         \
    add_rms_rows<T>(a, b, w, h, y, rows, n, eps);                                                       \
  }
ADD_RMS_ROWS(add_rms_rows_f32, float)
ADD_RMS_ROWS(add_rms_rows_bf16, __nv_bfloat16)
ADD_RMS_ROWS(add_rms_rows_f16, __half)

// out = a + b over `packs` packs of 16 bytes of T (16-byte aligned), each sum rounded once to T
// as candle's add rounds it (a bf16 or f16 sum is exact in float32): the residual sum of a step,
// where candle's element-at-a-time add kernel ran at under half the memory bandwidth.
template <typename T>
__device__ void add_packs(const T *__restrict__ a, const T *__restrict__ b, T *__restrict__ out, int64_t packs) {
  constexpr int V = 16 / sizeof(T);
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < packs; p += (int64_t)gridDim.x * blockDim.x) {
    float av[V], bv[V];
    load16(a + p * V, av);
    load16(b + p * V, bv);
    Pack16<T> s;
#pragma unroll
    for (int e = 0; e < V; e++) s.v[e] = from_f<T>(av[e] + bv[e]);
    *reinterpret_cast<Pack16<T> *>(out + p * V) = s;
  }
}
#define ADD_PACKS(NAME, T)                                                                  \
  extern "C" __global__ void NAME(const T *a, const T *b, T *out, long long packs) {       \
    add_packs<T>(a, b, out, packs);                                                         \
  }
ADD_PACKS(add_packs_f32, float)
ADD_PACKS(add_packs_bf16, __nv_bfloat16)
ADD_PACKS(add_packs_f16, __half)
