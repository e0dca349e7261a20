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


# ---- serving: packed sequences and KV caches ----------------------------------------------


def flash_visible(q_length: int, kv_length: int, causal: bool, window_size=(-1, -1)) -> torch.Tensor:
    """FlashAttention's mask of one sequence, ``[q_length, kv_length]`` bool, from its formula:
    query ``i`` sits at key ``i + kv_length - q_length`` (bottom-right); ``causal`` keeps keys at or
    before it; ``window_size = (left, right)`` keeps ``left`` keys before and ``right`` after it
    (-1: unbounded; causal makes right 0)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(q_length)[:, None]
    j = torch.arange(kv_length)[None, :]
    diag = i + kv_length - q_length
    keep = torch.ones(q_length, kv_length, dtype=torch.bool)
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    return keep


def _one_sequence(q, k, v, causal, window_size, scale, softcap, sinks, compute_dtype):
    """reference.attention on one sequence: q [Lq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv].
    Returns out [Lq, Hq, Dv] and lse [Hq, Lq] in compute_dtype."""
    q_length, kv_length = q.shape[0], k.shape[0]
    mask = flash_visible(q_length, kv_length, causal, window_size)
    if kv_length == 0:
        # One key nobody sees: the reference's empty-row rule then gives 0 (lse -inf or the sink).
        k = k.new_zeros(1, *k.shape[1:])
        v = v.new_zeros(1, *v.shape[1:])
        mask = torch.zeros(q_length, 1, dtype=torch.bool)
    out, lse = attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask.to(q.device),
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        softcap=softcap,
        sinks=sinks,
        compute_dtype=compute_dtype,
    )
    return out[0].transpose(0, 1), lse[0]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``safeattn.varlen_attention``: ``reference.attention`` on each sequence alone
    with the mask ``flash_visible`` draws. Valid ``cu_seqlens`` only (starting at 0, never
    decreasing, ending at the token counts). Returns ``(out [total_q, Hq, Dv], lse [Hq, total_q])``
    in ``compute_dtype``, differentiable."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        if cu_q[s + 1] == cu_q[s]:
            continue
        out, lse = _one_sequence(
            q[cu_q[s] : cu_q[s + 1]],
            k[cu_k[s] : cu_k[s + 1]],
            v[cu_k[s] : cu_k[s + 1]],
            causal,
            window_size,
            scale,
            softcap,
            sinks,
            compute_dtype,
        )
        outs.append(out)
        lses.append(lse)
    if not outs:
        return (
            torch.zeros(0, q.shape[1], v.shape[2], dtype=compute_dtype, device=q.device),
            torch.zeros(q.shape[1], 0, dtype=compute_dtype, device=q.device),
        )
    return torch.cat(outs, 0), torch.cat(lses, -1)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``safeattn.attention_with_kvcache``, leaving the cache untouched: sequence
    ``b``'s keys are its first ``cache_seqlens[b]`` cached tokens (read page by page through
    ``block_table`` when given) followed by the new ``k`` / ``v``; then ``reference.attention`` on
    each sequence with ``flash_visible``'s mask. Valid inputs only. Returns ``(out [B, Sq, Hq, Dv],
    lse [B, Hq, Sq])`` in ``compute_dtype``."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b])
        if block_table is None:
            keys, values = k_cache[b, :length], v_cache[b, :length]
        else:
            page_size = k_cache.shape[1]
            slots = [(int(block_table[b, p // page_size]), p % page_size) for p in range(length)]
            keys = torch.stack([k_cache[page, slot] for page, slot in slots]) if slots else k_cache[0, :0]
            values = torch.stack([v_cache[page, slot] for page, slot in slots]) if slots else v_cache[0, :0]
        if k is not None:
            keys, values = torch.cat((keys, k[b]), 0), torch.cat((values, v[b]), 0)
        out, lse = _one_sequence(
            q[b], keys, values, causal, window_size, softmax_scale, softcap, sinks, compute_dtype
        )
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
