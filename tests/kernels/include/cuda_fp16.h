// The host stand-in for <cuda_fp16.h> (see ../emulation.h): the type and its conversions, through
// the compiler's _Float16.
#pragma once
#include <cstdint>
#include <cstring>
struct __half {
  _Float16 v;
};
inline float __half2float(__half x) { return float(x.v); }
inline __half __float2half(float f) { return __half{_Float16(f)}; }
