"""Slow, obviously-correct references used by the tests and benchmarks.

They evaluate each formula of DESIGN.md on broadcast index grids (masks) or in float64
(softmax, attention), sharing no code with the kernels.
"""

from __future__ import annotations

import torch


def sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    *,
    q_positions: torch.Tensor | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    chunk_left_padding: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    packed_ids: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    use_finfo_min: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Reference for ``safeattn.sdpa_mask``: the element rule on a [B, 1, Q, KV] grid."""
    dev = torch.device("cpu")
    b = torch.arange(batch_size, device=dev)[:, None, None, None]
    if q_positions is None:
        q = (torch.arange(q_length, device=dev) + q_offset)[None, None, :, None].expand(batch_size, 1, q_length, 1)
    else:
        pos = q_positions.to(dev, torch.int64)
        if pos.dim() == 0:
            pos = pos + torch.arange(q_length)
        q = pos.expand(batch_size, q_length)[:, None, :, None]
    kv = (torch.arange(kv_length, device=dev) + kv_offset)[None, None, None, :]

    def lookup(ids: torch.Tensor, positions: torch.Tensor, outside: int) -> tuple[torch.Tensor, torch.Tensor]:
        # ids[b, position] where 0 <= position < width, else `outside`; also says which were inside.
        ids = ids.to(dev, torch.int64)
        width = ids.shape[1]
        inside = (positions >= 0) & (positions < width)
        values = ids[b, positions.clamp(0, max(width - 1, 0))] if width > 0 else torch.zeros_like(positions)
        return torch.where(inside, values, torch.full_like(values, outside)), inside

    ones = torch.ones(batch_size, 1, q_length, kv_length, dtype=torch.bool)
    base = ones & ((kv <= q) if causal else True)
    if sliding_window is not None:
        base = base & ((kv > q - sliding_window) if causal else ((q - kv).abs() <= sliding_window))
    if chunk_size is not None:
        pad = (
            torch.zeros(batch_size, dtype=torch.int64)
            if chunk_left_padding is None
            else chunk_left_padding.to(dev, torch.int64)
        )[:, None, None, None]
        base = base & (torch.div(kv - pad, chunk_size, rounding_mode="floor") == torch.div(q - pad, chunk_size, rounding_mode="floor"))
    if packed_ids is not None:
        q_id, q_inside = lookup(packed_ids, q, 0)
        kv_id, kv_inside = lookup(packed_ids, kv.expand_as(ones), 0)
        base = base & q_inside & kv_inside & (q_id == kv_id)
    if block_ids is not None:
        q_group, _ = lookup(block_ids, q, -1)
        kv_group, _ = lookup(block_ids, kv.expand_as(ones), -1)
        base = base | ((q_group == kv_group) & (q_group >= 0))
    if padding_mask is not None:
        pad_value, _ = lookup(padding_mask.to(torch.int64) != 0, kv.expand_as(ones), 0)
        base = base & (pad_value != 0)

    out_device = device if device is not None else next(
        (t.device for t in (q_positions, chunk_left_padding, padding_mask, packed_ids, block_ids) if t is not None),
        torch.device("cpu"),
    )
    base = base.to(out_device)
    if dtype is None or dtype == torch.bool:
        return base
    blocked = torch.finfo(dtype).min if use_finfo_min else float("-inf")
    return torch.zeros(base.shape, dtype=dtype, device=out_device).masked_fill(~base, blocked)


def safe_softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference for ``safeattn.safe_softmax``, computed in float64, returned in float64.

    Rows whose every element is -inf give 0; a NaN or +inf anywhere in a row gives NaN.
    """
    x = input.to(dtype) if dtype is not None else input
    x = x.to(torch.float64)
    if x.dim() == 0:
        x = x.reshape(1)
        return safe_softmax(x, 0).reshape(())
    all_neg_inf = (x == float("-inf")).all(dim, keepdim=True)
    row_max = x.amax(dim, keepdim=True)
    # Shift empty rows by 0: exp(-inf - (-inf)) would be NaN. A NaN or +inf max stays and
    # makes its row NaN, as torch.softmax does.
    row_max = torch.where(all_neg_inf, torch.zeros_like(row_max), row_max)
    e = torch.exp(x - row_max)
    out = e / e.sum(dim, keepdim=True)
    return torch.where(all_neg_inf, torch.zeros_like(out), out)


def masked_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    dim: int = -1,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference for ``safeattn.masked_softmax`` in float64: bool masks select, float masks add."""
    s = scores.to(dtype) if dtype is not None else scores
    x = s.to(torch.float64) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            x = torch.where(mask, x, torch.tensor(float("-inf"), dtype=torch.float64))
        else:
            x = x + mask.to(torch.float64)
    return safe_softmax(x, dim)


def safe_softmax_backward(grad_out: torch.Tensor, out: torch.Tensor, dim: int) -> torch.Tensor:
    """Reference gradient of a safe softmax at ``out`` in float64: 0 wherever ``out`` is 0."""
    g = grad_out.to(torch.float64)
    o = out.to(torch.float64)
    if o.dim() == 0:
        return torch.zeros_like(o)
    zero = o == 0
    g = torch.where(zero, torch.zeros_like(g), g)
    dot = (g * o).sum(dim, keepdim=True)
    return torch.where(zero, torch.zeros_like(o), o * (g - dot))


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``safeattn.attention``: the dense formula, differentiable by autograd.

    Computes in ``compute_dtype`` (float64 by default; the tests also run it in the low
    precision of the inputs, as the yardstick of what PyTorch itself achieves in that dtype).
    K/V heads are repeated for grouped-query attention; the [B, H, Q, KV] score matrix is dense.
    Returns ``(out, lse)`` in ``compute_dtype``.
    """
    if dropout_p != 0.0:
        raise ValueError("reference.attention: dropout is not supported")
    q, k, v = (t.to(compute_dtype) for t in (query, key, value))
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    q_length, kv_length = q.shape[2], k.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    neg_inf = torch.tensor(float("-inf"), dtype=compute_dtype)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = torch.where(attn_mask, s, neg_inf)
        else:
            s = s + attn_mask.to(compute_dtype)
    if is_causal:
        rows = torch.arange(q_length, device=s.device)[:, None] + q_offset
        cols = torch.arange(kv_length, device=s.device)[None, :] + kv_offset
        s = torch.where(cols <= rows, s, neg_inf)
    s = s.expand(q.shape[0], heads, q_length, kv_length)
    if sinks is not None:
        sink_col = sinks.to(compute_dtype).view(1, heads, 1, 1).expand(q.shape[0], heads, q_length, 1)
        s = torch.cat([s, sink_col], dim=-1)
    # A row whose every logit is -inf: softmax 0, lse -inf, and no NaN in any gradient (the
    # row is replaced by constants before logsumexp/exp, so autograd sees finite values).
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    s = torch.where(empty, torch.zeros((), dtype=compute_dtype), s)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.where(empty, torch.zeros((), dtype=compute_dtype), torch.exp(s - lse))
    p = p[..., :kv_length]
    out = p @ v
    lse = torch.where(empty, neg_inf, lse).squeeze(-1)
    return out, lse
