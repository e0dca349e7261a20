"""Autograd registrations (``torch.library.register_autograd``) of the softmax ops.

``attention``'s Autograd kernel is C++ (csrc/ops/attention.cpp, AttentionFunction): its twelve
arguments made a Python kernel cost more than the op itself on small problems. ``sdpa_mask`` has
no gradient: its Autograd kernel is PyTorch's not-implemented fallback, registered in C++
(csrc/ops/sdpa_mask.cpp).
"""

from __future__ import annotations

import torch

# ---- softmax family ----------------------------------------------------------------------
# The backward math is its own op (_safe_softmax_backward, _masked_softmax_backward), so the
# backward stays one opaque node under torch.compile. Those ops have no derivative: double
# backward raises "derivative for safeattn::_..._backward is not implemented".


def _safe_softmax_setup_context(ctx, inputs, output):
    self, dim, _dtype = inputs
    ctx.dim = dim
    ctx.input_dtype = self.dtype
    ctx.save_for_backward(output)


def _safe_softmax_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return torch.ops.safeattn._safe_softmax_backward(grad, out, ctx.dim, ctx.input_dtype), None, None


torch.library.register_autograd(
    "safeattn::safe_softmax", _safe_softmax_backward, setup_context=_safe_softmax_setup_context
)


def _masked_softmax_setup_context(ctx, inputs, output):
    scores, mask, scale, dim, _dtype = inputs
    ctx.scale = scale
    ctx.dim = dim
    ctx.input_dtype = scores.dtype
    # The mask is saved for its shape and dtype (the bias gradient is reduced to them); saving
    # an input copies nothing.
    ctx.save_for_backward(output, mask)


def _masked_softmax_backward(ctx, grad):
    out, mask = ctx.saved_tensors
    mask_requires_grad = bool(mask is not None and ctx.needs_input_grad[1])
    grad_scores, grad_mask = torch.ops.safeattn._masked_softmax_backward(
        grad, out, mask, ctx.scale, ctx.dim, ctx.input_dtype, mask_requires_grad
    )
    return (
        grad_scores if ctx.needs_input_grad[0] else None,
        grad_mask if mask_requires_grad else None,
        None,
        None,
        None,
    )


torch.library.register_autograd(
    "safeattn::masked_softmax", _masked_softmax_backward, setup_context=_masked_softmax_setup_context
)
