// The recovery loss's rows and their backward (src/ops/distill.rs).
#pragma once
#include "common.cuh"

// The recovery loss's rows (src/ops/distill.rs): per row of student logits s and teacher
// logits t over a vocabulary of v, out[row] = {ce, kl, lse(s), lse(s/T), lse(t/T)} with
// ce = lse(s) - s[y] and kl = KL(softmax(t/T) || softmax(s/T)) = sum p_t (t - s)/T - lse(t/T)
// + lse(s/T). One block per row; each thread keeps online (max, sums) over its columns, which
// the block then merges, so the row is read once. Without a teacher (kd 0) t is not read.
#define KD_THREADS 256
struct KdPart {
  float m, s1, st, mt, tt, a;
};

__device__ __forceinline__ void kd_merge(KdPart &x, const KdPart &o, float it) {
  if (o.m > -INFINITY) {
    if (o.m > x.m) {
      const float c = x.m > -INFINITY ? expf(x.m - o.m) : 0.0f, ct = x.m > -INFINITY ? expf((x.m - o.m) * it) : 0.0f;
      x.s1 = x.s1 * c + o.s1;
      x.st = x.st * ct + o.st;
      x.m = o.m;
    } else {
      x.s1 += o.s1 * expf(o.m - x.m);
      x.st += o.st * expf((o.m - x.m) * it);
    }
  }
  if (o.mt > -INFINITY) {
    if (o.mt > x.mt) {
      const float c = x.mt > -INFINITY ? expf((x.mt - o.mt) * it) : 0.0f;
      x.tt = x.tt * c + o.tt;
      x.a = x.a * c + o.a;
      x.mt = o.mt;
    } else {
      const float c = expf((o.mt - x.mt) * it);
      x.tt += o.tt * c;
      x.a += o.a * c;
    }
  }
}

template <typename T>
__device__ void kd_rows(const T *__restrict__ s, const T *__restrict__ t, const unsigned *__restrict__ y,
                        float *__restrict__ out, int v, float it, int kd) {
  const int64_t row = blockIdx.x;
  const T *sr = s + row * v, *tr = t + row * v;
  KdPart p = {-INFINITY, 0.0f, 0.0f, -INFINITY, 0.0f, 0.0f};
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    const float xs = to_f(sr[j]);
    KdPart q = {xs, 1.0f, 1.0f, -INFINITY, 0.0f, 0.0f};
    if (kd) {
      const float xt = to_f(tr[j]);
      q.mt = xt;
      q.tt = 1.0f;
      q.a = (xt - xs) * it;
    }
    kd_merge(p, q, it);
  }
  for (int off = 16; off > 0; off >>= 1) {
    KdPart o;
    o.m = __shfl_xor_sync(0xffffffffu, p.m, off);
    o.s1 = __shfl_xor_sync(0xffffffffu, p.s1, off);
    o.st = __shfl_xor_sync(0xffffffffu, p.st, off);
    o.mt = __shfl_xor_sync(0xffffffffu, p.mt, off);
    o.tt = __shfl_xor_sync(0xffffffffu, p.tt, off);
    o.a = __shfl_xor_sync(0xffffffffu, p.a, off);
    kd_merge(p, o, it);
  }
  __shared__ KdPart warps[KD_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warps[warp] = p;
  __syncthreads();
  if (threadIdx.x != 0) return;
  // Merged in a fixed order: the result does not depend on scheduling.
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) kd_merge(p, warps[w], it);
  const float lse1 = p.m + logf(p.s1), lse_s = p.m * it + logf(p.st);
  const unsigned target = y[row];
  float *o = out + row * 5;
  o[0] = target < (unsigned)v ? lse1 - to_f(sr[target]) : __int_as_float(0x7fc00000);
  o[2] = lse1;
  o[3] = lse_s;
  if (kd) {
    const float lse_t = p.mt * it + logf(p.tt);
    o[1] = p.a / p.tt - lse_t + lse_s;
    o[4] = lse_t;
  } else {
    o[1] = 0.0f;
    o[4] = 0.0f;
  }
}

#define KD_ROWS(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *s, const T *t, const unsigned *y, float *out, int v,   \
                                  float it, int kd) {                                              \
    kd_rows<T>(s, t, y, out, v, it, kd);                                                            \
  }
KD_ROWS(kd_rows_f32, float)
KD_ROWS(kd_rows_bf16, __nv_bfloat16)
KD_ROWS(kd_rows_f16, __half)

// The backward of kd_rows: aux[row] = {target, d ce, d kl, lse(s), lse(s/T), lse(t/T)};
// ds = dce (softmax(s) - onehot(y)) + dkl / T (softmax(s/T) - softmax(t/T)), in T.
template <typename T>
__device__ void kd_rows_bwd(const T *__restrict__ s, const T *__restrict__ t, const float *__restrict__ aux,
                            T *__restrict__ ds, int v, float it, int kd) {
  const int64_t row = blockIdx.x;
  const float *a = aux + row * 6;
  const int y = (int)a[0];
  const float dce = a[1], dkl = a[2], lse1 = a[3], lse_s = a[4], lse_t = a[5];
  const T *sr = s + row * v, *tr = t + row * v;
  T *dr = ds + row * v;
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    const float x = to_f(sr[j]);
    float d = dce * (expf(x - lse1) - (j == y ? 1.0f : 0.0f));
    if (kd) d += dkl * it * (expf(x * it - lse_s) - expf(to_f(tr[j]) * it - lse_t));
    dr[j] = from_f<T>(d);
  }
}

#define KD_ROWS_BWD(NAME, T)                                                                       \
  extern "C" __global__ void NAME(const T *s, const T *t, const float *aux, T *ds, int v, float it, \
                                  int kd) {                                                        \
    kd_rows_bwd<T>(s, t, aux, ds, v, it, kd);                                                       \
  }
KD_ROWS_BWD(kd_rows_bwd_f32, float)
KD_ROWS_BWD(kd_rows_bwd_bf16, __nv_bfloat16)
KD_ROWS_BWD(kd_rows_bwd_f16, __half)
