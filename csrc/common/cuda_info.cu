// Compiled only in CUDA builds: reports what nvcc compiled, for build_info(), and what the device
// has, for the kernels' grid sizes. It also proves, in every CI run, that the CUDA toolchain path
// of the build works. Also the generic kernels' tile shapes and the decode kernel's shape rule for
// a GPU's limits, for the tests (generic_tile_shapes, decode_wave_ctas).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/cuda/generic/attention_bwd.cuh"     // generic_tile_shapes: the tile-shape rules
#include "ops/cuda/generic/attention_decode.cuh"  // decode_wave_ctas
#include "ops/cuda/generic/attention_fwd.cuh"
#include "ops/cuda/head_dim_switch.h"
#include "safeattn.h"

namespace safeattn::cuda {

std::vector<std::string> compiled_archs() {
  std::vector<std::string> archs;
#ifdef __CUDA_ARCH_LIST__
  // nvcc defines __CUDA_ARCH_LIST__ as e.g. 800,900 (arch * 10) in every compilation pass.
  for (int arch : {__CUDA_ARCH_LIST__}) {
    archs.push_back(std::to_string(arch / 10));
  }
#endif
  return archs;
}

std::vector<int64_t> generic_tile_shapes(int64_t head_dim, int64_t smem_per_block, int64_t smem_per_sm,
                                         int64_t reserved_per_block) {
  const auto block = static_cast<size_t>(smem_per_block), sm = static_cast<size_t>(smem_per_sm);
  const auto reserved = static_cast<size_t>(reserved_per_block);
  std::vector<int64_t> shapes(8, 0);
  if (has_head_dim<kFwdHeadDims>(head_dim)) {
    const bool large = attn::fwd_large_tiles(head_dim, block, sm, reserved);
    int block_q = 0, block_kv = 0;
    attn::fwd_tile_sizes(head_dim, large, block_q, block_kv);
    shapes[0] = large;
    shapes[1] = block_q;
    shapes[2] = block_kv;
    shapes[3] = static_cast<int64_t>(attn::fwd_smem_bytes(head_dim, large));
  }
  attn::BwdTileSizes tiles;
  const bool large = attn::bwd_large_tiles(head_dim, block);
  if (attn::bwd_tile_sizes(head_dim, large, tiles)) {
    shapes[4] = large;
    shapes[5] = tiles.dkdv_q;
    shapes[6] = tiles.dkdv_kv;
    shapes[7] = static_cast<int64_t>(attn::bwd_smem_bytes(head_dim, large));
  }
  return shapes;
}

int64_t decode_wave_ctas(int64_t head_dim, int64_t kv_end, int64_t batch, int64_t hkv, int64_t sms,
                         int64_t smem_per_block, bool row_pages) {
  return decode::wave_config_ctas(static_cast<int>(head_dim), kv_end, batch, hkv, sms,
                                  static_cast<size_t>(smem_per_block), row_pages);
}

std::vector<int> attention_head_dims(bool backward, bool sm90) {
  // setup.py passes the kept head dims of each family (all multiples of 16) as bits d / 16.
  const uint64_t bits =
      sm90 ? (backward ? kBwdSm90HeadDims : kFwdSm90HeadDims) : (backward ? kBwdHeadDims : kFwdHeadDims);
  std::vector<int> dims;
  for (int k = 1; k < 64; ++k) {
    if ((bits >> k) & 1u) {
      dims.push_back(16 * k);
    }
  }
  return dims;
}

int64_t multiprocessor_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

int64_t multiprocessor_count() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return multiprocessor_count(device);
}

namespace {

// Compiled for exactly the targets of every other generic kernel (this file gets the same
// -gencode flags), so whether the runtime finds an image of it for a device is whether it finds
// one of them.
__global__ void probe_kernel() {}

// Per device: 0 not checked yet, 1 the build runs there. 64 ordinals cover any CUDA host; a
// larger one is checked on every call (the check is a cheap runtime query).
std::array<std::atomic<int8_t>, 64> device_checked{};

std::string archs_built() {
  std::string list;
  for (const std::string& arch : compiled_archs()) {
    list += (list.empty() ? "sm_" : ", sm_") + arch;
  }
#ifdef SAFEATTN_WITH_SM90
  list += ", sm_90a (the Hopper kernels)";
#endif
#if SAFEATTN_CUDA_PTX_ARCH > 0
  list += ", PTX of compute_" + std::to_string(SAFEATTN_CUDA_PTX_ARCH);
#endif
  return list.empty() ? "none" : list;
}

}  // namespace

void check_device_supported(int device) {
  const bool cached = device >= 0 && device < static_cast<int>(device_checked.size());
  if (cached && device_checked[device].load(std::memory_order_relaxed)) {
    return;
  }
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, probe_kernel);
  if (status == cudaErrorNoKernelImageForDevice || status == cudaErrorInvalidDeviceFunction ||
      status == cudaErrorUnsupportedPtxVersion) {
    (void)cudaGetLastError();  // not sticky: clear it so the error below is the one reported
    cudaDeviceProp props;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
    const std::string capability = std::to_string(props.major) + "." + std::to_string(props.minor);
    TORCH_CHECK(false, "safeattn has no CUDA kernels for this GPU: ", props.name, " (cuda:", device,
                ", compute capability ", capability, "); this build holds ", archs_built(),
                (status == cudaErrorUnsupportedPtxVersion ? " (its PTX is newer than this driver)" : ""),
                ". Rebuild it for this GPU:\n    TORCH_CUDA_ARCH_LIST=\"", capability,
                "\" pip install --no-build-isolation --no-deps --no-cache-dir --force-reinstall safeattn\n"
                "(in a source tree: TORCH_CUDA_ARCH_LIST=\"",
                capability, "\" pip install --no-build-isolation --no-deps -e .)");
  }
  C10_CUDA_CHECK(status);
  if (cached) {
    device_checked[device].store(1, std::memory_order_relaxed);
  }
}

namespace {
std::atomic<bool> generic_only{false};
}  // namespace

void set_generic_kernels_only(bool on) {
  generic_only.store(on);
}

bool generic_kernels_only() {
  return generic_only.load(std::memory_order_relaxed);
}

bool hopper_kernels_built() {
#ifdef SAFEATTN_WITH_SM90
  return true;
#else
  return false;
#endif
}

std::string toolkit_version() {
  // No iostreams in .cu files: on some hosts nvcc's host pass pulls in a second copy of them.
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
}

}  // namespace safeattn::cuda
