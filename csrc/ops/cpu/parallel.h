// How the CPU kernels size at::parallel_for's chunks. Included only by the per-ISA kernel files;
// internal linkage, so no ISA's copy of it stands in for another's at link time.
#pragma once

#include <algorithm>
#include <cstdint>

namespace safeattn::cpu {
namespace {

// The grain of a loop whose items each touch `work_per_item` elements: as many items as make
// `work_per_chunk` elements, at least one. A small call then runs on the calling thread rather
// than waking the pool for microseconds of work; a large one still splits item by item.
inline int64_t grain_for(int64_t work_per_item, int64_t work_per_chunk) {
  return std::max<int64_t>(1, work_per_chunk / std::max<int64_t>(work_per_item, 1));
}

}  // namespace
}  // namespace safeattn::cpu
