// SwiGLU and its backward (src/ops/mlp.rs).
#pragma once
#include "common.cuh"

// SwiGLU on the stacked gate|up projection: y[r, i] = silu(x[r, i]) · x[r, n + i], in float32,
// rounded once to T. x [rows, 2n], y [rows, n]. Columns on x of the grid, rows on y (strided
// past 65535), so no element needs a 64-bit division. With `vec` (n a multiple of 16 bytes of T
// and x 16-byte aligned) a thread takes 16 bytes of columns with one load of each half and one
// store: a memory-bound kernel then moves its bytes in full lines.
template <typename T>
__device__ void swiglu(const T *__restrict__ x, T *__restrict__ y, long long rows, int n, int vec) {
  constexpr int V = 16 / sizeof(T);
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * (vec ? V : 1);
  if (i >= n) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const T *g = x + r * 2 * n + i, *u = g + n;
    T *o = y + r * n + i;
    if (vec) {
      const Pack16<T> gp = *reinterpret_cast<const Pack16<T> *>(g), up = *reinterpret_cast<const Pack16<T> *>(u);
      Pack16<T> op;
#pragma unroll
      for (int e = 0; e < V; e++) {
        const float gv = to_f(gp.v[e]);
        op.v[e] = from_f<T>(gv / (1.0f + expf(-gv)) * to_f(up.v[e]));
      }
      *reinterpret_cast<Pack16<T> *>(o) = op;
    } else {
      const float gv = to_f(*g);
      *o = from_f<T>(gv / (1.0f + expf(-gv)) * to_f(*u));
    }
  }
}

#define SWIGLU(NAME, T)                                                                           \
  extern "C" __global__ void NAME(const T *x, T *y, long long rows, int n, int vec) {             \
    swiglu<T>(x, y, rows, n, vec);                                                                 \
  }
SWIGLU(swiglu_f32, float)
SWIGLU(swiglu_bf16, __nv_bfloat16)
SWIGLU(swiglu_f16, __half)

// The backward of swiglu: d[gate | up] = [dy · up · silu'(gate) | dy · silu(gate)], float32
// inside, rounded once to T; the grid and `vec` as swiglu's (dy 16-byte aligned too).
template <typename T>
__device__ __forceinline__ void swiglu_grad(float gv, float up, float d, T &dg, T &du) {
  const float sig = 1.0f / (1.0f + expf(-gv));
  dg = from_f<T>(d * up * sig * (1.0f + gv * (1.0f - sig)));
  du = from_f<T>(d * gv * sig);
}

template <typename T>
__device__ void swiglu_bwd(const T *__restrict__ x, const T *__restrict__ dy, T *__restrict__ dx, long long rows,
                           int n, int vec) {
  constexpr int V = 16 / sizeof(T);
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * (vec ? V : 1);
  if (i >= n) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const T *g = x + r * 2 * n + i, *u = g + n, *d = dy + r * n + i;
    T *dg = dx + r * 2 * n + i, *du = dg + n;
    if (vec) {
      const Pack16<T> gp = *reinterpret_cast<const Pack16<T> *>(g), up = *reinterpret_cast<const Pack16<T> *>(u),
                      dp = *reinterpret_cast<const Pack16<T> *>(d);
      Pack16<T> gq, uq;
#pragma unroll
      for (int e = 0; e < V; e++) swiglu_grad<T>(to_f(gp.v[e]), to_f(up.v[e]), to_f(dp.v[e]), gq.v[e], uq.v[e]);
      *reinterpret_cast<Pack16<T> *>(dg) = gq;
      *reinterpret_cast<Pack16<T> *>(du) = uq;
    } else {
      swiglu_grad<T>(to_f(*g), to_f(*u), to_f(*d), *dg, *du);
    }
  }
}

#define SWIGLU_BWD(NAME, T)                                                                        \
  extern "C" __global__ void NAME(const T *x, const T *dy, T *dx, long long rows, int n, int vec) { \
    swiglu_bwd<T>(x, dy, dx, rows, n, vec);                                                        \
  }
SWIGLU_BWD(swiglu_bwd_f32, float)
SWIGLU_BWD(swiglu_bwd_bf16, __nv_bfloat16)
SWIGLU_BWD(swiglu_bwd_f16, __half)
