// Pinned host rows -> device slots in one launch: the GPU reads the rows over the bus itself (pinned memory is mapped
// under unified addressing: its host pointer is valid on the device), instead of one cuMemcpyHtoDAsync per row.
//
// desc: `rows` descriptors of three 64-bit words (source host address, destination device address, bytes; both
// addresses 16-byte aligned, bytes a multiple of 16), itself in mapped pinned memory. Grid (blocks per row, rows),
// kThreads threads; each block copies every gridDim.x-th run of kThreads 16-byte words of its row, kUnroll loads in
// flight per thread before their stores. No shared memory, no atomics.

#include <cstdint>

namespace {
constexpr int kThreads = 256;
constexpr int kUnroll = 8;
}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) gather_rows(const unsigned long long* __restrict__ desc) {
  const unsigned long long* d = desc + 3 * blockIdx.y;
  const uint4* src = reinterpret_cast<const uint4*>(d[0]);
  uint4* dst = reinterpret_cast<uint4*>(d[1]);
  const long long words = static_cast<long long>(d[2] / 16);
  const long long step = static_cast<long long>(gridDim.x) * kThreads;
  for (long long base = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; base < words;
       base += step * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long i = base + u * step;
      if (i < words) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long i = base + u * step;
      if (i < words) dst[i] = v[u];
    }
  }
}
