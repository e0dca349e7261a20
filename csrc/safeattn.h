// What this build of safeattn holds: version, the torch it was built against, CPU ISA
// variants and CUDA architectures. (Which ops have which kernels is read from the dispatcher
// in Python: safeattn.build_info().)
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace safeattn {

struct BuildInfo {
  std::string version;
  std::string torch_version;                   // the torch headers this was compiled against
  std::vector<std::string> cpu_isas;           // variants compiled (DEFAULT, AVX2, AVX512)
  std::vector<std::string> cpu_isas_runnable;  // those this CPU executes
  std::string cpu_isa_in_use;                  // the variant this CPU runs (honours ATEN_CPU_CAPABILITY)
  bool with_cuda = false;
  std::string cuda_version;             // CUDA toolkit the kernels were compiled with
  std::vector<std::string> cuda_archs;  // e.g. "90"
  // Head dims of the bf16/fp16 tensor-core attention kernels compiled (the others, and float32 /
  // float64, take the chunked ATen path on the GPU, ops/attention_composite.h).
  std::vector<int> attention_fwd_head_dims;
  std::vector<int> attention_bwd_head_dims;
  // Of those, the ones with sm_90a kernels (TMA + wgmma), used on sm_90 devices.
  std::vector<int> attention_sm90_fwd_head_dims;
  std::vector<int> attention_sm90_bwd_head_dims;
};

BuildInfo build_info();

// How many threads at::parallel_for gives a loop of many items here: at::get_num_threads()
// (torch.set_num_threads) when this library was compiled with OpenMP, 1 without it (ATen's
// parallel_for then runs the loop inline: its OpenMP region is in the headers). The CPU kernels
// are compiled with the same flags.
int cpu_parallel_threads();

#ifdef SAFEATTN_WITH_CUDA
namespace cuda {
// From nvcc's __CUDA_ARCH_LIST__ and CUDART_VERSION (csrc/common/cuda_info.cu).
std::vector<std::string> compiled_archs();
std::string toolkit_version();
// The head dims of the tensor-core attention kernels compiled, per direction (sm90: the sm_90a
// kernels').
std::vector<int> attention_head_dims(bool backward, bool sm90);
// Raises a clear error (the GPU, its compute capability, the archs built, the rebuild command)
// when this build has no code that runs on the device, instead of CUDA's "no kernel image is
// available" from the first launch. Every CUDA op calls it first; after one success per device
// it is an atomic load.
void check_device_supported(int device);
// Whether the sm_90a kernels (TMA + wgmma) are in this build.
bool hopper_kernels_built();
// Private to the tests and benchmarks (safeattn._C._set_generic_kernels_only): while on,
// attention on an H100/H200 runs the generic kernels that A100 / Ada / Blackwell GPUs run, so they
// can be tested and measured on the Hopper GPUs at hand. Process-wide; not a user setting.
void set_generic_kernels_only(bool on);
bool generic_kernels_only();
// Private to the tests (safeattn._C._generic_tile_shapes): the generic kernels' tile shapes for
// head dim d on a GPU with these shared-memory limits (bytes), as attention's forward and backward
// choose them: {forward large (0 / 1), its query tile, key tile, shared bytes, dK/dV large, its
// query tile, key tile, the backward's shared bytes}, zeros for a direction without d.
std::vector<int64_t> generic_tile_shapes(int64_t head_dim, int64_t smem_per_block, int64_t smem_per_sm,
                                         int64_t reserved_per_block);
// Private to the tests (safeattn._C._decode_wave_ctas): the CTAs an SM of the wave shape
// (DecodeWaveShape) a decode step of head dim d over kv_end keys with batch x hkv (batch, kv head)
// pairs takes on a GPU with `sms` SMs and `smem_per_block` bytes of shared memory a block, over a
// paged cache whose pages are shorter than a key tile (`row_pages`) or another one, 0 for the
// default shape (decode::wave_config_ctas).
int64_t decode_wave_ctas(int64_t head_dim, int64_t kv_end, int64_t batch, int64_t hkv, int64_t sms,
                         int64_t smem_per_block, bool row_pages);
// Streaming multiprocessors of a device (the current one by default), for grid sizes.
int64_t multiprocessor_count(int device);
int64_t multiprocessor_count();
}  // namespace cuda
#endif

}  // namespace safeattn
