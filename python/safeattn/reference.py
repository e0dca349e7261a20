"""Slow, obviously-correct references used by the tests and benchmarks.

They evaluate each op's formulas, as its public docstring in ``ops.py`` and the comment at the
top of ``csrc/ops/<op>.h`` write them, on broadcast index grids (masks) or in float64 (softmax,
attention), sharing no code with the kernels.
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
    """Reference for ``safeattn.sdpa_mask``: the element rule on a [B, 1, Q, KV] grid.

    Positions are int64 grids, or Python integers (numpy object arrays, exact) when a value comes
    within 2**60 of the int64 range, where the rule's sums (q + window, q - pad) would overflow.
    """
    dev = torch.device("cpu")
    scalars = [q_offset, kv_offset, q_length, kv_length, sliding_window or 0, chunk_size or 0]
    tensors = [t for t in (q_positions, chunk_left_padding) if t is not None and t.numel() > 0]
    exact = any(abs(int(x)) >= 2**60 for x in scalars) or any(
        int(t.abs().max()) >= 2**60 or int(t.min()) <= -(2**60) for t in tensors
    )
    b = torch.arange(batch_size, device=dev)[:, None, None, None]
    if q_positions is None and exact:
        q = _exact_grid([[q_offset + i for i in range(q_length)]] * batch_size)
    elif q_positions is None:
        q = (torch.arange(q_length) + q_offset)[None, None, :, None].expand(batch_size, 1, q_length, 1)
    else:
        pos = q_positions.to(dev, torch.int64)
        if exact:
            values = pos.tolist()
            if pos.dim() == 0:
                values = [values + i for i in range(q_length)]
            if pos.dim() <= 1:
                values = [values] * batch_size
            q = _exact_grid(values)
        else:
            if pos.dim() == 0:
                pos = pos + torch.arange(q_length)
            q = pos.expand(batch_size, q_length)[:, None, :, None]
    if exact:
        kv = _exact_grid([[kv_offset + j for j in range(kv_length)]]).reshape(1, 1, 1, kv_length)
    else:
        kv = (torch.arange(kv_length) + kv_offset)[None, None, None, :]

    def floor_div(x, y):
        return x // y if exact else torch.div(x, y, rounding_mode="floor")

    def lookup(ids: torch.Tensor, positions, outside: int) -> tuple[torch.Tensor, torch.Tensor]:
        # ids[b, position] where 0 <= position < width, else `outside`; also says which were inside.
        ids = ids.to(dev, torch.int64)
        width = ids.shape[1]
        positions = _broadcast(
            positions, (batch_size, 1, q_length, kv_length) if _is_grid_kv(positions) else None
        )
        inside = _as_bool_tensor((positions >= 0) & (positions < width))
        clipped = _as_int_tensor(_clip(positions, 0, max(width - 1, 0)))
        bb = b.expand_as(clipped)
        values = ids[bb, clipped] if width > 0 else torch.zeros_like(clipped)
        return torch.where(inside, values, torch.full_like(values, outside)), inside

    ones = torch.ones(batch_size, 1, q_length, kv_length, dtype=torch.bool)
    base = ones & (_as_bool_tensor(kv <= q) if causal else True)
    if sliding_window is not None:
        if causal:
            base = base & _as_bool_tensor(kv > q - sliding_window)
        else:
            base = base & _as_bool_tensor(abs(q - kv) <= sliding_window)
    if chunk_size is not None:
        if chunk_left_padding is None:
            pad = 0
        elif exact:
            pad = _exact_grid([[int(x)] for x in chunk_left_padding.tolist()]).reshape(batch_size, 1, 1, 1)
        else:
            pad = chunk_left_padding.to(dev, torch.int64)[:, None, None, None]
        base = base & _as_bool_tensor(floor_div(kv - pad, chunk_size) == floor_div(q - pad, chunk_size))
    kv_grid = _broadcast(kv, (batch_size, 1, q_length, kv_length))
    if packed_ids is not None:
        q_id, q_inside = lookup(packed_ids, q, 0)
        kv_id, kv_inside = lookup(packed_ids, kv_grid, 0)
        base = base & q_inside & kv_inside & (q_id == kv_id)
    if block_ids is not None:
        q_group, _ = lookup(block_ids, q, -1)
        kv_group, _ = lookup(block_ids, kv_grid, -1)
        base = base | ((q_group == kv_group) & (q_group >= 0))
    if padding_mask is not None:
        pad_value, _ = lookup(padding_mask.to(torch.int64) != 0, kv_grid, 0)
        base = base & (pad_value != 0)

    out_device = (
        device
        if device is not None
        else next(
            (
                t.device
                for t in (q_positions, chunk_left_padding, padding_mask, packed_ids, block_ids)
                if t is not None
            ),
            torch.device("cpu"),
        )
    )
    base = base.to(out_device)
    if dtype is None or dtype == torch.bool:
        return base
    blocked = torch.finfo(dtype).min if use_finfo_min else float("-inf")
    return torch.zeros(base.shape, dtype=dtype, device=out_device).masked_fill(~base, blocked)


# ---- exact integer grids for sdpa_mask near the int64 limits ----------------------------------


def _exact_grid(rows):
    """[B, L] Python integers as a [B, 1, L, 1] numpy object array (exact arithmetic)."""
    import numpy as np

    arr = np.empty((len(rows), len(rows[0]) if rows else 0), dtype=object)
    for i, row in enumerate(rows):
        for j, x in enumerate(row):
            arr[i, j] = int(x)
    return arr.reshape(arr.shape[0], 1, arr.shape[1], 1)


def _is_grid_kv(positions):
    return positions.shape[-1] != 1


def _broadcast(x, shape):
    if shape is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.expand(shape)
    import numpy as np

    return np.broadcast_to(x, shape)


def _clip(x, lo, hi):
    if isinstance(x, torch.Tensor):
        return x.clamp(lo, hi)
    import numpy as np

    return np.minimum(np.maximum(x, lo), hi)


def _as_bool_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    import numpy as np

    return torch.from_numpy(np.asarray(x, dtype=bool))


def _as_int_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    import numpy as np

    return torch.from_numpy(np.asarray(x, dtype=np.int64))


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
    key_ranges: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    score_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``safeattn.attention``: the dense formula, differentiable by autograd.

    Computes in ``compute_dtype`` (float64 by default; the tests also run it in the low
    precision of the inputs, as the yardstick of what PyTorch itself achieves in that dtype).
    ``score_dtype``, when given, is the dtype the scores (scale, softcap, mask) are formed in
    before the softmax runs in ``compute_dtype``: the kernels' float32 scores, rounded as they
    round them, with an exact softmax after.
    K/V heads are repeated for grouped-query attention; the [B, H, Q, KV] score matrix is dense.
    Returns ``(out, lse)`` in ``compute_dtype``.
    """
    if dropout_p != 0.0:
        raise ValueError("reference.attention: dropout is not supported")
    q, k, v = (t.to(score_dtype or compute_dtype) for t in (query, key, value))
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
    neg_inf = torch.tensor(float("-inf"), dtype=s.dtype)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = torch.where(attn_mask, s, neg_inf)
        else:
            # A -inf bias masks its element whatever the score (NaN included), as False does.
            bias = attn_mask.to(s.dtype)
            s = torch.where(torch.isneginf(bias), neg_inf, s + bias)
    s = s.to(compute_dtype)
    v = v.to(compute_dtype)
    neg_inf = torch.tensor(float("-inf"), dtype=compute_dtype)
    if key_ranges is not None:
        # [B, Q, 2] (lo, hi): query i of batch b keeps the keys lo <= j < hi.
        cols = torch.arange(kv_length, device=s.device)
        lo, hi = key_ranges[..., :1].to(s.device).long(), key_ranges[..., 1:].to(s.device).long()
        s = torch.where(((cols >= lo) & (cols < hi))[:, None], s, neg_inf)
    if is_causal:
        # kv_offset + j <= q_offset + i, i.e. j <= i + shift: the shift in Python's exact integers
        # (an int64 sum of the offsets can overflow), clamped to where it no longer changes anything
        # (every key visible past kv_length, none below -q_length).
        shift = max(-q_length - 1, min(kv_length + 1, int(q_offset) - int(kv_offset)))
        rows = torch.arange(q_length, device=s.device)[:, None] + shift
        cols = torch.arange(kv_length, device=s.device)[None, :]
        s = torch.where(cols <= rows, s, neg_inf)
    s = s.expand(q.shape[0], heads, q_length, kv_length)
    if sinks is not None:
        sink_col = sinks.to(compute_dtype).view(1, heads, 1, 1).expand(q.shape[0], heads, q_length, 1)
        s = torch.cat([s, sink_col], dim=-1)
    # A row whose every logit is -inf: softmax 0, lse -inf, and no NaN in any gradient (the
    # row is replaced by constants before exp, so autograd sees finite values). The softmax is
    # exp(s - max) / sum, never exp(s - lse): at finfo.min even float64 cannot hold max + log(sum)
    # apart from max. The max is a constant to autograd (the softmax does not depend on it).
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    s = torch.where(empty, torch.zeros((), dtype=compute_dtype), s)
    row_max = s.detach().amax(dim=-1, keepdim=True)
    e = torch.exp(s - row_max)
    total = e.sum(dim=-1, keepdim=True)
    lse = row_max + torch.log(total)
    p = torch.where(empty, torch.zeros((), dtype=compute_dtype), e / total)
    p = p[..., :kv_length]
    out = p @ v
    lse = torch.where(empty, neg_inf, lse).squeeze(-1)
    return out, lse
