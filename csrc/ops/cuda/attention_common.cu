// Host helpers shared by the CUDA attention forward and backward (see attention_common.cuh).
#include "ops/cuda/attention_common.cuh"

#include <c10/util/Exception.h>

namespace safeattn::cuda::attn {

MaskView make_mask_view(const at::Tensor& mask) {
  MaskView view;
  if (!mask.defined()) {
    return view;
  }
  TORCH_INTERNAL_ASSERT(mask.dim() == 4, "attention (CUDA): the mask view must be 4-D");
  switch (mask.scalar_type()) {
    case at::kBool:
      view.kind = MaskKind::kBool;
      break;
    case at::kFloat:
      view.kind = MaskKind::kFloat;
      break;
    case at::kHalf:
      view.kind = MaskKind::kHalf;
      break;
    case at::kBFloat16:
      view.kind = MaskKind::kBFloat16;
      break;
    default:
      TORCH_CHECK(false, "attention (CUDA): attn_mask of dtype ", mask.scalar_type(), " has no CUDA kernel");
  }
  view.ptr = mask.data_ptr();
  view.stride_b = mask.stride(0);
  view.stride_h = mask.stride(1);
  view.stride_q = mask.stride(2);
  view.stride_kv = mask.stride(3);
  return view;
}

}  // namespace safeattn::cuda::attn
