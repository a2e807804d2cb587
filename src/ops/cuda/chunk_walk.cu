// The walk over chunks in float32 (src/ops/chunk_walk.rs).
#pragma once
#include "common.cuh"
#include "chunk_layout.cu"

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
// up to a 16-byte boundary (chunk.rs sizes the shared memory the same way).
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
