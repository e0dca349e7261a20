// The Hopper (sm_90a) backward of safeattn::attention: TMA + wgmma + warp-specialised kernels on
// CuTe (ops/cuda/hopper/), present when the build found the CUTLASS headers and targets sm_90
// (setup.py defines SAFEATTN_WITH_SM90 then).
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/attention.h"

namespace safeattn::cuda {

// Computes grad_query, grad_key and grad_value on the Hopper kernel and returns true when that
// kernel takes the call: an sm_90 device, float16 / bfloat16, D == Dv with a compiled head dim
// (head_dim_switch.h, kBwdSm90HeadDims), no mask or a bool one, no softcap, all three gradients wanted, sizes
// below 2^31. dQ is summed by float32 reduce-adds in no fixed order (not bit-reproducible): the
// caller asks only when atomics are allowed. delta and row_shift are the rows pre-pass's ([B, Hq,
// Q] float32 contiguous, row_shift in log2 units, +inf for a row with no visible key). Returns
// false, having done nothing, otherwise: the caller takes another path.
bool attention_bwd_sm90(const AttentionBwdArgs& args, const at::Tensor& delta, const at::Tensor& row_shift);

}  // namespace safeattn::cuda
