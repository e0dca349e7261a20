"""Fake (meta) implementations: output shapes and dtypes with symbolic sizes, and the same
argument checks as the C++ kernels (same messages), so ``torch.compile`` and
``torch.library.opcheck`` see one opaque node that fails as eagerly as the real op.
"""

from __future__ import annotations

import math
import struct

import torch

# c10's names for dtypes, as the C++ checks print them.
_C10_NAMES = {
    torch.bool: "Bool",
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float32: "Float",
    torch.float64: "Double",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype))


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def common_device(op: str, device, named: dict) -> torch.device:
    """The device all tensor arguments share (see csrc/common/checks.h)."""
    found, found_from = device, "device"
    for name, t in named.items():
        if t is None:
            continue
        if found is None:
            found, found_from = t.device, name
            continue
        same = t.device.type == found.type and (found.index is None or t.device.index == found.index)
        torch._check(
            same,
            lambda name=name, t=t, found=found, found_from=found_from: (
                f"{op}: {name} is on {t.device}, expected {found} (from {found_from})"
            ),
        )
    return found if found is not None else torch.device("cpu")


def _check_ids(op, ids, name, batch_size):
    if ids is None:
        return
    torch._check(
        _is_integer(ids.dtype),
        lambda: f"{op}: {name} must have an integer dtype, got {dtype_name(ids.dtype)}",
    )
    torch._check(ids.dim() == 2, lambda: f"{op}: {name} must be 2-D [batch_size, length], got {ids.dim()}-D")
    torch._check(
        ids.shape[0] == batch_size,
        lambda: f"{op}: {name} has batch {ids.shape[0]} but batch_size is {batch_size}",
    )


@torch.library.register_fake("safeattn::sdpa_mask")
def _sdpa_mask_fake(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    *,
    q_positions=None,
    causal=True,
    sliding_window=None,
    chunk_size=None,
    chunk_left_padding=None,
    padding_mask=None,
    packed_ids=None,
    block_ids=None,
    dtype=None,
    use_finfo_min=False,
    device=None,
):
    op = "sdpa_mask"
    torch._check(batch_size >= 0, lambda: f"{op}: batch_size must be >= 0, got {batch_size}")
    torch._check(q_length >= 0, lambda: f"{op}: q_length must be >= 0, got {q_length}")
    torch._check(kv_length >= 0, lambda: f"{op}: kv_length must be >= 0, got {kv_length}")
    torch._check(q_offset >= 0, lambda: f"{op}: q_offset must be >= 0, got {q_offset}")
    torch._check(kv_offset >= 0, lambda: f"{op}: kv_offset must be >= 0, got {kv_offset}")
    max_position = 2**63 - 1
    torch._check(
        q_offset <= max_position - q_length,
        lambda: f"{op}: q_offset + q_length must be <= 2**63 - 1, got {q_offset} + {q_length}",
    )
    torch._check(
        kv_offset <= max_position - kv_length,
        lambda: f"{op}: kv_offset + kv_length must be <= 2**63 - 1, got {kv_offset} + {kv_length}",
    )
    torch._check(
        sliding_window is None or sliding_window > 0,
        lambda: f"{op}: sliding_window must be > 0, got {sliding_window}",
    )
    torch._check(
        chunk_size is None or chunk_size > 0, lambda: f"{op}: chunk_size must be > 0, got {chunk_size}"
    )
    out_dtype = torch.bool if dtype is None else dtype
    torch._check(
        out_dtype == torch.bool or out_dtype.is_floating_point,
        lambda: f"{op}: dtype must be torch.bool or a floating dtype, got {dtype_name(out_dtype)}",
    )
    torch._check(
        not use_finfo_min or out_dtype != torch.bool, lambda: f"{op}: use_finfo_min needs a floating dtype"
    )
    if q_positions is not None:
        pos = q_positions
        torch._check(
            _is_integer(pos.dtype),
            lambda: f"{op}: q_positions must have an integer dtype, got {dtype_name(pos.dtype)}",
        )
        torch._check(
            pos.dim() <= 2,
            lambda: f"{op}: q_positions must be 0-D, [q_length] or [batch_size, q_length], got {pos.dim()}-D",
        )
        if pos.dim() == 1:
            torch._check(
                pos.shape[0] == q_length,
                lambda: f"{op}: q_positions has {pos.shape[0]} positions but q_length is {q_length}",
            )
        if pos.dim() == 2:
            torch._check(
                pos.shape[0] == batch_size and pos.shape[1] == q_length,
                lambda: f"{op}: q_positions must be [batch_size, q_length] = [{batch_size}, {q_length}], got {_shape(pos)}",
            )
        torch._check(
            q_offset == 0, lambda: f"{op}: q_offset must be 0 when q_positions is given, got {q_offset}"
        )
    if chunk_left_padding is not None:
        pad = chunk_left_padding
        torch._check(chunk_size is not None, lambda: f"{op}: chunk_left_padding needs chunk_size")
        torch._check(
            _is_integer(pad.dtype),
            lambda: f"{op}: chunk_left_padding must have an integer dtype, got {dtype_name(pad.dtype)}",
        )
        torch._check(
            pad.dim() == 1 and pad.shape[0] == batch_size,
            lambda: f"{op}: chunk_left_padding must be [batch_size] = [{batch_size}], got {_shape(pad)}",
        )
    if padding_mask is not None:
        pad = padding_mask
        torch._check(
            pad.dtype == torch.bool or _is_integer(pad.dtype),
            lambda: f"{op}: padding_mask must be bool or integer, got {dtype_name(pad.dtype)}",
        )
        torch._check(
            pad.dim() == 2, lambda: f"{op}: padding_mask must be 2-D [batch_size, length], got {pad.dim()}-D"
        )
        torch._check(
            pad.shape[0] == batch_size,
            lambda: f"{op}: padding_mask has batch {pad.shape[0]} but batch_size is {batch_size}",
        )
    _check_ids(op, packed_ids, "packed_ids", batch_size)
    if packed_ids is not None:
        needed = (
            kv_offset + kv_length
            if q_positions is not None
            else torch.sym_max(kv_offset + kv_length, q_offset + q_length)
        )
        torch._check(
            packed_ids.shape[1] >= needed,
            lambda: f"{op}: packed_ids is too short: {packed_ids.shape[1]} positions, needs {needed}",
        )
    _check_ids(op, block_ids, "block_ids", batch_size)
    where = common_device(
        op,
        device,
        {
            "q_positions": q_positions,
            "chunk_left_padding": chunk_left_padding,
            "padding_mask": padding_mask,
            "packed_ids": packed_ids,
            "block_ids": block_ids,
        },
    )
    return torch.empty((batch_size, 1, q_length, kv_length), dtype=out_dtype, device=where)


# ---- softmax family (csrc/ops/softmax.cpp) ---------------------------------------------

_SOFTMAX_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_softmax_float(op, name, dtype):
    torch._check(
        dtype in _SOFTMAX_FLOATS,
        lambda: f"{op}: {name} must be Float, Double, Half or BFloat16, got {dtype_name(dtype)}",
    )


def _wrap_softmax_dim(op, dim, ndim):
    n = max(ndim, 1)
    torch._check(
        -n <= dim < n,
        lambda: f"{op}: dim {dim} is out of range for a {ndim}-D tensor (expected in [{-n}, {n - 1}])",
    )
    return dim + n if dim < 0 else dim


def _check_softmax_backward_pair(op, grad_out, out):
    _check_softmax_float(op, "out", out.dtype)
    _check_softmax_float(op, "grad_out", grad_out.dtype)
    torch._check(
        grad_out.shape == out.shape,
        lambda: f"{op}: grad_out has shape {_shape(grad_out)} but out has shape {_shape(out)}",
    )
    common_device(op, None, {"grad_out": grad_out, "out": out})


def _check_softmax_mask(op, mask, against_name, against):
    """csrc/ops/softmax.cpp: check_mask."""
    if mask is None:
        return
    torch._check(
        mask.dtype == torch.bool or mask.dtype in _SOFTMAX_FLOATS,
        lambda: f"{op}: mask must be Bool or a floating dtype (Float, Double, Half, BFloat16), got {dtype_name(mask.dtype)}",
    )
    broadcastable = mask.dim() <= against.dim()
    if broadcastable:
        for k in range(1, mask.dim() + 1):
            broadcastable = broadcastable and (mask.shape[-k] == 1 or mask.shape[-k] == against.shape[-k])
    torch._check(
        broadcastable,
        lambda: f"{op}: mask of shape {_shape(mask)} is not broadcastable to {against_name} of shape {_shape(against)}",
    )
    common_device(op, None, {against_name: against, "mask": mask})


@torch.library.register_fake("safeattn::safe_softmax")
def _safe_softmax_fake(self, dim, dtype=None):
    op = "safe_softmax"
    _check_softmax_float(op, "self", self.dtype)
    if dtype is not None:
        _check_softmax_float(op, "dtype", dtype)
    _wrap_softmax_dim(op, dim, self.dim())
    return torch.empty(self.shape, dtype=self.dtype if dtype is None else dtype, device=self.device)


@torch.library.register_fake("safeattn::_safe_softmax_backward")
def _safe_softmax_backward_fake(grad_out, out, dim, input_dtype):
    op = "_safe_softmax_backward"
    _check_softmax_backward_pair(op, grad_out, out)
    _check_softmax_float(op, "input_dtype", input_dtype)
    _wrap_softmax_dim(op, dim, out.dim())
    return torch.empty(out.shape, dtype=input_dtype, device=out.device)


@torch.library.register_fake("safeattn::masked_softmax")
def _masked_softmax_fake(scores, mask=None, scale=1.0, dim=-1, dtype=None):
    op = "masked_softmax"
    _check_softmax_float(op, "scores", scores.dtype)
    if dtype is not None:
        _check_softmax_float(op, "dtype", dtype)
    _wrap_softmax_dim(op, dim, scores.dim())
    _check_softmax_mask(op, mask, "scores", scores)
    return torch.empty(scores.shape, dtype=scores.dtype if dtype is None else dtype, device=scores.device)


@torch.library.register_fake("safeattn::_masked_softmax_backward")
def _masked_softmax_backward_fake(grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad):
    op = "_masked_softmax_backward"
    _check_softmax_backward_pair(op, grad_out, out)
    _check_softmax_float(op, "input_dtype", input_dtype)
    _wrap_softmax_dim(op, dim, out.dim())
    torch._check(
        not mask_requires_grad or (mask is not None and mask.dtype.is_floating_point),
        lambda: f"{op}: mask_requires_grad needs a floating mask",
    )
    _check_softmax_mask(op, mask, "out", out)
    grad_scores = torch.empty(out.shape, dtype=input_dtype, device=out.device)
    if mask_requires_grad:
        grad_mask = torch.empty(mask.shape, dtype=mask.dtype, device=out.device)
    else:
        grad_mask = torch.empty((0,), dtype=out.dtype, device=out.device)
    return grad_scores, grad_mask


# ---------------------------------------------------------------------------------------------
# attention (csrc/ops/attention.cpp: check_attention)

_ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _check_attention(
    query, key, value, attn_mask, dropout_p, enable_gqa, softcap, sinks, scale=None, op="attention"
):
    torch._check(
        query.dim() == 4,
        lambda: f"{op}: query must be 4-D [batch, heads, q_length, head_dim], got {query.dim()}-D",
    )
    torch._check(
        key.dim() == 4,
        lambda: f"{op}: key must be 4-D [batch, kv_heads, kv_length, head_dim], got {key.dim()}-D",
    )
    torch._check(
        value.dim() == 4,
        lambda: f"{op}: value must be 4-D [batch, kv_heads, kv_length, head_dim_v], got {value.dim()}-D",
    )
    torch._check(
        query.dtype in _ATTENTION_DTYPES,
        lambda: f"{op}: query must have dtype Float, Half, BFloat16 or Double, got {dtype_name(query.dtype)}",
    )
    torch._check(
        key.dtype == query.dtype,
        lambda: f"{op}: key has dtype {dtype_name(key.dtype)} but query has {dtype_name(query.dtype)}",
    )
    torch._check(
        value.dtype == query.dtype,
        lambda: f"{op}: value has dtype {dtype_name(value.dtype)} but query has {dtype_name(query.dtype)}",
    )
    common_device(
        op, None, {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "sinks": sinks}
    )
    torch._check(
        key.shape[0] == query.shape[0],
        lambda: f"{op}: key has batch {key.shape[0]} but query has {query.shape[0]}",
    )
    torch._check(
        value.shape[0] == query.shape[0],
        lambda: f"{op}: value has batch {value.shape[0]} but query has {query.shape[0]}",
    )
    torch._check(
        value.shape[1] == key.shape[1],
        lambda: f"{op}: value has {value.shape[1]} heads but key has {key.shape[1]}",
    )
    torch._check(
        value.shape[2] == key.shape[2],
        lambda: f"{op}: value has kv_length {value.shape[2]} but key has {key.shape[2]}",
    )
    torch._check(
        key.shape[3] == query.shape[3],
        lambda: f"{op}: key has head_dim {key.shape[3]} but query has {query.shape[3]}",
    )
    torch._check(query.shape[3] > 0, lambda: f"{op}: query head_dim must be > 0")
    torch._check(value.shape[3] > 0, lambda: f"{op}: value head_dim must be > 0")
    hq, hkv = query.shape[1], key.shape[1]
    if enable_gqa:
        torch._check(
            hkv > 0 and hq % hkv == 0,
            lambda: f"{op}: query heads ({hq}) must be a multiple of key/value heads ({hkv})",
        )
    else:
        torch._check(
            hq == hkv,
            lambda: (
                f"{op}: query has {hq} heads but key and value have {hkv}; pass enable_gqa=True for grouped-query attention"
            ),
        )
    torch._check(
        dropout_p == 0.0, lambda: f"{op}: dropout_p must be 0 (dropout is not implemented), got {dropout_p}"
    )
    acc_is_double = query.dtype == torch.float64
    in_acc = "" if acc_is_double else " in float32"

    def finite_in_acc(x):
        return math.isfinite(x) and (acc_is_double or abs(x) <= _FLOAT32_MAX)

    def positive_in_acc(x):
        return acc_is_double or struct.unpack("f", struct.pack("f", x))[0] > 0.0

    torch._check(
        softcap == 0.0 or (softcap > 0.0 and finite_in_acc(softcap) and positive_in_acc(softcap)),
        lambda: f"{op}: softcap must be 0 (none) or a finite positive number{in_acc}, got {softcap}",
    )
    torch._check(
        scale is None or finite_in_acc(scale),
        lambda: f"{op}: scale must be a finite number{in_acc}, got {scale}",
    )
    if attn_mask is not None:
        m = attn_mask
        torch._check(
            m.dtype in (torch.bool, torch.float32, query.dtype),
            lambda: (
                f"{op}: attn_mask must be Bool, Float or the query dtype ({dtype_name(query.dtype)}), got {dtype_name(m.dtype)}"
            ),
        )
        torch._check(2 <= m.dim() <= 4, lambda: f"{op}: attn_mask must be 2-D, 3-D or 4-D, got {m.dim()}-D")
        target = (query.shape[0], hq, query.shape[2], key.shape[2])
        for d in range(m.dim()):
            size, want = m.shape[m.dim() - 1 - d], target[3 - d]
            torch._check(
                size == 1 or size == want,
                lambda: (
                    f"{op}: attn_mask of shape {_shape(m)} is not broadcastable to [batch, heads, q_length, kv_length] = "
                    f"[{target[0]}, {target[1]}, {target[2]}, {target[3]}]"
                ),
            )
    if sinks is not None:
        torch._check(
            sinks.dtype.is_floating_point,
            lambda: f"{op}: sinks must have a floating dtype, got {dtype_name(sinks.dtype)}",
        )
        torch._check(
            sinks.dim() == 1 and sinks.shape[0] == hq,
            lambda: f"{op}: sinks must be [num_heads] = [{hq}], got {_shape(sinks)}",
        )


def _attention_acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("safeattn::attention")
def _attention_fake(
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
    _check_attention(query, key, value, attn_mask, dropout_p, enable_gqa, softcap, sinks, scale)
    batch, heads, q_length = query.shape[0], query.shape[1], query.shape[2]
    # Same strides as the kernel: stored [B, Q, H, Dv], returned as the [B, H, Q, Dv] view.
    out = query.new_empty((batch, q_length, heads, value.shape[3])).transpose(1, 2)
    lse = query.new_empty((batch, heads, q_length), dtype=_attention_acc_dtype(query.dtype))
    return out, lse


@torch.library.register_fake("safeattn::_attention_forward")
def _attention_forward_fake(
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
    out, lse = _attention_fake(
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
    return out, lse, torch.empty_like(lse)


def _check_attention_backward(
    grad_out,
    grad_lse,
    query,
    key,
    value,
    out,
    lse,
    attn_mask,
    scale,
    softcap,
    sinks,
    grad_mask_needed,
    lse_lo,
):
    """csrc/ops/attention.cpp: check_attention_backward."""
    op = "_attention_backward"
    _check_attention(query, key, value, attn_mask, 0.0, True, softcap, sinks, scale, op=op)
    common_device(
        op,
        query.device,
        {"grad_out": grad_out, "grad_lse": grad_lse, "out": out, "lse": lse, "lse_lo": lse_lo},
    )
    out_shape = (query.shape[0], query.shape[1], query.shape[2], value.shape[3])
    row_shape = out_shape[:3]

    def shape_str(shape):
        return "[" + ", ".join(str(d) for d in shape) + "]"

    torch._check(
        tuple(out.shape) == out_shape,
        lambda: f"{op}: out must be [batch, heads, q_length, head_dim_v] = {shape_str(out_shape)}, got {_shape(out)}",
    )
    torch._check(
        out.dtype == query.dtype,
        lambda: f"{op}: out has dtype {dtype_name(out.dtype)} but query has {dtype_name(query.dtype)}",
    )
    torch._check(
        grad_out.shape == out.shape,
        lambda: f"{op}: grad_out has shape {_shape(grad_out)} but out has {_shape(out)}",
    )
    torch._check(
        grad_out.dtype == query.dtype,
        lambda: f"{op}: grad_out has dtype {dtype_name(grad_out.dtype)} but query has {dtype_name(query.dtype)}",
    )
    for name, t in (("lse", lse), ("lse_lo", lse_lo), ("grad_lse", grad_lse)):
        if t is None:
            continue
        torch._check(
            t.dtype.is_floating_point,
            lambda name=name, t=t: f"{op}: {name} must have a floating dtype, got {dtype_name(t.dtype)}",
        )
        torch._check(
            tuple(t.shape) == row_shape,
            lambda name=name, t=t: (
                f"{op}: {name} must be [batch, heads, q_length] = {shape_str(row_shape)}, got {_shape(t)}"
            ),
        )
    torch._check(
        not grad_mask_needed or attn_mask is None or attn_mask.dtype.is_floating_point,
        lambda: f"{op}: grad_mask_needed needs a floating attn_mask (a bool mask has no gradient)",
    )


@torch.library.register_fake("safeattn::_attention_backward")
def _attention_backward_fake(
    grad_out,
    grad_lse,
    query,
    key,
    value,
    out,
    lse,
    attn_mask,
    is_causal,
    scale,
    q_offset,
    kv_offset,
    softcap,
    sinks,
    grad_mask_needed,
    lse_lo=None,
):
    _check_attention_backward(
        grad_out,
        grad_lse,
        query,
        key,
        value,
        out,
        lse,
        attn_mask,
        scale,
        softcap,
        sinks,
        grad_mask_needed,
        lse_lo,
    )
    grad_mask = (
        attn_mask.new_empty(attn_mask.shape)
        if attn_mask is not None and grad_mask_needed
        else query.new_empty((0,))
    )
    grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty((0,))
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        grad_mask,
        grad_sinks,
    )
