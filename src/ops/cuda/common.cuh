// Helpers every kernel file shares: conversions between T and float, warp and block sums,
// 16-byte loads and stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// A block's shared array declared in a kernel. The host emulation (tests/kernels) runs a block's
// threads as OS threads and its blocks in turn, so there the block's array is a static one.
#ifdef STATECUT_EMULATED
#define BLOCK_SHARED static
#else
#define BLOCK_SHARED __shared__
#endif

// The sum of x over the 32 lanes of a warp, every lane getting it.
__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// The sum of x over a quad of lanes (lane / 4 alike), every lane of the quad getting it.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// For rows r = first, first + step, ... below n: f(r) summed over the warp's 32 lanes (in
// warp_sum's order), handed to done(r, sum) in every lane. Four rows go at a time, their values
// loaded first and their shuffle chains interleaved, where a row at a time waited out each load
// (from global memory, for some callers) and each chain in turn. first, n and step are the same
// across the warp, as the shuffles need every lane.
template <typename F, typename D> __device__ __forceinline__ void warp_row_sums(int first, int n, int step, F f, D done) {
  for (int r0 = first; r0 < n; r0 += 4 * step) {
    float x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) x[u] = r0 + u * step < n ? f(r0 + u * step) : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] += __shfl_xor_sync(0xffffffffu, x[u], off);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (r0 + u * step < n) done(r0 + u * step, x[u]);
  }
}

// Sixteen bytes of T, loaded or stored as one access (the caller checks the alignment).
template <typename T> struct __align__(16) Pack16 {
  T v[16 / sizeof(T)];
};

// The 16 / sizeof(T) values of T at p (16-byte aligned) as floats.
template <typename T> __device__ __forceinline__ void load16(const T *p, float *f) {
  const Pack16<T> pk = *reinterpret_cast<const Pack16<T> *>(p);
#pragma unroll
  for (int e = 0; e < 16 / (int)sizeof(T); e++) f[e] = to_f(pk.v[e]);
}

// N floats (N a multiple of 4) at p, 16-byte aligned, loaded and stored four at a time.
template <int N> __device__ __forceinline__ void load_floats(const float *p, float *f) {
#pragma unroll
  for (int e = 0; e < N; e += 4) {
    const float4 q = *reinterpret_cast<const float4 *>(p + e);
    f[e] = q.x, f[e + 1] = q.y, f[e + 2] = q.z, f[e + 3] = q.w;
  }
}
template <int N> __device__ __forceinline__ void store_floats(float *p, const float *f) {
#pragma unroll
  for (int e = 0; e < N; e += 4) *reinterpret_cast<float4 *>(p + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
}

// Sum of v over the block; every thread gets the total. `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float *red) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < warps; w++) t += red[w];
  return t;
}
