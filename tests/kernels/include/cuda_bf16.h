// The host stand-in for <cuda_bf16.h> (see ../emulation.h): storage and the two conversions.
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite inputs)
  return __nv_bfloat16{uint16_t(u >> 16)};
}
