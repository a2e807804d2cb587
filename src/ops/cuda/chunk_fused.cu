// The recurrence's forward without gradients as chunks on tensor cores, in one kernel
// (src/ops/cuda/recurrence.rs launches it in place of `recurrence_tiled` for 16-bit models).
#pragma once
#include "chunk_tc.cu"

// The sequential kernel walks every token in turn on CUDA cores; the chunk kernels of training
// (the solve, the walk and the outputs) keep every chunk's state for the backward and pass their
// inputs and outputs through the chunk layout. Without a backward none of that is needed: one
// block per (sequence, head, CF_TV state columns) walks its chunks of C tokens with the state's
// columns in shared memory, and per chunk (γ the log decay summed from the chunk's start, E_tj =
// e^{γ_t − γ_j}):
//   A = −diag(β) (K Kᵀ ∘ E) strictly below the diagonal,  T = (I − A)⁻¹
//   U = T diag(β) (V − diag(e^γ) K S)            (the delta rule; plain: U = diag(β) V)
//   O = scale (diag(e^γ) Q S + (Q Kᵀ ∘ E, on and below the diagonal) U)
//   S ← e^{γ_C} S + Kᵀ diag(e^{γ_C − γ}) U
// with the products on mma.sync (TF32 operands, float32 sums), the state in float32. The [C, C]
// matrices and the solve are made again by each column tile of a head: cheaper than a pass
// through memory at the widths models have. The next chunk's queries and values are copied in
// while a chunk's solve, outputs and state update run; its keys, which the update reads last,
// at the top of its own step. Inputs as `recurrence_tiled`'s, float32 [B, T, H, ·]; outputs o
// [B, T, H, dv] and the final state [B, H, dk, dv] (which may be s0 itself: a block reads its
// columns of s0 before it writes them).
#define CF_TV 64

// Shared memory of chunk_fused_fwd<DK, C>, in floats: Q and K [C, DK + 4] (≡ 4 mod 32: fragment
// reads by rows on distinct banks), S [DK, CF_TV + 8] and two value tiles [C, CF_TV + 8] (≡ 8 mod
// 32: read by rows as B) that chunks take in turn, A, T and P [C, C + 4], then β, γ.
template <int DK, int C> struct ChunkFused {
  static constexpr int LK = DK + 4, LS = CF_TV + 8, LC = C + 4;
  static constexpr int floats = 2 * C * LK + DK * LS + 2 * C * LS + 3 * C * LC + 2 * C;
};

// dst[t, c] = src[t rs + col0 + c] for t < n and col0 + c < width, zero elsewhere up to [rows,
// cols] (dst's rows `ld` apart): tc_stage_async over the column tiles, to be waited for
// (__pipeline_wait_prior) before the barrier that publishes it.
__device__ __forceinline__ void cf_stage(float *dst, int ld, const float *src, int rs, int col0, int width, int n,
                                         int rows, int cols) {
  for (int c = 0; c < cols; c += INTRA_TW) tc_stage_async(src, rs, width, col0 + c, n, rows, dst + c, nullptr, ld);
}

// acc[s] *= f(row) for every element of the warp's tiles of an M x N product.
template <int S, typename F> __device__ __forceinline__ void tc_scale_rows(float acc[S][4], int M, int N, F f) {
  const int g = threadIdx.x % 32 / 4;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    int m0, n0;
    if (!tc_tile(M, N, s, m0, n0)) continue;
    const float a = f(m0 + g), b = f(m0 + g + 8);
    acc[s][0] *= a;
    acc[s][1] *= a;
    acc[s][2] *= b;
    acc[s][3] *= b;
  }
}

// Keys up to DK wide (a multiple of 32; narrower keys are zero-padded), chunks of C tokens (a
// multiple of 32, at most 64); 256 threads; grid (⌈dv / CF_TV⌉, B·H).
template <int DK, int C>
__device__ void chunk_fused_fwd(const float *__restrict__ q, const float *__restrict__ k,
                                const float *__restrict__ v, const float *__restrict__ beta,
                                const float *__restrict__ g, const float *s0, float *__restrict__ out,
                                float *state_out, int T, int H, int dk, int dv, int gated, int delta, float scale) {
  using Z = ChunkFused<DK, C>;
  constexpr int LK = Z::LK, LS = Z::LS, LC = Z::LC;
  // Slots a warp holds of the [C, C], [C, CF_TV] and [DK, CF_TV] products (16 x 8 tiles over 8 warps).
  constexpr int SQ = C * C / 1024, SV = C * CF_TV / 1024, SS = DK * CF_TV / 1024;
  extern __shared__ __align__(16) float fsm[];
  float *Qs = fsm, *Ks = Qs + C * LK, *S = Ks + C * LK, *V0 = S + DK * LS, *V1 = V0 + C * LS;
  float *A = V1 + C * LS, *Tm = A + C * LC, *P = Tm + C * LC, *bet = P + C * LC, *gam = bet + C;
  const TcView kr{Ks, LK, 1}, kt{Ks, 1, LK}, qr{Qs, LK, 1}, sr{S, LS, 1};
  const TcView ar{Tm, LC, 1}, pr{P, LC, 1};
  const int tid = threadIdx.x, lane = tid % 32;
  const int bh = blockIdx.y, b = bh / H, h = bh % H, v0 = blockIdx.x * CF_TV;
  const float *init = s0 + (long long)bh * dk * dv;
  for (int e = tid; e < DK * CF_TV; e += blockDim.x) {
    const int r = e / CF_TV, j = e % CF_TV;
    S[r * LS + j] = r < dk && v0 + j < dv ? init[(long long)r * dv + v0 + j] : 0.0f;
  }
  const int chunks = (T + C - 1) / C;
  // A chunk's queries and its tile of values (into `vt`).
  const auto stage_qv = [&](int ci, float *vt) {
    const int t0 = ci * C, n = min(C, T - t0);
    const long long tok0 = ((long long)b * T + t0) * H + h;
    cf_stage(Qs, LK, q + tok0 * dk, H * dk, 0, dk, n, C, DK);
    cf_stage(vt, LS, v + tok0 * dv, H * dv, v0, dv, n, C, CF_TV);
  };
  stage_qv(0, V0);
  for (int ci = 0; ci < chunks; ++ci) {
    const int t0 = ci * C, n = min(C, T - t0);
    const long long tok0 = ((long long)b * T + t0) * H + h;
    float *X = ci & 1 ? V1 : V0, *next = ci & 1 ? V0 : V1;
    const TcView xr{X, LS, 1};
    cf_stage(Ks, LK, k + tok0 * dk, H * dk, 0, dk, n, C, DK);
    __pipeline_commit();
    if (tid < 32) {
      // β, and γ as an inclusive scan of the chunk's log decays over the warp: each lane sums
      // C / 32 consecutive steps, then the lanes' totals are scanned by shuffles.
      constexpr int E = C / 32;
      float x[E], run = 0.0f;
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const int t = lane * E + i;
        bet[t] = t < n ? beta[tok0 + (long long)t * H] : 0.0f;
        run += t < n && gated ? g[tok0 + (long long)t * H] : 0.0f;
        x[i] = run;
      }
      float incl = run;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
      }
#pragma unroll
      for (int i = 0; i < E; ++i) gam[lane * E + i] = incl - run + x[i];
    }
    __pipeline_wait_prior(0);
    __syncthreads();
    const float last = gam[C - 1];  // rows past n add no decay, so this is γ at the last step
    // A (delta rule) and P from the chunk's Gram products.
    float acc[SQ][4];
    if (delta) {
      tc_zero<SQ>(acc);
      tc_acc<SQ>(acc, C, C, DK, kr, kt, true);
      tc_each<SQ>(acc, C, C, [&](int t, int j, float x) {
        A[t * LC + j] = j < t ? -bet[t] * __expf(gam[t] - gam[j]) * x : 0.0f;
      });
    }
    tc_zero<SQ>(acc);
    tc_acc<SQ>(acc, C, C, DK, qr, kt, true);
    tc_each<SQ>(acc, C, C, [&](int t, int j, float x) {
      P[t * LC + j] = j <= t ? scale * __expf(gam[t] - gam[j]) * x : 0.0f;
    });
    // X = diag(β) (V − diag(e^γ) K S), in place over V (each element by the thread whose tile
    // holds it); under the plain rule X = diag(β) V, which is U.
    float vs[SV][4];
    tc_zero<SV>(vs);
    if (delta) tc_acc<SV>(vs, C, CF_TV, DK, kr, sr, false);
    tc_each<SV>(vs, C, CF_TV,
                [&](int t, int j, float x) { X[t * LS + j] = bet[t] * (X[t * LS + j] - __expf(gam[t]) * x); });
    // The outputs' first term, held until U is known: scale e^γ Q S.
    float o[SV][4];
    tc_zero<SV>(o);
    tc_acc<SV>(o, C, CF_TV, DK, qr, sr, false);
    tc_scale_rows<SV>(o, C, CF_TV, [&](int t) { return scale * __expf(gam[t]); });
    __syncthreads();
    // The queries are read; the next chunk's come in beside this one's solve. The keys' last
    // use, the state update, takes them as diag(e^{γ_C − γ}) K.
    if (ci + 1 < chunks) stage_qv(ci + 1, next);
    __pipeline_commit();
    // Four keys a thread a step (rows LK ≡ 0 mod 4 floats apart), one exponential for the four.
    for (unsigned e = tid; e < C * DK / 4; e += blockDim.x) {
      const unsigned t = e / (DK / 4), r = e % (DK / 4) * 4;
      float4 *x = reinterpret_cast<float4 *>(Ks + t * LK + r);
      const float f = __expf(last - gam[t]);
      float4 y = *x;
      y.x *= f;
      y.y *= f;
      y.z *= f;
      y.w *= f;
      *x = y;
    }
    __syncthreads();
    if (delta) {
      tri_invert<C>(A, Tm, LC);
      __syncthreads();
      // U = T X, over X once every warp has read it.
      tc_zero<SV>(vs);
      tc_acc<SV>(vs, C, CF_TV, C, ar, xr, false);
      __syncthreads();
      tc_each<SV>(vs, C, CF_TV, [&](int t, int j, float x) { X[t * LS + j] = x; });
      __syncthreads();
    }
    // O = scale e^γ Q S + P U, stored for the chunk's steps and the tile's columns.
    tc_acc<SV>(o, C, CF_TV, C, pr, xr, false);
    tc_each_pair<SV>(o, C, CF_TV, [&](int t, int j, float x, float y) {
      if (t < n) tc_store2(out + (tok0 + (long long)t * H) * dv, v0 + j, dv, x, y);
    });
    // S ← e^{γ_C} S + (diag(e^{γ_C − γ}) K)ᵀ U: each element by the thread whose tile holds it
    // (S is read again only after the barrier below).
    float ks[SS][4];
    tc_zero<SS>(ks);
    tc_acc<SS>(ks, DK, CF_TV, C, kt, xr, false);
    const float decay = __expf(last);
    tc_each<SS>(ks, DK, CF_TV, [&](int r, int j, float x) { S[r * LS + j] = decay * S[r * LS + j] + x; });
    __syncthreads();
  }
  float *state = state_out + (long long)bh * dk * dv;
  for (int e = tid; e < DK * CF_TV; e += blockDim.x) {
    const int r = e / CF_TV, j = e % CF_TV;
    if (r < dk && v0 + j < dv) state[(long long)r * dv + v0 + j] = S[r * LS + j];
  }
}

// chunk_fused_fwd_{DK}: chunks of CF_C tokens (ops::fused_block's `CHUNKED_TOKENS`), MINB
// blocks a multiprocessor. At 32 tokens the blocks of keys up to 128 wide fit two a
// multiprocessor (at most 103 KB of shared memory), whose serial steps (the scan, the solve, the
// barriers) then overlap: on an H100 that measured 1.1-1.3x faster than one block of 64-token
// chunks. Keys 256 wide keep one (173 KB).
#define CF_C 32
#define CHUNK_FUSED(DK, MINB)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256, MINB) chunk_fused_fwd_##DK(                                    \
      const float *q, const float *k, const float *v, const float *beta, const float *g, const float *s0,       \
      float *out, float *state_out, int T, int H, int dk, int dv, int gated, int delta, float scale) {          \
    chunk_fused_fwd<DK, CF_C>(q, k, v, beta, g, s0, out, state_out, T, H, dk, dv, gated, delta, scale);       \
  }
CHUNK_FUSED(32, 2)
CHUNK_FUSED(64, 2)
CHUNK_FUSED(128, 2)
CHUNK_FUSED(256, 1)
