// The chunk outputs in float32 (src/ops/chunk_out.rs).
#pragma once
#include "common.cuh"
#include "chunk_intra.cu"

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
