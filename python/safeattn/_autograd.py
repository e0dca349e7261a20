"""Autograd registrations (``torch.library.register_autograd``) of the differentiable ops.

``sdpa_mask`` has no gradient: its Autograd kernel is PyTorch's not-implemented fallback,
registered in C++ (csrc/ops/sdpa_mask.cpp).
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


# ---------------------------------------------------------------------------------------------
# attention: the backward is the private op safeattn::_attention_backward (recomputes the
# probabilities from lse; gradients for query, key, value, a float mask that requires grad, and
# sinks; a gradient flowing into lse is folded in).
#
# torch.library.register_autograd refuses ops with keyword-only tensor arguments (`sinks` is
# one, and the schema is shared with other backends), so the Autograd kernel is registered the
# way register_autograd does it internally: a Python kernel on the Autograd key that wraps an
# autograd.Function whose forward redispatches below autograd. torch.compile traces it as one
# opaque op forward and one opaque op backward.


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        keyset,
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        q_offset,
        kv_offset,
        softcap,
        sinks,
    ):
        with torch._C._AutoDispatchBelowAutograd():
            out, lse = torch.ops.safeattn.attention.default.redispatch(
                keyset & torch._C._after_autograd_keyset,
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                q_offset=q_offset,
                kv_offset=kv_offset,
                softcap=softcap,
                sinks=sinks,
            )
        ctx.save_for_backward(query, key, value, attn_mask, sinks, out, lse)
        # An unused lse gets None rather than a materialised zero gradient (one pass saved).
        ctx.set_materialize_grads(False)
        ctx.is_causal = is_causal
        ctx.scale = scale  # None stays None: the backward op resolves it (no guard on the head dim)
        ctx.q_offset = q_offset
        ctx.kv_offset = kv_offset
        ctx.softcap = softcap
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, attn_mask, sinks, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_mask_needed = attn_mask is not None and ctx.needs_input_grad[4]
        grad_query, grad_key, grad_value, grad_mask, grad_sinks = torch.ops.safeattn._attention_backward(
            grad_out,
            grad_lse,
            query,
            key,
            value,
            out,
            lse,
            attn_mask,
            ctx.is_causal,
            ctx.scale,
            ctx.q_offset,
            ctx.kv_offset,
            ctx.softcap,
            sinks,
            grad_mask_needed,
        )
        return (
            None,
            grad_query,
            grad_key,
            grad_value,
            grad_mask if grad_mask_needed else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            grad_sinks if sinks is not None and ctx.needs_input_grad[12] else None,
        )


def _attention_autograd(
    keyset,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    q_offset=0,
    kv_offset=0,
    softcap=0.0,
    sinks=None,
):
    return _AttentionFunction.apply(
        keyset,
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        q_offset,
        kv_offset,
        softcap,
        sinks,
    )


_lib = torch.library.Library("safeattn", "FRAGMENT")  # kept alive: owns the registration
_lib.impl("attention", _attention_autograd, "Autograd", with_keyset=True)
