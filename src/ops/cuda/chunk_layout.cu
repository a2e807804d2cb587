// The chunked form's layout both ways, and the keys' gradient joined in place
// (src/ops/chunk_layout.rs, src/ops/chunk_recurrence.rs).
#pragma once
#include "common.cuh"

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

// This lane's row and first column group (layout_vec_config in chunk.rs sizes the grid to match);
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
