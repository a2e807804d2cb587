// The recurrence's inputs from the conv's output (src/ops/prep.rs): column sums of squares,
// q | k | v in float32, and the heads ops with their backward.
#pragma once
#include "common.cuh"

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
