// The Hopper (sm_90a) forward of safeattn::attention: TMA + wgmma + warp-specialised kernels on
// CuTe (ops/cuda/hopper/), present when the build found the CUTLASS headers and targets sm_90
// (setup.py defines SAFEATTN_WITH_SM90 then).
#pragma once

#include "ops/attention.h"

namespace safeattn::cuda {

// Runs the forward on the Hopper kernel and returns true when that kernel takes the call: an
// sm_90 device, float16 / bfloat16, D == Dv with a compiled head dim (SAFEATTN_ATTN_FWD_SM90_D<D>),
// no mask or a bool one, no sinks, no softcap, sizes below 2^31. Inputs whose rows TMA cannot
// read in place are copied to aligned rows first. Returns false, having done nothing, otherwise: the caller takes
// another path.
bool attention_fwd_sm90(const AttentionFwdArgs& args);

}  // namespace safeattn::cuda
