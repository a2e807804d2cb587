// The chunk kernels on tensor cores: the `_tc` forms of the walk, the solve and the outputs.
#pragma once
#include "common.cuh"
#include "chunk_walk.cu"
#include "chunk_intra.cu"
#include "chunk_out.cu"

// ---- The chunk kernels on tensor cores (the `_tc` forms, for bf16 and f16 models) ----
// The same ops as the float32 kernels above, with their products on mma.sync m16n8k8: operands
// as TF32 (10-bit mantissa, finer than the bf16 the model's inputs were), sums and state in
// float32. The mma reads a float's top 19 bits, so the operands go in as they are, truncated:
// rounding them first (cvt.rna) cost a conversion per element, 2-5% of the kernels' time. A
// warp multiplies 16 x 8 tiles of an M x N product, S slots of them (tc_tile: a 32 x 16 block
// where the product has four a warp, else tiles warp + 8 s), accumulated in registers across
// calls (one call per staged slice of K). Operands are strided views of shared memory, so a
// transpose is a choice of strides. Staged tiles use row stride TC_TP (≡ 4 mod 32, so a warp's
// row-major fragment reads hit 32 distinct banks) and the [c, c] matrices TC_P. A tile that a
// loop reads only as B operands by rows (or A by columns) is staged at TC_TB (≡ 8 mod 32): lane
// (g, t) of such a read takes row t, column g, so at stride TC_TB the lanes fall on banks 8t + g,
// all distinct, where TC_TP's 4t + g puts two lanes on each bank.
#define TC_TP 36
#define TC_TB 40
#define TC_P 68
#define TC_WARPS 8

struct TcView {
  const float *p;
  int rs, cs;
  __device__ __forceinline__ float at(int i, int j) const { return p[i * rs + j * cs]; }
};

__device__ __forceinline__ unsigned tc_bits(float x) { return __float_as_uint(x); }

// A warp's fragments of A[m0..m0+16, k0..k0+8] and B[k0..k0+8, n0..n0+8] (g = lane / 4,
// t = lane % 4), and the product of two.
__device__ __forceinline__ void tc_frag_a(unsigned f[4], const TcView &a, int m0, int k0, int g, int t) {
  f[0] = tc_bits(a.at(m0 + g, k0 + t));
  f[1] = tc_bits(a.at(m0 + g + 8, k0 + t));
  f[2] = tc_bits(a.at(m0 + g, k0 + t + 4));
  f[3] = tc_bits(a.at(m0 + g + 8, k0 + t + 4));
}
__device__ __forceinline__ void tc_frag_b(unsigned f[2], const TcView &b, int n0, int k0, int g, int t) {
  f[0] = tc_bits(b.at(k0 + t, n0 + g));
  f[1] = tc_bits(b.at(k0 + t + 4, n0 + g));
}
__device__ __forceinline__ void tc_mma_frags(float c[4], const unsigned a[4], const unsigned b[2]) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(STATECUT_EMULATED)
  tc_mma_frags_emulated(c, a, b);  // tests/kernels: the warp's fragments exchanged on the host
#else
  __trap();
#endif
}

// c += A[m0.., k0..k0+8] B[k0..k0+8, n0..] for one 16 x 8 tile (g = lane / 4, t = lane % 4).
__device__ __forceinline__ void tc_mma(float c[4], const TcView &a, int m0, const TcView &b, int n0, int k0, int g,
                                       int t) {
#if __CUDA_ARCH__ >= 800
  unsigned fa[4], fb[2];
  tc_frag_a(fa, a, m0, k0, g, t);
  tc_frag_b(fb, b, n0, k0, g, t);
  tc_mma_frags(c, fa, fb);
#elif defined(STATECUT_EMULATED)
  tc_mma_emulated(c, a, m0, b, n0, k0, g, t);  // tests/kernels: the kernels run on the host
#else
  __trap();  // chunk.rs launches the _tc kernels only on compute capability 8.0 and above
#endif
}

// Whether an M x N product has four tiles a warp that pair up both ways, and if so the corner of
// the warp's 32 x 16 block of them. Such a warp reads two fragments of A and two of B for its
// four products a step of K, where a column of four tiles read four of A and one of B, and
// tile by tile (each tile's sum over K before the next tile's) reloaded B for each.
// The _tc kernels run 256 threads (chunk.rs), so that for products of constant shape the choice
// is made at compile time.
__device__ __forceinline__ bool tc_quad(int M, int N, int &m0, int &n0) {
  const int w = threadIdx.x / 32, tm = M / 16, tn = N / 8;
  if (tm * tn != 4 * TC_WARPS || tm % 2 != 0 || tn % 2 != 0) return false;
  m0 = w / (tn / 2) * 32;
  n0 = w % (tn / 2) * 16;
  return true;
}

// Whether an M x N product has eight tiles a warp that block four down and two across, and if so
// the corner of the warp's 64 x 16 block of them: a step of K then reads four fragments of A and
// two of B for eight products, where tile by tile each product read one of each.
__device__ __forceinline__ bool tc_oct(int M, int N, int &m0, int &n0) {
  const int w = threadIdx.x / 32, tm = M / 16, tn = N / 8;
  if (tm * tn != 8 * TC_WARPS || tm % 4 != 0 || tn % 2 != 0 || (tm / 4) * (tn / 2) != TC_WARPS) return false;
  m0 = w / (tn / 2) * 64;
  n0 = w % (tn / 2) * 16;
  return true;
}

// Whether an M x N product has two tiles a warp in one column of tiles (tiles w and w + 8 of
// tc_tile's order), and if so their rows and column: a step of K then reads B's fragment once
// for both.
__device__ __forceinline__ bool tc_pair(int M, int N, int &m0, int &m1, int &n0) {
  const int w = threadIdx.x / 32, tm = M / 16, tn = N / 8;
  if (tm * tn != 2 * TC_WARPS || TC_WARPS % tn != 0) return false;
  m0 = w / tn * 16;
  m1 = (w + TC_WARPS) / tn * 16;
  n0 = w % tn * 8;
  return true;
}

// The warp's tile in slot s of an M x N product (M % 16 == 0, N % 8 == 0), if it has one:
// slot s of the warp's block where the product has them (tc_quad), else tile warp + 8 s.
__device__ __forceinline__ bool tc_tile(int M, int N, int s, int &m0, int &n0) {
  if (tc_quad(M, N, m0, n0)) {
    if (s >= 4) return false;
    m0 += s / 2 * 16;
    n0 += s % 2 * 8;
    return true;
  }
  if (tc_oct(M, N, m0, n0)) {
    if (s >= 8) return false;
    m0 += s / 2 * 16;
    n0 += s % 2 * 8;
    return true;
  }
  const int tile = threadIdx.x / 32 + TC_WARPS * s, tn = N / 8;
  if (tile >= (M / 16) * tn) return false;
  m0 = tile / tn * 16;
  n0 = tile % tn * 8;
  return true;
}

// acc += A B over K for the warp's RM x RN tiles at rows m[i] and columns n[j] (slot i RN + j),
// a step of K at a time, each fragment read once for the tiles that share it; `lower` skips
// tiles wholly above the diagonal.
template <int RM, int RN, int S>
__device__ __forceinline__ void tc_acc_shared(float acc[S][4], const int (&m)[RM], const int (&n)[RN], int K,
                                              const TcView &a, const TcView &b, bool lower) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  bool on[RM][RN], row[RM] = {}, col[RN] = {};
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < RN; ++j) {
      on[i][j] = !lower || n[j] <= m[i] + 15;
      row[i] = row[i] || on[i][j];
      col[j] = col[j] || on[i][j];
    }
  // Two steps of K in flight: the next step's fragment loads overlap this step's products.
#pragma unroll 2
  for (int k0 = 0; k0 < K; k0 += 8) {
    unsigned fa[RM][4], fb[RN][2];
#pragma unroll
    for (int i = 0; i < RM; ++i)
      if (row[i]) tc_frag_a(fa[i], a, m[i], k0, g, t);
#pragma unroll
    for (int j = 0; j < RN; ++j)
      if (col[j]) tc_frag_b(fb[j], b, n[j], k0, g, t);
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j)
        if (on[i][j]) tc_mma_frags(acc[i * RN + j], fa[i], fb[j]);
  }
}

// acc += A B over K (K % 8 == 0) on the warp's tiles; `lower` skips tiles wholly above the
// diagonal, which stay as they are (zero for products that are causal). Each tile sums over K
// in the same order whether its warp's tiles share fragments (a block or a pair) or not.
template <int S>
__device__ __forceinline__ void tc_acc(float acc[S][4], int M, int N, int K, TcView a, TcView b, bool lower) {
  int q0, q1, p0;
  if (S >= 4 && tc_quad(M, N, q0, p0))
    return tc_acc_shared<2, 2, S>(acc, {q0, q0 + 16}, {p0, p0 + 8}, K, a, b, lower);
  if (S >= 8 && tc_oct(M, N, q0, p0))
    return tc_acc_shared<4, 2, S>(acc, {q0, q0 + 16, q0 + 32, q0 + 48}, {p0, p0 + 8}, K, a, b, lower);
  if (S >= 2 && tc_pair(M, N, q0, q1, p0)) return tc_acc_shared<2, 1, S>(acc, {q0, q1}, {p0}, K, a, b, lower);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    int m0, n0;
    if (!tc_tile(M, N, s, m0, n0) || (lower && n0 > m0 + 15)) continue;
    for (int k0 = 0; k0 < K; k0 += 8) tc_mma(acc[s], a, m0, b, n0, k0, g, t);
  }
}

// acc0 += A0 B0 and acc1 += A1 B1, two products of one M x N shape over K, in one loop where
// the warp's two tiles of each pair up (tc_pair): the four mma chains then overlap, where two
// tc_acc calls ran one product's after the other's. Each tile sums over K in tc_acc's order, so
// the results are those of the two calls, which it makes where the tiles do not pair up.
template <int S>
__device__ __forceinline__ void tc_acc_both(float acc0[S][4], TcView a0, TcView b0, float acc1[S][4], TcView a1,
                                            TcView b1, int M, int N, int K) {
  int m0, m1, n0;
  if (S != 2 || !tc_pair(M, N, m0, m1, n0)) {
    tc_acc<S>(acc0, M, N, K, a0, b0, false);
    tc_acc<S>(acc1, M, N, K, a1, b1, false);
    return;
  }
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll 2
  for (int k0 = 0; k0 < K; k0 += 8) {
    unsigned f0[4], f1[4], h0[2], f2[4], f3[4], h1[2];
    tc_frag_a(f0, a0, m0, k0, g, t);
    tc_frag_a(f1, a0, m1, k0, g, t);
    tc_frag_b(h0, b0, n0, k0, g, t);
    tc_frag_a(f2, a1, m0, k0, g, t);
    tc_frag_a(f3, a1, m1, k0, g, t);
    tc_frag_b(h1, b1, n0, k0, g, t);
    tc_mma_frags(acc0[0], f0, h0);
    tc_mma_frags(acc0[1], f1, h0);
    tc_mma_frags(acc1[0], f2, h1);
    tc_mma_frags(acc1[1], f3, h1);
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

// Whether a tile's rows are 16-byte aligned, so that it is staged four columns a load (tc_stage)
// or by 16-byte asynchronous copies (tc_stage_async).
__device__ __forceinline__ bool tc_async(const float *src, int ld, int width, int col0) {
  return ((ld | width | col0) & 3) == 0 && ((uintptr_t)src & 15) == 0;
}

// chunk_stage at row stride tp (TC_TP unless given), four columns a load where tc_async.
__device__ __forceinline__ void tc_stage(const float *src, int ld, int width, int col0, int valid, int rows,
                                         const float *scale, float *tile, int tp = TC_TP) {
  if (tc_async(src, ld, width, col0)) {
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
      *reinterpret_cast<float4 *>(tile + t * tp + r) = x;
    }
    return;
  }
  chunk_stage(src, ld, width, col0, valid, rows, scale, tile, tp);
}

// tc_stage by 16-byte asynchronous copies (zero rows and columns as plain stores) where
// tc_async, to be waited for (__pipeline_wait_prior) and, if scaled, landed (tc_land) before the
// barrier that publishes the tile; otherwise tc_stage itself, done on return.
__device__ __forceinline__ void tc_stage_async(const float *src, int ld, int width, int col0, int valid, int rows,
                                               float *tile, const float *scale = nullptr, int tp = TC_TP) {
  if (!tc_async(src, ld, width, col0)) return chunk_stage(src, ld, width, col0, valid, rows, scale, tile, tp);
  for (int e = threadIdx.x; e < rows * (INTRA_TW / 4); e += blockDim.x) {
    const int t = e / (INTRA_TW / 4), r = e % (INTRA_TW / 4) * 4;
    float *dst = tile + t * tp + r;
    if (t < valid && col0 + r < width)
      __pipeline_memcpy_async(dst, src + (long long)t * ld + col0 + r, 16);
    else
      *reinterpret_cast<float4 *>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// A scaled tc_stage_async's rows times their scale, once its copies have landed: each thread
// scales the elements it copied, so no barrier comes between.
__device__ __forceinline__ void tc_land(const float *src, int ld, int width, int col0, int valid, int rows,
                                        float *tile, const float *scale, int tp = TC_TP) {
  if (!scale || !tc_async(src, ld, width, col0)) return;
  for (int e = threadIdx.x; e < rows * (INTRA_TW / 4); e += blockDim.x) {
    const int t = e / (INTRA_TW / 4), r = e % (INTRA_TW / 4) * 4;
    if (t < valid && col0 + r < width) {
      float4 *x = reinterpret_cast<float4 *>(tile + t * tp + r);
      const float f = scale[t];
      *x = make_float4(x->x * f, x->y * f, x->z * f, x->w * f);
    }
  }
}

// body(i, b) for i < n, after stage(i, b) has filled buffer b = i % 2 of its tiles (with
// tc_stage_async), its copies have landed (land(i, b), for scaled tiles) and a barrier has
// published them: step i + 1's copies are issued before step i's body, so that their loads
// overlap its products, where staging in the loop left every warp waiting on them. A barrier
// after each body keeps a buffer from being staged again while read.
template <typename Stage, typename Land, typename Body>
__device__ __forceinline__ void tc_pipeline(int n, Stage stage, Land land, Body body) {
  if (n <= 0) return;
  stage(0, 0);
  __pipeline_commit();
  for (int i = 0; i < n; ++i) {
    if (i + 1 < n) {
      stage(i + 1, (i + 1) & 1);
      __pipeline_commit();
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    land(i, i & 1);
    __syncthreads();
    body(i, i & 1);
    __syncthreads();
  }
}

// tc_pipeline of unscaled tiles.
template <typename Stage, typename Body>
__device__ __forceinline__ void tc_pipeline(int n, Stage stage, Body body) {
  tc_pipeline(n, stage, [](int, int) {}, body);
}

// Row-major [rows, TC_TP] and [c, c] views, and their transposes.
__device__ __forceinline__ TcView tc_rows(const float *p) { return TcView{p, TC_TP, 1}; }
__device__ __forceinline__ TcView tc_cols(const float *p) { return TcView{p, 1, TC_TP}; }
__device__ __forceinline__ TcView tc_sq(const float *p) { return TcView{p, TC_P, 1}; }
__device__ __forceinline__ TcView tc_sq_t(const float *p) { return TcView{p, 1, TC_P}; }
// Row-major [rows, TC_TB] views, and their transposes.
__device__ __forceinline__ TcView tc_rows_b(const float *p) { return TcView{p, TC_TB, 1}; }
__device__ __forceinline__ TcView tc_cols_b(const float *p) { return TcView{p, 1, TC_TB}; }

// A [64, TC_P] matrix transposed in place, between barriers, for a kernel whose products read it
// transposed as their A operand: those fragment reads then go row by row, one bank a lane, where
// a transposed view's (stride ≡ 4 mod 32) hit each bank twice. A warp swaps 8 x 4 blocks, its
// lanes down a block's rows first, so that its loads and stores of either side of the swaps hit
// each bank at most twice.
__device__ __forceinline__ void tc_transpose_sq(float *x) {
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int b = threadIdx.x / 32; b < (INTRA_C / 8) * (INTRA_C / 4); b += blockDim.x / 32) {
    const int r = b / (INTRA_C / 4) * 8 + lane % 8, col = b % (INTRA_C / 4) * 4 + lane / 8;
    if (col > r) {
      const float y = x[r * TC_P + col];
      x[r * TC_P + col] = x[col * TC_P + r];
      x[col * TC_P + r] = y;
    }
  }
  __syncthreads();
}

// acc (64 x 64, S = 4) += A Bᵀ below and on the diagonal for A, B [c, width] (row strides lda,
// ldb), staged 32 columns at a time through the pairs ta, tb and ta1, tb1 in turn, the stages
// overlapping the products (tc_pipeline); a Gram matrix (B = A) stages A once, through ta and
// ta1 (tb and tb1 unused).
__device__ void tc_lower_products(const float *a, int lda, const float *b, int ldb, int width, int c, float *ta,
                                  float *tb, float acc[4][4], float *ta1, float *tb1 = nullptr) {
  const bool gram = a == b && lda == ldb;
  // Selected, not indexed: an indexed pair of pointers would live in local memory.
  const auto tas = [&](int s) { return s ? ta1 : ta; };
  const auto tbs = [&](int s) { return gram ? tas(s) : s ? tb1 : tb; };
  tc_pipeline(
      (width + INTRA_TW - 1) / INTRA_TW,
      [&](int i, int s) {
        tc_stage_async(a, lda, width, i * INTRA_TW, c, INTRA_C, tas(s));
        if (!gram) tc_stage_async(b, ldb, width, i * INTRA_TW, c, INTRA_C, tbs(s));
      },
      [&](int, int s) { tc_acc<4>(acc, INTRA_C, INTRA_C, INTRA_TW, tc_rows(tas(s)), tc_cols(tbs(s)), true); });
}

// P = scale (Q Kᵀ) ∘ D (zero above the diagonal and past c) into P [64, TC_P], staged through
// the pairs ta, tb and ta1, tb1.
__device__ void tc_out_scores(const float *qk, int c, int dk, float scale, const float *gam, float *ta, float *tb,
                              float *P, float *ta1, float *tb1) {
  float acc[4][4];
  tc_zero<4>(acc);
  tc_lower_products(qk, 2 * dk, qk + dk, 2 * dk, dk, c, ta, tb, acc, ta1, tb1);
  tc_each<4>(acc, INTRA_C, INTRA_C, [&](int t, int j, float x) {
    P[t * TC_P + j] = j <= t && t < c ? scale * x * __expf(gam[t] - gam[j]) : 0.0f;
  });
}

// chunk_out_fwd_f32 on tensor cores; shared memory P [64, TC_P], two pairs of tiles (Q̂'s [64,
// TC_TP] and S's or U's [64, TC_TB], read by rows as B), γ and scale·e^γ. Every tile goes through
// one tc_pipeline: for each column tile of the output, a step per key tile (Q̂ = diag(scale e^γ)
// Q's columns and S's rows there), then one for U's columns, whose step multiplies by P and
// stores the tile. Four blocks a multiprocessor: with one pair of tiles and synchronous stages it
// held six, and its warps waited on every stage.
extern "C" __global__ void __launch_bounds__(256, 4)
    chunk_out_fwd_tc(const float *qk, const float *walked, const float *gamma, float *out, long long blocks, int c,
                     int dk, int dv, float scale) {
  extern __shared__ float osm[];
  const int TL = INTRA_C * TC_TP, TB = INTRA_C * TC_TB;
  float *P = osm, *ta = P + INTRA_C * TC_P, *ta1 = ta + TL, *tb = ta1 + TL, *tb1 = tb + TB;
  float *gam = tb1 + TB, *qs = gam + INTRA_C;
  const auto tas = [&](int b) { return b ? ta1 : ta; };
  const auto tbs = [&](int b) { return b ? tb1 : tb; };
  const long long blk = blockIdx.x;
  const float *q = qk + blk * c * 2 * dk, *u = walked + blk * c * dv, *S = walked + blocks * c * dv + blk * dk * dv;
  float *o = out + blk * c * dv;
  for (int i = threadIdx.x; i < INTRA_C; i += blockDim.x) {
    gam[i] = i < c ? gamma[blk * c + i] : 0.0f;
    qs[i] = scale * __expf(gam[i]);
  }
  __syncthreads();
  tc_out_scores(q, c, dk, scale, gam, ta, tb, P, ta1, tb1);
  __syncthreads();
  // Step i: column tile i / (nk + 1); key tile i % (nk + 1), or U's tile where that is nk.
  const int nk = (dk + INTRA_TW - 1) / INTRA_TW, per = nk + 1;
  const auto col0 = [&](int i) { return i / per * INTRA_TW; };
  const auto key0 = [&](int i) { return i % per * INTRA_TW; };
  float acc[2][4];
  tc_zero<2>(acc);
  tc_pipeline(
      (dv + INTRA_TW - 1) / INTRA_TW * per,
      [&](int i, int b) {
        const int r0 = key0(i);
        if (r0 < dk) {
          tc_stage_async(q, 2 * dk, dk, r0, c, INTRA_C, tas(b), qs);
          tc_stage_async(S + (long long)r0 * dv, dv, dv, col0(i), dk - r0, INTRA_TW, tbs(b), nullptr, TC_TB);
        } else {
          tc_stage_async(u, dv, dv, col0(i), c, INTRA_C, tbs(b), nullptr, TC_TB);
        }
      },
      [&](int i, int b) {
        if (key0(i) < dk) tc_land(q, 2 * dk, dk, key0(i), c, INTRA_C, tas(b), qs);
      },
      [&](int i, int b) {
        if (key0(i) < dk) {
          // diag(scale e^γ) Q S over key tiles
          tc_acc<2>(acc, INTRA_C, INTRA_TW, INTRA_TW, tc_rows(tas(b)), tc_rows_b(tbs(b)), false);
          return;
        }
        tc_acc<2>(acc, INTRA_C, INTRA_TW, INTRA_C, tc_sq(P), tc_rows_b(tbs(b)), false);
        const int c0 = col0(i);
        tc_each_pair<2>(acc, INTRA_C, INTRA_TW, [&](int t, int j, float x, float y) {
          if (t < c) tc_store2(o + (long long)t * dv, c0 + j, dv, x, y);
        });
        tc_zero<2>(acc);
      });
}

// chunk_out_bwd_f32 on tensor cores; shared memory P and E ∘ D [64, TC_P], two pairs of tiles
// [64, TC_TB] (the loops that stage unscaled tiles alternate between them: tc_pipeline; at row
// stride TC_TB in the loops that read them only by rows as B, else TC_TP), γ,
// scale·e^γ and dγ. Until E ∘ D is made, its space holds Q̂ = diag(scale e^γ) Q's first 64 key
// columns, so that dS's first 64 rows come from each tile of dO as it is staged for E and dU
// (the rows past 64 stage their own tiles of Q̂ and dO).
extern "C" __global__ void __launch_bounds__(256, 3)
    chunk_out_bwd_tc(const float *qk, const float *walked, const float *gamma, const float *grad, float *dqk_out,
                     float *out, long long blocks, long long walked_len, int c, int dk, int dv, float scale) {
  extern __shared__ float osm[];
  const int SQ = INTRA_C * TC_P, TB = INTRA_C * TC_TB;
  float *P = osm, *ED = P + SQ, *ta = ED + SQ, *tb = ta + TB, *ta1 = tb + TB, *tb1 = ta1 + TB;
  float *gam = tb1 + TB, *qs = gam + INTRA_C, *dg = qs + INTRA_C;
  const auto tas = [&](int b) { return b ? ta1 : ta; };
  const auto tbs = [&](int b) { return b ? tb1 : tb; };
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
  tc_out_scores(q, c, dk, scale, gam, ta, tb, P, ta1, tb1);
  tc_transpose_sq(P);  // P holds Pᵀ from here, and F (below) Fᵀ

  // E = dO Uᵀ, and on the way dU = Pᵀ dO and dS = Q̂ᵀ dO for the first 64 keys (Q̂ in ED, staged
  // while the first tiles of dO and U are in flight).
  float e[4][4];
  tc_zero<4>(e);
  tc_pipeline(
      (dv + INTRA_TW - 1) / INTRA_TW,
      [&](int i, int b) {
        tc_stage_async(go, dv, dv, i * INTRA_TW, c, INTRA_C, tas(b));
        tc_stage_async(u, dv, dv, i * INTRA_TW, c, INTRA_C, tbs(b));
        if (i == 0) {
          tc_stage(q, 2 * dk, dk, 0, c, INTRA_C, qs, ED, TC_P);
          tc_stage(q, 2 * dk, dk, INTRA_TW, c, INTRA_C, qs, ED + INTRA_TW, TC_P);
        }
      },
      [&](int i, int b) {
        const int col0 = i * INTRA_TW;
        tc_acc<4>(e, INTRA_C, INTRA_C, INTRA_TW, tc_rows(tas(b)), tc_cols(tbs(b)), true);
        float x[2][4], y[2][4];
        tc_zero<2>(x);
        tc_zero<2>(y);
        tc_acc_both<2>(x, tc_sq(P), tc_rows(tas(b)), y, tc_sq_t(ED), tc_rows(tas(b)), INTRA_C, INTRA_TW, INTRA_C);
        tc_each_pair<2>(x, INTRA_C, INTRA_TW, [&](int j, int col, float v, float w) {
          if (j < c) tc_store2(du + (long long)j * dv, col0 + col, dv, v, w);
        });
        tc_each_pair<2>(y, INTRA_C, INTRA_TW, [&](int r, int col, float v, float w) {
          if (r < dk) tc_store2(ds + (long long)r * dv, col0 + col, dv, v, w);
        });
      });
  // ED = E ∘ D; F = E ∘ P over P, both transposed there (strictly below the diagonal: the
  // diagonal's terms cancel). Each element is read and written by the thread that holds it.
  tc_each<4>(e, INTRA_C, INTRA_C, [&](int t, int j, float x) {
    const bool in = j <= t && t < c;
    ED[t * TC_P + j] = in ? x * __expf(gam[t] - gam[j]) : 0.0f;
    P[j * TC_P + t] = in && j < t ? x * P[j * TC_P + t] : 0.0f;
  });
  __syncthreads();
  // dγ: F's row sums less its column sums, a quad of lanes a row (and column), each taking every
  // fourth entry, joined by shuffles, where a thread a row kept six warps of eight waiting.
  for (int i = tid; i < 4 * INTRA_C; i += blockDim.x) {
    const int t = i / 4;
    float x = 0.0f;
    for (int j = i % 4; j < t; j += 4) x += P[j * TC_P + t];
    for (int r = t + 1 + i % 4; r < c; r += 4) x -= P[t * TC_P + r];
    x = quad_sum(x);
    if (i % 4 == 0 && t < c) dg[t] += x;
  }
  __syncthreads();

  // dS = Q̂ᵀ dO for the keys past 64, by key tile and column tile (32 x 32: one tile a warp).
  const int ncol = (dv + INTRA_TW - 1) / INTRA_TW;
  const auto key0 = [&](int i) { return 2 * INTRA_TW + i / ncol * INTRA_TW; };
  const auto col0 = [&](int i) { return i % ncol * INTRA_TW; };
  tc_pipeline(
      max(0, (dk - 2 * INTRA_TW + INTRA_TW - 1) / INTRA_TW) * ncol,
      [&](int i, int b) {
        tc_stage_async(q, 2 * dk, dk, key0(i), c, INTRA_C, tas(b), qs, TC_TB);
        tc_stage_async(go, dv, dv, col0(i), c, INTRA_C, tbs(b), nullptr, TC_TB);
      },
      [&](int i, int b) { tc_land(q, 2 * dk, dk, key0(i), c, INTRA_C, tas(b), qs, TC_TB); },
      [&](int i, int b) {
        const int r0 = key0(i), c0 = col0(i);
        float x[1][4];
        tc_zero<1>(x);
        tc_acc<1>(x, INTRA_TW, INTRA_TW, INTRA_C, tc_cols_b(tas(b)), tc_rows_b(tbs(b)), false);
        tc_each_pair<1>(x, INTRA_TW, INTRA_TW, [&](int r, int col, float v, float w) {
          if (r0 + r < dk) tc_store2(ds + (long long)(r0 + r) * dv, c0 + col, dv, v, w);
        });
      });

  // By blocks of 64 keys: X = diag(e^γ) dO Sᵀ over every column tile of dO, into P's space (free
  // since dγ took F's sums); then by key tile, dQ̃ = X + ED K, dK = EDᵀ Q̃, and e^γ q̃·(dO Sᵀ) into
  // dγ. Each tile of dO is staged once a block of keys, where a key tile at a time staged it twice.
  for (int b0 = 0; b0 < dk; b0 += INTRA_C) {
    float x[4][4];
    tc_zero<4>(x);
    tc_pipeline(
        (dv + INTRA_TW - 1) / INTRA_TW,
        [&](int i, int b) {
          tc_stage_async(go, dv, dv, i * INTRA_TW, c, INTRA_C, tas(b));
          tc_stage_async(S + (long long)b0 * dv, dv, dv, i * INTRA_TW, dk - b0, INTRA_C, tbs(b));
        },
        [&](int, int b) { tc_acc<4>(x, INTRA_C, INTRA_C, INTRA_TW, tc_rows(tas(b)), tc_cols(tbs(b)), false); });
    tc_each<4>(x, INTRA_C, INTRA_C, [&](int t, int r, float v) { P[t * TC_P + r] = __expf(gam[t]) * v; });
    tc_pipeline(
        (min(dk, b0 + INTRA_C) - b0 + INTRA_TW - 1) / INTRA_TW,
        [&](int i, int b) {
          tc_stage_async(q + dk, 2 * dk, dk, b0 + i * INTRA_TW, c, INTRA_C, tas(b), nullptr, TC_TB);
          tc_stage_async(q, 2 * dk, dk, b0 + i * INTRA_TW, c, INTRA_C, tbs(b), nullptr, TC_TB);
        },
        [&](int i, int b) {
          const int r0 = b0 + i * INTRA_TW;
          const float *X = P + (r0 - b0), *ka = tas(b), *qa = tbs(b);
          warp_row_sums(
              warp, c, blockDim.x / 32, [&](int t) { return X[t * TC_P + lane] * qa[t * TC_TB + lane]; },
              [&](int t, float s) {
                if (lane == 0) dg[t] += scale * s;
              });
          float y[2][4], z[2][4];
          tc_zero<2>(y);
          tc_zero<2>(z);
          tc_acc_both<2>(y, tc_sq(ED), tc_rows_b(ka), z, tc_sq_t(ED), tc_rows_b(qa), INTRA_C, INTRA_TW, INTRA_C);
          tc_each_pair<2>(y, INTRA_C, INTRA_TW, [&](int t, int r, float v, float w) {
            const float *xr = X + t * TC_P + r;
            if (t < c)
              tc_store2(dqk + (long long)t * 2 * dk + r0, r, dk - r0, scale * (xr[0] + v), scale * (xr[1] + w));
          });
          tc_each_pair<2>(z, INTRA_C, INTRA_TW, [&](int t, int r, float v, float w) {
            if (t < c) tc_store2(dqk + (long long)t * 2 * dk + dk + r0, r, dk - r0, scale * v, scale * w);
          });
        });
  }
  for (int i = tid; i < c; i += blockDim.x) dgo[i] = dg[i];
}

// out = T · diag(scale) src over every column, tile by tile (intra_apply on tensor cores), the
// tiles alternating between tile and tile1 (tc_pipeline).
__device__ void tc_intra_apply(const float *T, const float *src, int width, int c, const float *scale, float *tile,
                               float *tile1, float *out) {
  const auto tiles = [&](int b) { return b ? tile1 : tile; };
  tc_pipeline(
      (width + INTRA_TW - 1) / INTRA_TW,
      [&](int i, int b) { tc_stage_async(src, width, width, i * INTRA_TW, c, INTRA_C, tiles(b), scale, TC_TB); },
      [&](int i, int b) { tc_land(src, width, width, i * INTRA_TW, c, INTRA_C, tiles(b), scale, TC_TB); },
      [&](int i, int b) {
        const int col0 = i * INTRA_TW;
        float acc[2][4];
        tc_zero<2>(acc);
        tc_acc<2>(acc, INTRA_C, INTRA_TW, INTRA_C, tc_sq(T), tc_rows_b(tiles(b)), false);
        tc_each_pair<2>(acc, INTRA_C, INTRA_TW, [&](int t, int j, float x, float y) {
          if (t < c) tc_store2(out + (long long)t * width, col0 + j, width, x, y);
        });
      });
}

// A = −β_t e^{γ_t − γ_j} (K Kᵀ)_tj below the diagonal into A [64, TC_P] (zero elsewhere); the
// Gram matrix itself into G when given. K's tiles alternate between ta and ta1, which may be
// A's or G's space (written after the last product).
__device__ void tc_intra_system(const float *k, int c, int dk, const float *bet, const float *gam, float *ta,
                                float *ta1, float *A, float *G) {
  float acc[4][4];
  tc_zero<4>(acc);
  tc_lower_products(k, dk, k, dk, dk, c, ta, nullptr, acc, ta1);
  tc_each<4>(acc, INTRA_C, INTRA_C, [&](int t, int j, float x) {
    if (G) G[t * TC_P + j] = x;
    A[t * TC_P + j] = j < t && t < c ? -bet[t] * __expf(gam[t] - gam[j]) * x : 0.0f;
  });
}

// chunk_intra_fwd_f32 on tensor cores; shared memory A and T [64, TC_P], two tiles [64, TC_TB]
// (at row stride TC_TP for the Gram products, TC_TB for T's, which read them by rows as B), β, γ,
// β e^γ.
extern "C" __global__ void __launch_bounds__(256)
    chunk_intra_fwd_tc(const float *k, const float *v, const float *scal, float *w_out, float *kc_out,
                       long long blocks, int c, int dk, int dv) {
  extern __shared__ float ism[];
  const int SQ = INTRA_C * TC_P, TB = INTRA_C * TC_TB;
  float *A = ism, *T = A + SQ, *ta = T + SQ, *tb = ta + TB;
  float *bet = tb + TB, *gam = bet + INTRA_C, *ys = gam + INTRA_C;
  const long long blk = blockIdx.x;
  const float *kb = k + blk * c * dk, *vb = v + blk * c * dv;
  for (int i = threadIdx.x; i < INTRA_C; i += blockDim.x) {
    bet[i] = i < c ? scal[blk * c + i] : 0.0f;
    gam[i] = i < c ? scal[(blocks + blk) * c + i] : 0.0f;
    ys[i] = bet[i] * __expf(gam[i]);
  }
  __syncthreads();
  tc_intra_system(kb, c, dk, bet, gam, ta, T, A, nullptr);
  __syncthreads();
  intra_invert(A, c, T, TC_P);
  __syncthreads();
  tc_intra_apply(T, vb, dv, c, bet, ta, tb, w_out + blk * c * dv);
  tc_intra_apply(T, kb, dk, c, ys, ta, tb, kc_out + blk * c * dk);
}

// chunk_intra_bwd_f32 on tensor cores; shared memory T, M, D [64, TC_P] (D with room for two
// tiles after it), two tiles and five per-token scalars: 75 KB, so that three blocks fit a
// multiprocessor (four [64, TC_P] matrices and three tiles took 96 KB, two blocks). The second
// tile of each pair is [64, TC_TB], for the loop over dK that reads K's tiles only by rows as B. A is
// made in D and inverted from there; the Gram matrix G lives in M until its entries become dG
// there, each in the thread that reads it; the two [64, 64] products between go through
// registers. While D holds nothing (before A, between A's inverse and dT, after dA's sums), the
// loops that stage tiles alternate between ta, tb and a second pair in D's space (tc_pipeline);
// X, the tiles' per-row results, takes the current first tile's place once the products that
// read it are done.
extern "C" __global__ void __launch_bounds__(256, 3)
    chunk_intra_bwd_tc(const float *k, const float *v, const float *scal, const float *grad_w,
                       const float *grad_kc, float *out, long long blocks, int c, int dk, int dv, float kc_sign) {
  extern __shared__ float ism[];
  const int SQ = INTRA_C * TC_P, TL = INTRA_C * TC_TP, TB = INTRA_C * TC_TB;
  float *T = ism, *M = T + SQ, *G = M, *D = M + SQ, *ta = D + TL + TB, *tb = ta + TL;
  const auto tas = [&](int b) { return b ? D : ta; };
  const auto tbs = [&](int b) { return b ? D + TL : tb; };
  float *bet = tb + TB, *gam = bet + INTRA_C, *ys = gam + INTRA_C, *dbet = ys + INTRA_C, *dgam = dbet + INTRA_C;
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
  tc_intra_system(kb, c, dk, bet, gam, ta, D, D, G);
  __syncthreads();
  intra_invert(D, c, T, TC_P);
  tc_transpose_sq(T);  // T holds Tᵀ from here

  // dT = dW (βV)ᵀ + dKc (β e^γ K)ᵀ, with dX = Tᵀ dW (→ dV, and v·dX into dβ) on the way.
  float ax[4][4], ay[4][4];
  tc_zero<4>(ax);
  tc_zero<4>(ay);
  tc_pipeline(
      (dv + INTRA_TW - 1) / INTRA_TW,
      [&](int i, int b) {
        tc_stage_async(gw, dv, dv, i * INTRA_TW, c, INTRA_C, tas(b));
        tc_stage_async(vb, dv, dv, i * INTRA_TW, c, INTRA_C, tbs(b));
      },
      [&](int i, int b) {
        const int col0 = i * INTRA_TW;
        float *X = tas(b);
        tc_acc<4>(ax, INTRA_C, INTRA_C, INTRA_TW, tc_rows(X), tc_cols(tbs(b)), true);
        float x[2][4];
        tc_zero<2>(x);
        tc_acc<2>(x, INTRA_C, INTRA_TW, INTRA_C, tc_sq(T), tc_rows(X), false);
        __syncthreads();  // X takes the first tile's place
        tc_each<2>(x, INTRA_C, INTRA_TW, [&](int j, int r, float y) { X[j * TC_TP + r] = y; });
        __syncthreads();
        warp_row_sums(
            warp, c, warps,
            [&](int j) {
              const float dx = X[j * TC_TP + lane];
              if (col0 + lane < dv) dv_out[(long long)j * dv + col0 + lane] = bet[j] * dx;
              return dx * tbs(b)[j * TC_TP + lane];
            },
            [&](int j, float s) {
              if (lane == 0) dbet[j] += s;
            });
      });
  tc_lower_products(gkc, dk, kb, dk, dk, c, ta, tb, ay, D, D + TL);
  // ax and ay hold the same elements in the same threads.
  tc_each<4>(ax, INTRA_C, INTRA_C, [&](int t, int j, float x) { D[t * TC_P + j] = x; });
  tc_each<4>(ay, INTRA_C, INTRA_C, [&](int t, int j, float y) {
    D[t * TC_P + j] = j < t && t < c ? bet[j] * D[t * TC_P + j] + kc_sign * ys[j] * y : 0.0f;
  });
  __syncthreads();

  // Tᵀ dT over dT, then dA = (Tᵀ dT) Tᵀ over it (M holds G).
  for (int pass = 0; pass < 2; ++pass) {
    float m[4][4];
    tc_zero<4>(m);
    if (pass == 0)
      tc_acc<4>(m, INTRA_C, INTRA_C, INTRA_C, tc_sq(T), tc_sq(D), false);
    else
      tc_acc<4>(m, INTRA_C, INTRA_C, INTRA_C, tc_sq(D), tc_sq(T), false);
    __syncthreads();
    tc_each<4>(m, INTRA_C, INTRA_C, [&](int t, int j, float x) { D[t * TC_P + j] = x; });
    __syncthreads();
  }

  // Per entry below the diagonal: dG into M over G (read first), P = dA · A over dA in D; the
  // row's sums of P and of the G term of dβ. dG is strictly lower, and dK takes it as dG + dGᵀ:
  // each entry is written at both places, so M holds that sum (one of its two terms is zero,
  // so it is exact) and dK needs one product where dG and dGᵀ took two. G is read only below
  // the diagonal, so the writes above it clobber nothing still to be read. A warp takes a row,
  // its lanes the columns: with a thread a row, two warps of the eight worked while the rest
  // waited at the barrier.
  for (int t = warp; t < INTRA_C; t += warps) {
    float pb = 0.0f, pg = 0.0f;
    for (int j = lane; j < INTRA_C; j += 32) {
      if (j < t && t < c) {
        const float e = __expf(gam[t] - gam[j]), da = D[t * TC_P + j], g = G[t * TC_P + j];
        const float p = da * (-bet[t] * e * g);
        pb -= da * e * g;
        pg += p;
        M[t * TC_P + j] = M[j * TC_P + t] = -bet[t] * e * da;
        D[t * TC_P + j] = p;
      } else if (j <= t) {
        M[t * TC_P + j] = M[j * TC_P + t] = 0.0f;
      }
    }
    pb = warp_sum(pb);
    pg = warp_sum(pg);
    if (lane == 0 && t < c) {
      dbet[t] += pb;
      dgam[t] += pg;
    }
  }
  __syncthreads();
  // dγ less P's column sums below the diagonal: a quad of lanes a column, each summing every
  // fourth row, joined by shuffles (4 · INTRA_C is a whole number of warps, so every lane of a
  // warp takes part).
  for (int i = tid; i < 4 * INTRA_C; i += blockDim.x) {
    const int j = i / 4;
    float s = 0.0f;
    for (int r = j + 1 + i % 4; r < c; r += 4) s += D[r * TC_P + j];
    s = quad_sum(s);
    if (i % 4 == 0 && j < c) dgam[j] -= s;
  }
  __syncthreads();

  // dK = (dG + dGᵀ) K + diag(β e^γ) Tᵀ dKc, with k·dY into dβ and dγ (dY = Tᵀ dKc).
  tc_pipeline(
      (dk + INTRA_TW - 1) / INTRA_TW,
      [&](int i, int b) {
        tc_stage_async(gkc, dk, dk, i * INTRA_TW, c, INTRA_C, tas(b));
        tc_stage_async(kb, dk, dk, i * INTRA_TW, c, INTRA_C, tbs(b), nullptr, TC_TB);
      },
      [&](int i, int b) {
        const int col0 = i * INTRA_TW;
        float *X = tas(b);
        const float *kt = tbs(b);
        float y[2][4], z[2][4];
        tc_zero<2>(y);
        tc_zero<2>(z);
        tc_acc_both<2>(y, tc_sq(T), tc_rows(X), z, tc_sq(M), tc_rows_b(kt), INTRA_C, INTRA_TW, INTRA_C);
        __syncthreads();  // X takes the first tile's place
        // y and z hold the same elements in the same threads.
        tc_each<2>(y, INTRA_C, INTRA_TW, [&](int j, int r, float x) { X[j * TC_TP + r] = kc_sign * x; });
        tc_each_pair<2>(z, INTRA_C, INTRA_TW, [&](int j, int r, float x, float y) {
          const float *xr = X + j * TC_TP + r;
          if (j < c)
            tc_store2(dk_out + (long long)j * dk + col0, r, dk - col0, ys[j] * xr[0] + x, ys[j] * xr[1] + y);
        });
        __syncthreads();
        warp_row_sums(
            warp, c, warps, [&](int j) { return X[j * TC_TP + lane] * kt[j * TC_TB + lane]; },
            [&](int j, float s) {
              if (lane == 0) {
                dbet[j] += __expf(gam[j]) * s;
                dgam[j] += ys[j] * s;
              }
            });
      });
  for (int i = tid; i < c; i += blockDim.x) {
    db_out[i] = dbet[i];
    dg_out[i] = dgam[i];
  }
}

// The chunk walk on tensor cores. Grid and block as chunk_walk_*_f32's; the state (G) and U (dU)
// tiles [rows, 32] at row stride TC_SW (≡ 8 mod 32: their fragment reads by row hit distinct
// banks), a chunk's raw keys in two tiles [64, dk + 4] and [64, dk + 8] (rows past c zero), and its
// key scales e [64]. Each product reads one of Kc and K as its A operand: the first product by
// rows (the forward Kc, the backward K: stride dk + 4, ≡ 4 or 20 mod 32), the second by columns
// (the forward K, the backward Kc: stride dk + 8, ≡ 8 or 24 mod 32), so that a warp's fragment
// reads hit 32 distinct banks either way, where one [64, 2 dk + 4] tile of both put two lanes on
// a bank in the reads by columns. Kend = diag(e) K is never formed: e scales U's rows instead
// (Kendᵀ U = Kᵀ diag(e) U) and the backward's Kend G. So the keys are plain copies, issued as
// 16-byte asynchronous copies all at once, and each product's epilogue operands are loaded before
// its products run. Needs dk % 16 == 0 (the state's rows are the product's 16-row tiles).
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

// Chunk `blk`'s keys, `rm` into KR (row stride dk + 4, read by rows) and `tr` into KT (row stride
// dk + 8, read by columns), either absent where null, rows c..rows zero; and its key scales into
// es_out; then wait for them and synchronise. `vec`: every key row is 16-byte aligned (dk % 4 == 0
// and aligned bases).
__device__ __forceinline__ void tc_walk_stage(const float *rm, const float *tr, const float *e, float *KR, float *KT,
                                              float *es_out, long long blk, int c, int rows, int dk, bool vec) {
  const int krs = dk + 4, kts = dk + 8;
  const float *rms = rm ? rm + blk * c * dk : nullptr, *trs = tr ? tr + blk * c * dk : nullptr, *es = e + blk * c;
  if (vec) {
    const int q = dk / 4;
    for (int i = threadIdx.x; i < rows * q; i += blockDim.x) {
      const int t = i / q, r = (i % q) * 4;
      float *dr = KR + t * krs + r, *dt = KT + t * kts + r;
      if (t < c) {
        if (rms) __pipeline_memcpy_async(dr, rms + (long long)t * dk + r, 16);
        if (trs) __pipeline_memcpy_async(dt, trs + (long long)t * dk + r, 16);
      } else {
        if (rms) *reinterpret_cast<float4 *>(dr) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (trs) *reinterpret_cast<float4 *>(dt) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    __pipeline_commit();
  } else {
    for (int i = threadIdx.x; i < rows * dk; i += blockDim.x) {
      const int t = i / dk, r = i % dk;
      const bool in = t < c;
      if (rms) KR[t * krs + r] = in ? rms[i] : 0.0f;
      if (trs) KT[t * kts + r] = in ? trs[i] : 0.0f;
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

// The walk's bodies are templates over SS, the state product's tiles per warp (dk / 32 rounded
// up): its accumulators and epilogue operands are SS x 4 registers a thread, which for dk 256's
// eight held 124 registers and two blocks a multiprocessor at every key width.
template <int SS>
__device__ __forceinline__ void walk_fwd_tc(float *wsm, const float *w, const float *kc, const float *k,
                                            const float *e, const float *s0, const float *a, float *u_out,
                                            float *states, int n, int bh, int c, int dk, int dv, int delta) {
  const int krs = dk + 4, kts = dk + 8;
  const int cm = (c + 15) / 16 * 16, ck = (c + 7) / 8 * 8;
  float *S = wsm, *U = S + dk * TC_SW, *KR = U + INTRA_C * TC_SW, *KT = KR + INTRA_C * krs, *es = KT + INTRA_C * kts;
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
    tc_walk_stage(delta ? kc : nullptr, k, e, KR, KT, es, blk, c, cm, dk, vec);
    tc_walk_out(S, dk, states + blk * dk * dv, dv, col0);
    // U = W − Kc S, kept as diag(e) U for the state's update
    float acc[2][4];
    tc_zero<2>(acc);
    if (delta) tc_acc<2>(acc, cm, WALK_TV, dk, TcView{KR, krs, 1}, TcView{S, TC_SW, 1}, false);
    float *ui = u_out + blk * c * dv;
    tc_each_with<2>(acc, wv, cm, WALK_TV, [&](int t, int j, float x, float wtj) {
      const float u = wtj - x;
      U[t * TC_SW + j] = es[t] * u;
      if (t < c && col0 + j < dv) ui[(long long)t * dv + col0 + j] = u;
    });
    float av[SS][4];
    tc_fill<SS>(av, dk, WALK_TV, [&](int r, int) { return ai[r]; });
    __syncthreads();
    // S ← diag(a) S + Kᵀ diag(e) U (each element read and written by the thread that holds it)
    float sacc[SS][4];
    tc_zero<SS>(sacc);
    tc_acc<SS>(sacc, dk, WALK_TV, ck, TcView{KT, 1, kts}, TcView{U, TC_SW, 1}, false);
    tc_each_with<SS>(sacc, av, dk, WALK_TV,
                    [&](int r, int j, float x, float ar) { S[r * TC_SW + j] = ar * S[r * TC_SW + j] + x; });
    __syncthreads();
  }
  tc_walk_out(S, dk, states + ((long long)n * bh + h) * dk * dv, dv, col0);
}

// The backward also sums the column terms of da and de over its 32 columns, for the caller to
// add up over the tiles: da_i[r] = Σ_j S_i[r][j] G_{i+1}[r][j] and de_i[t] = Σ_j U_i[t][j] (K_i
// G_{i+1})[t][j] (= rowsum(K ∘ U Gᵀ)), from the walk's U and states (ures, sres), into da_part
// [tiles, N, BH, dk] and de_part [tiles, N, BH, c].
template <int SS>
__device__ __forceinline__ void walk_bwd_tc(float *wsm, const float *kc, const float *k, const float *e,
                                            const float *a, const float *gu, const float *gs, float *dw, float *gend,
                                            float *ds0, int n, int bh, int c, int dk, int dv, int delta,
                                            const float *ures, const float *sres, float *da_part, float *de_part) {
  const int krs = dk + 4, kts = dk + 8;
  const int cm = (c + 15) / 16 * 16, ck = (c + 7) / 8 * 8;
  float *G = wsm, *dU = G + dk * TC_SW, *KR = dU + INTRA_C * TC_SW, *KT = KR + INTRA_C * krs, *es = KT + INTRA_C * kts;
  // red [64, 4] at row stride TC_SW: each row's sums over the tile's four 8-column groups, in
  // columns 32..35 of dU's rows, which no product or store reads
  float *red = dU + WALK_TV;
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
    tc_walk_stage(k, delta ? kc : nullptr, e, KR, KT, es, blk, c, cm, dk, vec);
    // dU = gU + diag(e) K G
    float acc[2][4];
    tc_zero<2>(acc);
    tc_acc<2>(acc, cm, WALK_TV, dk, TcView{KR, krs, 1}, TcView{G, TC_SW, 1}, false);
    // de: U ∘ (K G) summed over each fragment row's 8 columns (a quad of lanes), into red
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      int m0, n0;
      if (!tc_tile(cm, WALK_TV, s, m0, n0)) continue;
      const float lo = quad_sum(uv[s][0] * acc[s][0] + uv[s][1] * acc[s][1]);
      const float hi = quad_sum(uv[s][2] * acc[s][2] + uv[s][3] * acc[s][3]);
      if (lane % 4 == 0) {
        red[(m0 + lane / 4) * TC_SW + n0 / 8] = lo;
        red[(m0 + lane / 4 + 8) * TC_SW + n0 / 8] = hi;
      }
    }
    tc_each_with<2>(acc, gv, cm, WALK_TV,
                    [&](int t, int j, float x, float gtj) { dU[t * TC_SW + j] = gtj + es[t] * x; });
    tc_walk_out(G, dk, gend + blk * dk * dv, dv, col0);
    // da: S_i ∘ G_{i+1} summed over the tile's columns, a row per warp (S_i's loads from global
    // memory were a quarter of the kernel's stall samples when each waited for the one before)
    warp_row_sums(
        warp, dk, warps,
        [&](int r) { return col0 + lane < dv ? si[(long long)r * dv + col0 + lane] * G[r * TC_SW + lane] : 0.0f; },
        [&](int r, float sum) {
          if (lane == 0) da_part[(part0 + blk) * dk + r] = sum;
        });
    // G's update: diag(a) G + gS_i, less Kcᵀ dU below
    float keep[SS][4];
    tc_fill<SS>(keep, dk, WALK_TV, [&](int r, int j) {
      return ai[r] * G[r * TC_SW + j] + (col0 + j < dv ? gsi[(long long)r * dv + col0 + j] : 0.0f);
    });
    __syncthreads();
    for (int t = threadIdx.x; t < c; t += blockDim.x)
      de_part[(part0 + blk) * c + t] = red[t * TC_SW] + red[t * TC_SW + 1] + red[t * TC_SW + 2] + red[t * TC_SW + 3];
    tc_walk_out(dU, c, dw + blk * c * dv, dv, col0);
    // G ← diag(a) G − Kcᵀ dU + gS_i (each element read and written by the thread that holds it)
    float g[SS][4];
    tc_zero<SS>(g);
    if (delta) tc_acc<SS>(g, dk, WALK_TV, ck, TcView{KT, 1, kts}, TcView{dU, TC_SW, 1}, false);
    tc_each_with<SS>(g, keep, dk, WALK_TV, [&](int r, int j, float x, float kp) { G[r * TC_SW + j] = kp - x; });
    __syncthreads();
  }
  tc_walk_out(G, dk, ds0 + (long long)h * dk * dv, dv, col0);
}

// The walk's kernels by key width: `_k64` for dk <= 64, `_k128` for dk <= 128, the plain name up
// to 256 (chunk.rs picks one by dk). The narrower forms hold fewer registers, so more blocks fit
// a multiprocessor.
#define TC_WALK_KERNELS(suffix, ss, minblocks)                                                                \
  extern "C" __global__ void __launch_bounds__(256, minblocks) chunk_walk_fwd_tc##suffix(                        \
      const float *w, const float *kc, const float *k, const float *e, const float *s0, const float *a,         \
      float *u_out, float *states, int n, int bh, int c, int dk, int dv, int delta) {                           \
    extern __shared__ float wsm[];                                                                            \
    walk_fwd_tc<ss>(wsm, w, kc, k, e, s0, a, u_out, states, n, bh, c, dk, dv, delta);                         \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(256, minblocks) chunk_walk_bwd_tc##suffix(                        \
      const float *kc, const float *k, const float *e, const float *a, const float *gu, const float *gs,        \
      float *dw, float *gend, float *ds0, int n, int bh, int c, int dk, int dv, int delta, const float *ures,   \
      const float *sres, float *da_part, float *de_part) {                                                      \
    extern __shared__ float wsm[];                                                                            \
    walk_bwd_tc<ss>(wsm, kc, k, e, a, gu, gs, dw, gend, ds0, n, bh, c, dk, dv, delta, ures, sres, da_part,   \
                    de_part);                                                                                 \
  }
TC_WALK_KERNELS(, 8, 2)
TC_WALK_KERNELS(_k128, 4, 2)
TC_WALK_KERNELS(_k64, 2, 4)
