// The Hopper (sm_90a) forward of safeattn::attention: TMA + wgmma + warp-specialised kernels on
// CuTe (ops/cuda/hopper/), present when the build found the CUTLASS headers and targets sm_90
// (setup.py defines SAFEATTN_WITH_SM90 then).
#pragma once

#include "ops/attention.h"

namespace safeattn::cuda {

// Why the Hopper kernel cannot take the call (a static string), or nullptr when it can: the
// conditions are in the code, each with its reason (sm90_inputs_rejects holds those both
// directions share). Masks of either kind, key ranges, softcap and sinks are all read; inputs
// whose rows TMA cannot read in place are copied to aligned rows first. Asked by the chooser
// (attention_choice.h); a build without the Hopper kernels always says so.
const char* attention_fwd_sm90_rejects(const AttentionFwdArgs& args);

// Runs the forward on the Hopper kernel; only where attention_fwd_sm90_rejects(args) is nullptr.
void attention_fwd_sm90(const AttentionFwdArgs& args);

}  // namespace safeattn::cuda
