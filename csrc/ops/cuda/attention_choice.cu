// choose_attention_fwd and choose_attention_bwd (attention_choice.h): the order of the CUDA
// attention kernels, and the registration of the CUDA chooser for attention_path.
#include "ops/cuda/attention_choice.h"

#include <ATen/Context.h>

#include "ops/cuda/attention_decode.h"
#include "ops/cuda/generic/mma_sync.cuh"
#include "ops/cuda/hopper/attention_bwd_sm90.h"
#include "ops/cuda/hopper/attention_fwd_sm90.h"

namespace safeattn::cuda {
namespace {

// The paths after the sm_90a kernels, in both directions: the mma.sync kernels (unless
// `mma_sync_reason`), which read key ranges beside no mask or a bool one (kMmaSyncReadsKeyRanges,
// mma_sync.cuh;
// their tile summary ANDs the two, summarize_key_ranges) and get them drawn into a floating mask;
// else the chunked ATen ops, with the key ranges drawn into the mask.
AttentionChoice offer_generic(AttentionChoice& choice, const at::Tensor& key_ranges, const at::Tensor& mask,
                              const char* mma_sync_reason) {
  if (choice.offer(AttentionPath::kMmaSync, mma_sync_reason)) {
    const bool reads = attn::kMmaSyncReadsKeyRanges && (!mask.defined() || mask.scalar_type() == at::kBool);
    choice.draw_key_ranges = key_ranges.defined() && !reads;
  } else {
    choice.offer(AttentionPath::kChunkedAten, nullptr);
    choice.draw_key_ranges = key_ranges.defined();
  }
  return choice;
}

// Under deterministic algorithms the sm_90a backward takes dQ from its dQ pass, but a mask gradient
// summed over broadcast dims in the kernel (kSumBroadcast) is still added with float atomics: it
// runs only where it is bit-reproducible.
const char* sm90_bwd_rejects(const AttentionBwdArgs& args) {
  if (const char* reason = attention_bwd_sm90_rejects(args)) {
    return reason;
  }
  if (at::globalContext().deterministicAlgorithms() && !attention_bwd_sm90_deterministic(args)) {
    return "deterministic algorithms are on, and it sums dQ (or the mask gradient) with atomics here";
  }
  return nullptr;
}

}  // namespace

AttentionChoice choose_attention_fwd(const AttentionFwdArgs& args) {
  AttentionChoice choice;
  // decode and sm90a read key ranges; the kernels after them as offer_generic says.
  if (choice.offer(AttentionPath::kDecode, attention_fwd_decode_rejects(args)) ||
      choice.offer(AttentionPath::kSm90a, attention_fwd_sm90_rejects(args))) {
    return choice;
  }
  return offer_generic(choice, args.key_ranges, args.mask, attention_fwd_mma_sync_rejects(args));
}

AttentionChoice choose_attention_bwd(const AttentionBwdArgs& args) {
  AttentionChoice choice;
  if (choice.offer(AttentionPath::kSm90a, sm90_bwd_rejects(args))) {
    return choice;
  }
  return offer_generic(choice, args.key_ranges, args.mask, attention_bwd_mma_sync_rejects(args));
}

bool attention_bwd_sums_broadcast(const AttentionBwdArgs& args) {
  return choose_attention_bwd(args).path == AttentionPath::kSm90a;
}

namespace {

// For attention_path (ops/attention_choice.h); the backward entry point
// (attention_bwd_kernel.cu) passes attention_bwd_sums_broadcast too.
[[maybe_unused]] const bool registered = [] {
  register_attention_chooser(c10::DeviceType::CUDA,
                             {&choose_attention_fwd, &choose_attention_bwd, &attention_bwd_sums_broadcast});
  return true;
}();

}  // namespace

}  // namespace safeattn::cuda
