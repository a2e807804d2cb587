// The host stand-in for <cuda_pipeline.h> (see ../emulation.h). An asynchronous copy lands only
// when the issuing thread waits for its group (`__pipeline_wait_prior`), the latest the device
// allows: a kernel that reads a tile before waiting for it, or never waits, reads what was there
// before and gives wrong results here, where on the device it would race.
#pragma once
#include <cstring>
#include <vector>

namespace emu {
struct AsyncCopy {
  void *dst;
  const void *src;
  unsigned bytes;
};
inline thread_local std::vector<AsyncCopy> issued;                  // since the last commit
inline thread_local std::vector<std::vector<AsyncCopy>> committed;  // oldest group first
}  // namespace emu

inline void __pipeline_memcpy_async(void *dst, const void *src, unsigned bytes) {
  emu::issued.push_back({dst, src, bytes});
}
inline void __pipeline_commit() {
  emu::committed.push_back(std::move(emu::issued));
  emu::issued.clear();
}
// Every committed group but the newest `n` lands.
inline void __pipeline_wait_prior(int n) {
  const size_t keep = n < 0 ? 0 : size_t(n);
  size_t done = 0;
  for (; emu::committed.size() - done > keep; ++done)
    for (const auto &c : emu::committed[done]) std::memcpy(c.dst, c.src, c.bytes);
  emu::committed.erase(emu::committed.begin(), emu::committed.begin() + done);
}
