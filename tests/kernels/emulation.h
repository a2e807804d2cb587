// CUDA kernels run on the host, for checking their logic (indexing, tiling, where they
// synchronise, what each thread reads and writes) where there is no GPU. One OS thread per CUDA
// thread; the blocks of a grid run one after another, so a kernel's shared memory can be one
// array that every block reuses. __syncthreads is a barrier over the block's threads and a warp
// shuffle an exchange through a barrier over the warp's 32. Tensor-core products (`tc_mma` in
// src/ops/cuda/chunk_tc.cu) are computed from the shared-memory operands the warp would load,
// with float32 operands, or their top 19 bits (TF32, as the hardware reads them) under
// EMULATE_TF32; the hardware's order of summation inside one product is not reproduced.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__
#define STATECUT_EMULATED 1

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx;
inline dim3 blockIdx, blockDim, gridDim;

struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;
[[noreturn]] inline void __trap() { std::abort(); }

namespace emu {
struct Warp {
  std::barrier<> bar{32};
  float v[32];
  unsigned fa[32][4], fb[32][2];  // each lane's mma fragments, for tc_mma_frags_emulated
};
inline std::unique_ptr<std::barrier<>> block;
inline std::unique_ptr<Warp[]> warps;

inline unsigned linear_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

// An operand as the tensor cores read it.
inline float operand(float x) {
#ifdef EMULATE_TF32
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u &= 0xffffe000u;
  std::memcpy(&x, &u, 4);
#endif
  return x;
}

// Run `kernel` (a callable with no arguments) over `grid` blocks of `block` threads.
template <class F> void launch(dim3 grid, dim3 threads, F kernel) {
  blockDim = threads;
  gridDim = grid;
  const unsigned n = threads.x * threads.y * threads.z;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3{x, y, z};
        block = std::make_unique<std::barrier<>>(n);
        warps = std::make_unique<Warp[]>((n + 31) / 32);
        std::vector<std::thread> ts;
        ts.reserve(n);
        for (unsigned i = 0; i < n; ++i)
          ts.emplace_back([&, i] {
            threadIdx = dim3{i % threads.x, i / threads.x % threads.y, i / (threads.x * threads.y)};
            kernel();
            block->arrive_and_drop();
          });
        for (auto &t : ts) t.join();
      }
}
}  // namespace emu

inline void __syncthreads() { emu::block->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float x, int lanes) {
  const unsigned id = emu::linear_thread(), lane = id % 32;
  emu::Warp &w = emu::warps[id / 32];
  w.v[lane] = x;
  w.bar.arrive_and_wait();
  const float y = w.v[lane ^ unsigned(lanes)];
  w.bar.arrive_and_wait();
  return y;
}

// Lane l takes lane l − delta's x; the lanes below delta keep their own.
inline float __shfl_up_sync(unsigned, float x, int delta) {
  const unsigned id = emu::linear_thread(), lane = id % 32;
  emu::Warp &w = emu::warps[id / 32];
  w.v[lane] = x;
  w.bar.arrive_and_wait();
  const float y = lane >= unsigned(delta) ? w.v[lane - delta] : x;
  w.bar.arrive_and_wait();
  return y;
}

// c += A[m0.., k0..k0+8] B[k0..k0+8, n0..] for the lane (g, t) of one m16n8k8 product: its four
// accumulators are rows m0 + g and m0 + g + 8, columns n0 + 2t and n0 + 2t + 1.
template <class View>
inline void tc_mma_emulated(float c[4], const View &a, int m0, const View &b, int n0, int k0, int g, int t) {
  for (int i = 0; i < 4; ++i) {
    const int row = m0 + g + 8 * (i / 2), col = n0 + 2 * t + i % 2;
    float s = c[i];
    for (int k = k0; k < k0 + 8; ++k) s += emu::operand(a.at(row, k)) * emu::operand(b.at(k, col));
    c[i] = s;
  }
}

// c += A B for one m16n8k8 product from the warp's fragments, as mma.sync takes them: lane
// 4g + t holds A's (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4) and B's (t, g), (t + 4, g) (row,
// column). Each lane's accumulators sum over k in tc_mma_emulated's order.
inline void tc_mma_frags_emulated(float c[4], const unsigned a[4], const unsigned b[2]) {
  const unsigned id = emu::linear_thread(), lane = id % 32;
  emu::Warp &w = emu::warps[id / 32];
  for (int i = 0; i < 4; ++i) w.fa[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) w.fb[lane][i] = b[i];
  w.bar.arrive_and_wait();
  const auto bits = [](unsigned u) {
    float x;
    std::memcpy(&x, &u, 4);
    return emu::operand(x);
  };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float s = c[i];
    for (int k = 0; k < 8; ++k)
      s += bits(w.fa[4 * (row % 8) + k % 4][row / 8 + 2 * (k / 4)]) * bits(w.fb[4 * col + k % 4][k / 4]);
    c[i] = s;
  }
  w.bar.arrive_and_wait();
}
