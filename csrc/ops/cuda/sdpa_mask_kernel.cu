// CUDA kernel of sdpa_mask. Each thread owns 16 bytes of one row (16 bool or 4 float
// elements) and computes the row's interval once; an interval-only mask reads no memory. A
// block walks a contiguous range of rows with the same columns, so a padding mask is read as
// one vector per thread per batch row and kept in registers for every query row of that batch
// (reading it per row moved as many bytes through L2 as the mask wrote); ids are read from
// small [B, L] tensors that stay in L2. The kernel is specialised per rule (interval, padding,
// packed, general) so absent features cost nothing.
// Packed ids that never decrease along a row (Transformers' are a cumulative sum) are turned
// into one run [begin, end) per position by a pre-pass, so their rows are intervals too.
#include <algorithm>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/cuda_device.h"
#include "ops/sdpa_mask.h"
#include "safeattn.h"

namespace safeattn {
namespace {

using namespace safeattn::sdpa_mask_detail;

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// What the host knows about alignment, so the kernel can use vector memory operations.
struct Alignment {
  bool out;      // every row start is 16-byte aligned
  bool padding;  // padding row segments at multiples of the vector width are vector aligned
};

// Which row rule a launch uses; chosen on the host so the common cases carry no branches
// for features that are absent.
enum class RowRule { kInterval, kPadding, kPacked, kGeneral };

// The kernel works on raw bits: an element of kBytes bytes is `on_bits` or `off_bits`, and a
// thread's 16 bytes are built in four 32-bit registers (a local array reinterpreted as a
// vector would live in local memory).
template <int kBytes>
__device__ __forceinline__ void put(uint32_t (&words)[4], int k, bool attend, uint64_t on_bits, uint64_t off_bits) {
  const uint64_t bits = attend ? on_bits : off_bits;
  if constexpr (kBytes == 8) {
    words[2 * k] = static_cast<uint32_t>(bits);
    words[2 * k + 1] = static_cast<uint32_t>(bits >> 32);
  } else {
    words[(k * kBytes) / 4] |= static_cast<uint32_t>(bits) << (((k * kBytes) % 4) * 8);
  }
}

// kVec padding bytes (one per element) as 32-bit words, with one vector load.
template <int kVec>
__device__ __forceinline__ void load_padding(const bool* src, uint32_t (&words)[4]) {
  if constexpr (kVec == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else if constexpr (kVec == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    words[0] = v.x, words[1] = v.y;
  } else if constexpr (kVec == 4) {
    words[0] = *reinterpret_cast<const uint32_t*>(src);
  } else {
    words[0] = *reinterpret_cast<const uint16_t*>(src);
  }
}

// ---- packed ids as runs ------------------------------------------------------------------------

// Where packed_ids never decrease along a batch row, equal ids form one run each, so
// ids[q] == ids[kv] holds exactly for kv in the run of q: an interval. Rows whose ids decrease
// somewhere (the same id may come back later) keep the per-element compare.
struct PackedRuns {
  const int64_t* begin = nullptr;  // [B, packed_width]: first position of the run of each position
  const int64_t* end = nullptr;    // [B, packed_width]: one past its last position
  const bool* ordered = nullptr;   // [B]: the row's ids never decrease
};

constexpr int kRunThreads = 512;
constexpr int kRunWarps = kRunThreads / 32;

struct MaxOf {
  __device__ int64_t operator()(int64_t a, int64_t b) const {
    return a > b ? a : b;
  }
};
struct MinOf {
  __device__ int64_t operator()(int64_t a, int64_t b) const {
    return a < b ? a : b;
  }
};

// `op` over the block's values, given to every thread. `totals`: kRunWarps slots of shared memory.
template <class Op>
__device__ int64_t block_reduce(int64_t v, Op op, int64_t* totals) {
  for (int d = 16; d > 0; d >>= 1) {
    v = op(v, __shfl_xor_sync(~0u, v, d));
  }
  if (threadIdx.x % 32 == 0) {
    totals[threadIdx.x / 32] = v;
  }
  __syncthreads();
  v = totals[0];
  for (int w = 1; w < kRunWarps; ++w) {
    v = op(v, totals[w]);
  }
  __syncthreads();  // totals are free for the next call
  return v;
}

// The inclusive scan by `op` of the block's values in thread order (kForward) or in reverse.
template <bool kForward, class Op>
__device__ int64_t block_scan(int64_t v, int64_t identity, Op op, int64_t* totals) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t other = kForward ? __shfl_up_sync(~0u, v, d) : __shfl_down_sync(~0u, v, d);
    if (kForward ? lane >= d : lane + d < 32) {
      v = op(v, other);
    }
  }
  if (lane == (kForward ? 31 : 0)) {
    totals[warp] = v;
  }
  __syncthreads();
  int64_t carry = identity;
  for (int w = 0; w < kRunWarps; ++w) {
    if (kForward ? w < warp : w > warp) {
      carry = op(carry, totals[w]);
    }
  }
  __syncthreads();
  return op(carry, v);
}

// Where a run starts (its first position) and ends (one past its last) at position i of a row;
// -1 / INT64_MAX where it does not.
struct RunMarks {
  int64_t start = -1;
  int64_t end = INT64_MAX;
  bool decrease = false;  // ids[i] < ids[i - 1]

  __device__ RunMarks(const int64_t* __restrict__ row, int64_t width, int64_t i) {
    if (i < width) {
      const int64_t id = row[i];
      const int64_t before = i > 0 ? row[i - 1] : id;
      start = i == 0 || before != id ? i : -1;
      end = i == width - 1 || row[i + 1] != id ? i + 1 : INT64_MAX;
      decrease = id < before;
    }
  }
};

// The runs in two launches over blocks of kRunThreads positions (a thread each; grid.x = B x the
// blocks of a row). First each block's last run start, first run end and whether the ids
// decrease inside it (one slot per block); then each position's run from the scans inside its
// block, completed by the slots of the blocks before and after it, and each row's order.
struct RunBlocks {
  int64_t* last_start;  // [B, blocks]
  int64_t* first_end;   // [B, blocks]
  bool* decreases;      // [B, blocks]
  int64_t blocks;       // of a row
};

__global__ void __launch_bounds__(kRunThreads)
    packed_run_blocks_kernel(const int64_t* __restrict__ ids, int64_t width, RunBlocks out) {
  __shared__ int64_t totals[kRunWarps];
  const int64_t b = blockIdx.x / out.blocks, block = blockIdx.x % out.blocks;
  const RunMarks marks(ids + b * width, width, block * kRunThreads + threadIdx.x);
  const int64_t last_start = block_reduce(marks.start, MaxOf{}, totals);
  const int64_t first_end = block_reduce(marks.end, MinOf{}, totals);
  const bool decreases = __syncthreads_or(marks.decrease);
  if (threadIdx.x == 0) {
    out.last_start[blockIdx.x] = last_start;
    out.first_end[blockIdx.x] = first_end;
    out.decreases[blockIdx.x] = decreases;
  }
}

__global__ void __launch_bounds__(kRunThreads)
    packed_runs_kernel(const int64_t* __restrict__ ids, int64_t width, const RunBlocks blocks,
                       int64_t* __restrict__ begin, int64_t* __restrict__ end, bool* __restrict__ ordered) {
  __shared__ int64_t totals[kRunWarps];
  const int64_t b = blockIdx.x / blocks.blocks, block = blockIdx.x % blocks.blocks;
  const int64_t i = block * kRunThreads + threadIdx.x;
  int64_t start_before = -1, end_after = INT64_MAX;
  bool decreases = false;
  for (int64_t k = threadIdx.x; k < blocks.blocks; k += kRunThreads) {
    const int64_t slot = b * blocks.blocks + k;
    start_before = k < block ? std::max(start_before, blocks.last_start[slot]) : start_before;
    end_after = k > block ? std::min(end_after, blocks.first_end[slot]) : end_after;
    decreases = decreases || blocks.decreases[slot];
  }
  start_before = block_reduce(start_before, MaxOf{}, totals);
  end_after = block_reduce(end_after, MinOf{}, totals);
  decreases = __syncthreads_or(decreases);
  const RunMarks marks(ids + b * width, width, i);
  const int64_t run_begin = std::max(start_before, block_scan<true>(marks.start, int64_t{-1}, MaxOf{}, totals));
  const int64_t run_end = std::min(end_after, block_scan<false>(marks.end, INT64_MAX, MinOf{}, totals));
  if (i < width) {
    begin[b * width + i] = run_begin;
    end[b * width + i] = run_end;
  }
  if (block == 0 && threadIdx.x == 0) {
    ordered[b] = !decreases;
  }
}

// grid.x covers a row's chunks of kUnroll x 16 bytes, grid.y the B * Q rows, each block the
// `rows_per_block` rows from blockIdx.y * rows_per_block. Each thread computes its row's
// interval once, then kUnroll x kVec elements with 32-bit column arithmetic (the host sends
// rows of 2^31 keys or more to the general rule).
constexpr int kUnroll = 4;

template <int kBytes, RowRule kRule>
__global__ void __launch_bounds__(kThreads, 4)
    sdpa_mask_rows_kernel(const SdpaMaskParams p, uint8_t* __restrict__ out, const uint64_t on_bits,
                          const uint64_t off_bits, const Alignment aligned, const PackedRuns runs,
                          const int64_t rows_per_block) {
  constexpr int kVec = 16 / kBytes;
  constexpr bool kReadsPadding = kRule == RowRule::kPadding || kRule == RowRule::kPacked;
  const int64_t threads = blockDim.x;
  const int64_t first_col = (static_cast<int64_t>(blockIdx.x) * threads * kUnroll + threadIdx.x) * kVec;
  if (first_col >= p.kv_length) {
    return;
  }
  const int64_t rows = p.batch_size * p.q_length;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t row_end = std::min(rows, row_begin + rows_per_block);
  // The padding of this thread's columns in the batch row `padding_b`: one byte per element,
  // 0xff attends, 0 does not; loaded when the batch changes.
  uint32_t keep_cache[kUnroll][4];
  int64_t padding_b = -1;
#pragma unroll 1
  for (int64_t row = row_begin; row < row_end; ++row) {
    // 32-bit division where it fits (the common case): 64-bit division is a long sequence.
    const int64_t b = rows <= UINT32_MAX
                          ? static_cast<int64_t>(static_cast<uint32_t>(row) / static_cast<uint32_t>(p.q_length))
                          : row / p.q_length;
    if (kReadsPadding && p.padding_mask != nullptr && b != padding_b) {
      padding_b = b;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        uint32_t(&keep)[4] = keep_cache[u];
        keep[0] = keep[1] = keep[2] = keep[3] = 0;
        const int64_t col0 = first_col + static_cast<int64_t>(u) * threads * kVec;
        if (col0 >= p.kv_length) {
          continue;
        }
        // A key position (kv_offset + kv_length fits int64); compared with the width by
        // subtraction, since pos0 + k could pass the int64 range near its end.
        const int64_t pos0 = p.kv_offset + col0;
        const int64_t left = p.padding_width - pos0;  // columns of the mask from pos0 on (may be <= 0)
        const bool* src = p.padding_mask + b * p.padding_width + (left > 0 ? pos0 : 0);
        if (aligned.padding && left >= kVec) {
          load_padding<kVec>(src, keep);
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const uint32_t byte = k < left ? src[k] : 0;  // past the width: padding
            keep[k / 4] |= byte << ((k % 4) * 8);
          }
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          keep[w] = __vcmpne4(keep[w], 0u);
        }
      }
    }
    const Position q_pos = query_position(p, b, row - b * p.q_length);
    Interval base = base_interval(p, b, q_pos);
    RowKeys keys{0, false, -1};
    if constexpr (kRule == RowRule::kGeneral || kRule == RowRule::kPacked) {
      keys = row_keys(p, b, q_pos);
    }
    // Packed rows whose ids form runs are the intersection of base and the query's run.
    bool packed_elementwise = false;
    if constexpr (kRule == RowRule::kPacked) {
      if (!runs.ordered[b]) {
        packed_elementwise = true;
      } else if (!keys.packed_known) {
        base.end = base.begin;  // a query position outside the ids matches nothing
      } else {
        const int64_t at = b * p.packed_width + static_cast<int64_t>(q_pos);  // known: inside the ids
        base = in_run(p, base, runs.begin[at], runs.end[at]);
      }
    }
    uint8_t* out_row = out + row * p.kv_length * kBytes;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Consecutive threads own consecutive 16-byte chunks, so each store instruction of a
      // warp covers 512 contiguous bytes.
      const int64_t col0 = first_col + static_cast<int64_t>(u) * threads * kVec;
      if (col0 >= p.kv_length) {
        break;
      }
      uint32_t words[4] = {0, 0, 0, 0};
      if constexpr (kRule == RowRule::kGeneral) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          // element_attends bounds-checks every index: columns past kv_length read nothing
          // outside the inputs (and are not stored).
          put<kBytes>(words, k, element_attends(p, b, base, keys, col0 + k), on_bits, off_bits);
        }
      } else {
        // The interval relative to this chunk, in 32 bits.
        const int32_t lo = static_cast<int32_t>(std::max<int64_t>(base.begin - col0, -1));
        const int32_t hi = static_cast<int32_t>(std::min<int64_t>(base.end - col0, kVec + 1));
        uint32_t keep[4] = {~0u, ~0u, ~0u, ~0u};  // one byte per element, nonzero: attend
        if (kReadsPadding && p.padding_mask != nullptr) {
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            keep[w] = keep_cache[u][w];
          }
        }
        if (kBytes == 1 && !packed_elementwise) {
          // Bool-sized elements, four per word with SIMD byte compares: the element count per
          // instruction is what keeps this kernel at store bandwidth.
          const uint32_t lo4 = static_cast<uint32_t>(std::min(std::max(lo, 0), 16)) * 0x01010101u;
          const uint32_t hi4 = static_cast<uint32_t>(std::max(std::min(hi, 16), 0)) * 0x01010101u;
          const uint32_t on4 = static_cast<uint32_t>(on_bits & 0xffu) * 0x01010101u;
          const uint32_t off4 = static_cast<uint32_t>(off_bits & 0xffu) * 0x01010101u;
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const uint32_t index4 = 0x03020100u + static_cast<uint32_t>(4 * w) * 0x01010101u;
            const uint32_t attend = __vcmpgeu4(index4, lo4) & __vcmpltu4(index4, hi4) & keep[w];
            words[w] = (attend & on4) | (~attend & off4);
          }
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            bool attend = k >= lo && k < hi && ((keep[k / 4] >> ((k % 4) * 8)) & 0xffu) != 0;
            if (packed_elementwise) {
              // Packed ids that are not runs, possibly with padding: per element, only inside
              // the interval.
              attend = attend && element_attends(p, b, base, keys, col0 + k);
            }
            put<kBytes>(words, k, attend, on_bits, off_bits);
          }
        }
      }
      uint8_t* dst = out_row + col0 * kBytes;
      if (aligned.out && col0 + kVec <= p.kv_length) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
      } else {
        // A row end that is not 16-byte aligned: byte stores (rare shapes only).
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          if (col0 + k / kBytes < p.kv_length) {
            dst[k] = static_cast<uint8_t>(words[k / 4] >> ((k % 4) * 8));
          }
        }
      }
    }
  }
}

template <int kBytes, RowRule kRule>
void launch_rule(const SdpaMaskParams& p, at::Tensor& out, uint64_t on_bits, uint64_t off_bits,
                 const PackedRuns& runs = {}) {
  constexpr int kVec = 16 / kBytes;
  const int64_t rows = p.batch_size * p.q_length;
  // Short rows get narrower blocks, so no thread of a block starts past the row's end.
  const int64_t chunks = (p.kv_length + kVec - 1) / kVec;
  const int threads = static_cast<int>(std::clamp<int64_t>((chunks / kUnroll + 31) / 32 * 32, 32, kThreads));
  const int64_t per_block = static_cast<int64_t>(threads) * kUnroll * kVec;
  const int64_t col_blocks = (p.kv_length + per_block - 1) / per_block;
  // About two waves of blocks (of 2048 threads per SM), each a contiguous range of rows: enough
  // blocks that the last wave leaves little idle, and long ranges that read the padding rarely
  // (two measured best of 1, 2, 4 and 8 on an H100: benchmarks/notes_attention_cuda.md).
  constexpr int64_t kWaves = 2;
  const int64_t wanted = std::max<int64_t>(1, kWaves * cuda::multiprocessor_count() * (2048 / threads) / col_blocks);
  // At least two rows per block: faster than one or four where rows are few (B=1 4096^2).
  const int64_t rows_per_block =
      std::max({int64_t{2}, (rows + wanted - 1) / wanted, (rows + kMaxGridY - 1) / kMaxGridY});
  const dim3 grid(static_cast<unsigned>(col_blocks),
                  static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block));
  Alignment aligned;
  // Row starts are 16-byte aligned when a row's bytes are (the allocation itself is).
  aligned.out = (p.kv_length * kBytes) % 16 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  aligned.padding = p.padding_mask != nullptr && p.padding_width % kVec == 0 && p.kv_offset % kVec == 0 &&
                    reinterpret_cast<uintptr_t>(p.padding_mask) % kVec == 0;
  sdpa_mask_rows_kernel<kBytes, kRule><<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<uint8_t*>(out.data_ptr()), on_bits, off_bits, aligned, runs, rows_per_block);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The runs of packed_ids (see PackedRuns), computed on the current stream into `storage`. The
// caller frees it after queuing the mask kernel: the caching allocator hands that memory out
// again only to work queued after it on the same stream.
PackedRuns packed_runs(const SdpaMaskParams& p, const at::Tensor& like, at::Tensor& storage) {
  const int64_t rows = p.batch_size, width = p.packed_width;
  const int64_t blocks = std::max<int64_t>(1, (width + kRunThreads - 1) / kRunThreads);
  const int64_t flags = rows * blocks + rows;  // decreases, then ordered (bytes)
  storage = at::empty({2 * rows * width + 2 * rows * blocks + (flags + 7) / 8}, like.options().dtype(at::kLong));
  int64_t* begin = storage.data_ptr<int64_t>();
  int64_t* end = begin + rows * width;
  RunBlocks slots{end + rows * width, end + rows * width + rows * blocks, nullptr, blocks};
  slots.decreases = reinterpret_cast<bool*>(slots.first_end + rows * blocks);
  bool* ordered = slots.decreases + rows * blocks;
  TORCH_CHECK(rows * blocks <= INT32_MAX, "sdpa_mask: packed_ids has too many positions (", rows, " x ", width, ")");
  const auto grid = static_cast<unsigned>(rows * blocks);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  packed_run_blocks_kernel<<<grid, kRunThreads, 0, stream>>>(p.packed_ids, width, slots);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  packed_runs_kernel<<<grid, kRunThreads, 0, stream>>>(p.packed_ids, width, slots, begin, end, ordered);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {begin, end, ordered};
}

template <int kBytes>
void launch_bytes(const SdpaMaskParams& p, at::Tensor& out, uint64_t on_bits, uint64_t off_bits) {
  if (p.block_ids != nullptr || p.kv_length > INT32_MAX - 64) {
    launch_rule<kBytes, RowRule::kGeneral>(p, out, on_bits, off_bits);
  } else if (p.packed_ids != nullptr) {
    at::Tensor storage;
    const PackedRuns runs = packed_runs(p, out, storage);
    launch_rule<kBytes, RowRule::kPacked>(p, out, on_bits, off_bits, runs);
  } else if (p.padding_mask != nullptr) {
    launch_rule<kBytes, RowRule::kPadding>(p, out, on_bits, off_bits);
  } else {
    launch_rule<kBytes, RowRule::kInterval>(p, out, on_bits, off_bits);
  }
}

// The raw bits of a value, zero-extended.
template <typename T>
uint64_t bits_of(T value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}

template <typename T>
void launch(const SdpaMaskParams& p, at::Tensor& out, T on, T off) {
  launch_bytes<sizeof(T)>(p, out, bits_of(on), bits_of(off));
}

// _key_ranges: a thread per query row (key_range_of_row), after the runs' pre-pass with packed ids.
__global__ void __launch_bounds__(kThreads)
    key_ranges_rows_kernel(const SdpaMaskParams p, const int64_t* __restrict__ run_begin,
                           const int64_t* __restrict__ run_end, int32_t* __restrict__ out) {
  const int64_t rows = p.batch_size * p.q_length;
  for (int64_t row = blockIdx.x * int64_t{kThreads} + threadIdx.x; row < rows; row += int64_t{gridDim.x} * kThreads) {
    key_range_of_row(p, run_begin, run_end, row / p.q_length, row % p.q_length, out + 2 * row);
  }
}

// sdpa_mask's CUDA kernel (sdpa_mask_kernel): on the named GPU (the current one when no index is
// given), its guard open while the small inputs are converted and the mask is written.
struct CudaMaskBackend {
  c10::Device device;
  cuda::OpDeviceGuard guard;

  explicit CudaMaskBackend(c10::Device where) : device(with_index(where)), guard(device) {}

  static c10::Device with_index(c10::Device where) {
    TORCH_CHECK(where.is_cuda(), "sdpa_mask: the CUDA kernel was asked to build on ", where.str());
    return where.has_index() ? where : c10::Device(c10::kCUDA, c10::cuda::current_device());
  }
  void fill(const SdpaMaskParams& params, at::Tensor& out, bool use_finfo_min) const {
    if (out.scalar_type() == at::kBool) {
      launch<bool>(params, out, true, false);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sdpa_mask_cuda", [&] {
      const scalar_t off =
          use_finfo_min ? std::numeric_limits<scalar_t>::lowest() : -std::numeric_limits<scalar_t>::infinity();
      launch<scalar_t>(params, out, scalar_t(0), off);
    });
  }
  void key_ranges(const SdpaMaskParams& params, at::Tensor& out) const {
    at::Tensor storage;  // the runs, freed after the launch is queued (stream-ordered reuse)
    const PackedRuns runs = params.packed_ids != nullptr ? packed_runs(params, out, storage) : PackedRuns{};
    const int64_t rows = params.batch_size * params.q_length;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((rows + kThreads - 1) / kThreads, 65535));
    key_ranges_rows_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(params, runs.begin, runs.end,
                                                                                       out.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(safeattn, CUDA, m) {
  m.impl("sdpa_mask", &sdpa_mask_kernel<CudaMaskBackend>);
  m.impl("_key_ranges", &key_ranges_kernel<CudaMaskBackend>);
}

}  // namespace safeattn
