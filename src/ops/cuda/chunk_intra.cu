// The intra-chunk solve in float32 (src/ops/chunk_intra.rs).
#pragma once
#include "common.cuh"

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

// T = (I − A)⁻¹ for A [C, C] strictly lower triangular (C a multiple of 16), by 16 x 16 blocks
// (as fla's `solve_tril` merges its blocks): forward substitution inside the diagonal blocks (one
// thread per block column: chains of at most 15 terms, where one thread per column of the
// whole 64 x 64 ran chains of up to 2016 while the other warps of the block waited), then
// block row by block row T_ij = T_ii Σ_{j≤k<i} A_ik T_kj, each element by one thread. R_ij is
// held in T's block (j, i), above the diagonal, until T_ii multiplies it; those blocks are
// zeroed last. Every thread of the block must call it.
#define INV_B 16
template <int C> __device__ void tri_invert(const float *A, float *T, int ld) {
  const int tid = threadIdx.x;
  if (tid < C) {
    // The thread's column stays in registers through its chain (its entries above the diagonal
    // are zeros, which add nothing), where each step stored its entry to shared memory and the
    // next steps loaded it back.
    const int o = (tid / INV_B) * INV_B, col = tid % INV_B;
    float x[INV_B];
#pragma unroll
    for (int i = 0; i < INV_B; ++i) {
      float v = i == col ? 1.0f : 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) v += A[(o + i) * ld + o + j] * x[j];
      x[i] = v;
    }
#pragma unroll
    for (int i = 0; i < INV_B; ++i) T[(o + i) * ld + o + col] = x[i];
  }
  __syncthreads();
  for (int bi = 1; bi < C / INV_B; ++bi) {
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
  for (int e = tid; e < C * C; e += blockDim.x) {
    const int i = e / C, j = e % C;
    if (j / INV_B > i / INV_B) T[i * ld + j] = 0.0f;
  }
}

// tri_invert over the solve's 64 x 64 chunks.
__device__ void intra_invert(const float *A, int c, float *T, int ld = INTRA_P) {
  (void)c;  // rows c.. of A are zero, so those of T are the identity's
  tri_invert<INTRA_C>(A, T, ld);
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
