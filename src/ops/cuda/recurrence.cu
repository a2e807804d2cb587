// The sequential delta-rule / linear-attention recurrence (src/ops/delta_rule.rs).
#pragma once
#include "common.cuh"

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
// A thread holds those rows of COLS state columns, lc + m · (columns a block holds per round),
// and applies each q/k value it reads from shared memory to all of them: a step reads 2 · ROWS
// floats a thread from shared memory whatever its columns, so COLS columns read 1/COLS as much a
// column, at COLS · ROWS registers of state.
// Inputs as for `recurrence`. Staged step: q[dk] | k[dk] | gk[dk] (DECAY 2) | v[cols] | beta | g,
// padded to 4 floats.
template <int ROWS, int R, int DECAY, int COLS>
__device__ void recurrence_tiled(const float *__restrict__ q, const float *__restrict__ k,
                                 const float *__restrict__ v, const float *__restrict__ beta,
                                 const float *__restrict__ g, const float *__restrict__ gk,
                                 const float *s0, float *__restrict__ out, float *state_out, int B, int T,
                                 int H, int dv, int delta, float scale, int tc) {
  constexpr int DK = ROWS * R, CPW = 32 / R, G = ROWS / 4;
  constexpr bool GK = DECAY == 2;
  constexpr int GKB = 2 * DK, VB = GK ? 3 * DK : 2 * DK;
  extern __shared__ __align__(16) float stage[];
  const int nw = blockDim.x >> 5, round = nw * CPW, cols = round * COLS;
  const int SB = VB + cols, W = (SB + 2 + 3) & ~3;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane % R;
  const int lc = warp * CPW + lane / R;
  const int col0 = blockIdx.x * cols;
  int col[COLS];
  bool valid[COLS];
#pragma unroll
  for (int m = 0; m < COLS; m++) {
    col[m] = col0 + m * round + lc;
    valid[m] = col[m] < dv;
  }
  const int bh = blockIdx.y, b = bh / H, h = bh % H;

  float s[COLS][ROWS];
  const float *init = s0 + (int64_t)bh * DK * dv;
#pragma unroll
  for (int m = 0; m < COLS; m++)
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
      for (int c = 0; c < 4; c++)
        s[m][4 * g + c] = valid[m] ? init[(int64_t)((g * R + r) * 4 + c) * dv + col[m]] : 0.0f;

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
      const float a = DECAY >= 1 ? expf(xs[SB + 1]) : 1.0f;
      float kk[ROWS];
      // Four partial sums a column: chains of G, not ROWS.
      float p[COLS][4];
#pragma unroll
      for (int m = 0; m < COLS; m++) p[m][0] = p[m][1] = p[m][2] = p[m][3] = 0.0f;
#pragma unroll
      for (int g = 0; g < G; g++) {
        const int o = (g * R + r) * 4;
        const float4 k4 = *reinterpret_cast<const float4 *>(xs + DK + o);
        kk[4 * g] = k4.x;
        kk[4 * g + 1] = k4.y;
        kk[4 * g + 2] = k4.z;
        kk[4 * g + 3] = k4.w;
        float e[4] = {a, a, a, a};
        if (GK) {
          const float4 e4 = *reinterpret_cast<const float4 *>(xs + GKB + o);
          e[0] = a * expf(e4.x);
          e[1] = a * expf(e4.y);
          e[2] = a * expf(e4.z);
          e[3] = a * expf(e4.w);
        }
#pragma unroll
        for (int m = 0; m < COLS; m++)
#pragma unroll
          for (int c4 = 0; c4 < 4; c4++) {
            if (DECAY >= 1) s[m][4 * g + c4] *= e[c4];
            p[m][c4] = fmaf(s[m][4 * g + c4], kk[4 * g + c4], p[m][c4]);
          }
      }
      float u[COLS];
#pragma unroll
      for (int m = 0; m < COLS; m++) u[m] = (p[m][0] + p[m][1]) + (p[m][2] + p[m][3]);
#pragma unroll
      for (int off = 1; off < R; off <<= 1)
#pragma unroll
        for (int m = 0; m < COLS; m++) u[m] += __shfl_xor_sync(0xffffffffu, u[m], off);
#pragma unroll
      for (int m = 0; m < COLS; m++) {
        const float vm = xs[VB + m * round + lc];
        u[m] = delta ? beta * (vm - u[m]) : beta * vm;
        p[m][0] = p[m][1] = p[m][2] = p[m][3] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < G; g++) {
        const float4 q4 = *reinterpret_cast<const float4 *>(xs + (g * R + r) * 4);
        const float qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int m = 0; m < COLS; m++)
#pragma unroll
          for (int c4 = 0; c4 < 4; c4++) {
            s[m][4 * g + c4] = fmaf(kk[4 * g + c4], u[m], s[m][4 * g + c4]);
            p[m][c4] = fmaf(s[m][4 * g + c4], qq[c4], p[m][c4]);
          }
      }
      float acc[COLS];
#pragma unroll
      for (int m = 0; m < COLS; m++) acc[m] = (p[m][0] + p[m][1]) + (p[m][2] + p[m][3]);
#pragma unroll
      for (int off = 1; off < R; off <<= 1)
#pragma unroll
        for (int m = 0; m < COLS; m++) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
      if (r == 0) {
        float *o = out + (((int64_t)b * T + t0 + st) * H + h) * dv;
#pragma unroll
        for (int m = 0; m < COLS; m++)
          if (valid[m]) o[col[m]] = scale * acc[m];
      }
    }
    __syncthreads();  // chunk c is consumed before its buffer is refilled
  }
  float *state = state_out + (int64_t)bh * DK * dv;
#pragma unroll
  for (int m = 0; m < COLS; m++)
    if (valid[m]) {
#pragma unroll
      for (int g = 0; g < G; g++)
#pragma unroll
        for (int c = 0; c < 4; c++) state[(int64_t)((g * R + r) * 4 + c) * dv + col[m]] = s[m][4 * g + c];
    }
}

// recurrence_t{ROWS}_{R}_{DECAY}, and recurrence_t{ROWS}_{R}_{DECAY}_c2 with two columns a thread
// (recurrence.rs picks the form).
#define TILED1(ROWS, R, DECAY, COLS, SUFFIX)                                                        \
  extern "C" __global__ void __launch_bounds__(256) recurrence_t##ROWS##_##R##_##DECAY##SUFFIX(     \
      const float *q, const float *k, const float *v, const float *beta, const float *g,           \
      const float *gk, const float *s0, float *out, float *state_out, int B, int T, int H, int dv,   \
      int delta, float scale, int tc) {                                                             \
    recurrence_tiled<ROWS, R, DECAY, COLS>(q, k, v, beta, g, gk, s0, out, state_out, B, T, H, dv,   \
                                           delta, scale, tc);                                       \
  }
#define TILED_D(ROWS, R, COLS, SUFFIX) \
  TILED1(ROWS, R, 0, COLS, SUFFIX) TILED1(ROWS, R, 1, COLS, SUFFIX) TILED1(ROWS, R, 2, COLS, SUFFIX)
// Two columns a thread where R ≤ 8 (dk up to 256): wider keys are rare, and their blocks have
// few columns.
#define TILED_R(ROWS, R) TILED_D(ROWS, R, 1, )
#define TILED_RC(ROWS, R) TILED_D(ROWS, R, 1, ) TILED_D(ROWS, R, 2, _c2)
#define TILED(ROWS)                                                                                  \
  TILED_RC(ROWS, 1) TILED_RC(ROWS, 2) TILED_RC(ROWS, 4) TILED_RC(ROWS, 8) TILED_R(ROWS, 16) TILED_R(ROWS, 32)
TILED(16)
TILED(24)
TILED(32)
