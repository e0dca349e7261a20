// Generated (one file per direction, head dim and dtype; see attention_bwd.cuh): do not edit.
#define SAFEATTN_ATTN_BWD_DEFINE_KERNELS
#include "ops/cuda/attention_bwd.cuh"

namespace safeattn::cuda::attn {
template void launch_attention_bwd<__nv_bfloat16, 32>(const BwdParams&, int64_t, int64_t, bool, bool, cudaStream_t);
}  // namespace safeattn::cuda::attn
