"""Serving: variable-length (packed) batches and a KV cache, contiguous or paged.

``varlen_attention`` is a Python composition over ``torch.ops.safeattn.attention``: the packed
sequences, causality and the window become the op's ``key_ranges`` (one interval of keys per
query row), computed on the device with torch ops, so no call synchronises with the host and
``torch.compile(fullgraph=True, dynamic=True)`` traces it without a graph break.
``attention_with_kvcache`` checks its arguments here, then, when no gradient is asked for, makes
one call to the C++ op ``_attention_kvcache`` (csrc/ops/attention_kvcache.h): on CUDA the append
kernel and the split-KV decode kernel, which reads a paged cache's pages where they are and each
row's keys from the cache's lengths (three kernels a step, capturable in a CUDA graph); where
the decode kernel does not apply (float32, other head dims, more than 16 query rows per kv head)
and on the CPU, the same rules as key ranges over the op. With a gradient it runs that
composition in Python, so autograd sees the append and the attention. The op's safe semantics
carry over: a query row that sees no key (a sequence with no keys, a window past every key)
gives output 0, log-sum-exp ``-inf`` and 0 gradients.

Known costs: where the op has no tile-skipping kernel for ``key_ranges`` (the generic CUDA
kernels, the CPU) they are drawn as a dense ``[1, total_q, total_k]`` mask, so varlen attention
takes O(total_q * total_k) memory and work there; outside the decode kernel a paged cache is
gathered into a contiguous copy first.
"""

from __future__ import annotations

import torch

from .ops import _call_attention

__all__ = ["attention_with_kvcache", "varlen_attention"]

# Lengths beyond this are clamped before the range arithmetic: key_ranges are int32, and a
# window of, say, 2**62 must not overflow int64 when added to a position.
_RANGE_LIMIT = 2**31 - 1
_PAGE_SIZES = (16, 256)


def _fail(function: str, message: str) -> None:
    raise ValueError(f"safeattn.{function}: {message}")


def _check_window(function: str, window_size) -> tuple[int, int]:
    if not isinstance(window_size, tuple | list) or len(window_size) != 2:
        _fail(function, f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (int(x) for x in window_size)
    if left < -1 or right < -1:
        _fail(function, f"window_size entries must be >= 0, or -1 for unbounded, got {tuple(window_size)}")
    return left, right


def _check_float(function: str, name: str, tensor: torch.Tensor, rank: int, shape_text: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(function, f"{name} must be a tensor {shape_text}, got {type(tensor).__name__}")
    if tensor.dim() != rank:
        _fail(function, f"{name} must be {rank}-D {shape_text}, got {tensor.dim()}-D {tuple(tensor.shape)}")
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        _fail(function, f"{name} must have dtype float32, float16, bfloat16 or float64, got {tensor.dtype}")


def _check_same(function: str, name: str, tensor: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if tensor.dtype != like.dtype:
        _fail(function, f"{name} has dtype {tensor.dtype} but {like_name} has {like.dtype}")
    if tensor.device != like.device:
        _fail(function, f"{name} is on {tensor.device} but {like_name} is on {like.device}")


def _check_index(function: str, name: str, tensor, rank: int, shape_text: str, like: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(function, f"{name} must be an integer tensor {shape_text}, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.int32, torch.int64):
        _fail(function, f"{name} must have dtype int32 (or int64), got {tensor.dtype}")
    if tensor.dim() != rank:
        _fail(function, f"{name} must be {rank}-D {shape_text}, got {tensor.dim()}-D {tuple(tensor.shape)}")
    if tensor.device != like.device:
        _fail(function, f"{name} is on {tensor.device} but q is on {like.device}")


def _row_ranges(
    query_index: torch.Tensor,
    q_length: torch.Tensor,
    k_start: torch.Tensor,
    k_length: torch.Tensor,
    causal: bool,
    window: tuple[int, int],
    total_k: int,
) -> torch.Tensor:
    """FlashAttention's visible keys of each query row, as ``(lo, hi)`` key indices.

    All int64 tensors of one broadcast shape: ``query_index`` is the row's index ``i`` within its
    sequence of ``q_length`` queries, whose ``k_length`` keys start at key ``k_start``. The mask
    aligns bottom-right: the row sits at key position ``diag = i + k_length - q_length``; it sees
    ``0 <= j < k_length`` and, when ``causal``, ``j <= diag``; ``window = (left, right)`` keeps
    ``diag - left <= j <= diag + right`` (-1: unbounded; causal sets right to 0). Returns int32
    ``[..., 2]`` clamped into ``[0, total_k]``: a row with ``hi <= lo`` sees no key, and no range
    ever points outside the key tensor, whatever the lengths hold.
    """
    left, right = window
    if causal:
        right = 0
    k_length = k_length.clamp(0, _RANGE_LIMIT)
    diag = query_index + k_length - q_length.clamp(0, _RANGE_LIMIT)
    lo = torch.zeros_like(diag)
    hi = k_length
    if right >= 0:
        hi = torch.minimum(hi, diag + (min(right, _RANGE_LIMIT) + 1))
    if left >= 0:
        lo = torch.maximum(lo, diag - min(left, _RANGE_LIMIT))
    lo = (lo + k_start).clamp(0, total_k)
    hi = (hi + k_start).clamp(0, total_k)
    return torch.stack((lo, torch.maximum(lo, hi)), -1).to(torch.int32)


def varlen_key_ranges(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """The op's ``key_ranges`` ``[1, total_q, 2]`` for packed sequences (see ``varlen_attention``).

    Each query token finds its sequence by a binary search of ``cu_seqlens_q`` on the device (no
    host synchronisation). Tokens before ``cu_seqlens_q[0]`` or from ``cu_seqlens_q[-1]`` on belong
    to no sequence and see no key.
    """
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_k = cu_seqlens_k.to(device=cu_q.device, dtype=torch.int64)
    num_sequences = cu_q.shape[0] - 1
    token = torch.arange(total_q, device=cu_q.device)
    # The last sequence s with cu_q[s] <= token: length-0 sequences (equal entries) are passed over.
    sequence = torch.searchsorted(cu_q, token, right=True) - 1
    inside = (sequence >= 0) & (sequence < num_sequences)
    sequence = sequence.clamp(0, num_sequences - 1)
    q_start = cu_q[sequence]
    k_start = cu_k[sequence]
    q_length = cu_q[sequence + 1] - q_start
    k_length = torch.where(inside, cu_k[sequence + 1] - k_start, 0)
    ranges = _row_ranges(token - q_start, q_length, k_start, k_length, causal, window_size, total_k)
    return ranges.unsqueeze(0)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences, as FlashAttention's ``flash_attn_varlen_func``.

    Sequence ``s`` holds the queries ``cu_seqlens_q[s] <= t < cu_seqlens_q[s + 1]`` and the keys
    ``cu_seqlens_k[s] <= t < cu_seqlens_k[s + 1]``; a query attends only to its own sequence's
    keys. Within a sequence of ``Lq`` queries and ``Lk`` keys, query ``i`` sits at key position
    ``diag = i + Lk - Lq`` (bottom-right alignment, as FlashAttention): ``causal`` keeps the keys
    ``j <= diag``; ``window_size = (left, right)`` keeps ``diag - left <= j <= diag + right``
    (-1: unbounded on that side; ``causal`` makes ``right`` 0). Three sequences, (Lq, Lk) =
    (2, 3), (0, 2), (3, 3), causal (``■`` attends, ``⬚`` does not)::

        q\\k   0 1 2 | 3 4 | 5 6 7
          0   ■ ■ ⬚ | ⬚ ⬚ | ⬚ ⬚ ⬚      sequence 0 (bottom-right: its 2 queries are keys 1, 2)
          1   ■ ■ ■ | ⬚ ⬚ | ⬚ ⬚ ⬚
          2   ⬚ ⬚ ⬚ | ⬚ ⬚ | ■ ⬚ ⬚      sequence 1 has no query; sequence 2 below
          3   ⬚ ⬚ ⬚ | ⬚ ⬚ | ■ ■ ⬚
          4   ⬚ ⬚ ⬚ | ⬚ ⬚ | ■ ■ ■

    Safe semantics: a row that sees no key (a sequence with ``Lk = 0``, a causal query with
    ``i + Lk - Lq < 0``) gives output 0 and log-sum-exp ``-inf`` (``sinks[h]`` with sinks), and
    passes no gradient. Sequences of length 0 are allowed anywhere.

    The packed tensors are viewed as a batch of one (``q.unsqueeze(0).transpose(1, 2)``, no
    copy) and the sequences become ``safeattn.attention``'s ``key_ranges``, computed on the device
    (a binary search of ``cu_seqlens_q`` per token): no host synchronisation, and
    ``torch.compile(fullgraph=True, dynamic=True)`` traces it without a graph break. Gradients
    of ``q``, ``k``, ``v`` and ``sinks`` come from the op's fused backward. Where the op draws key
    ranges as a dense mask (every device but sm_90a) this takes O(total_q * total_k) memory.

    Not checked (that would take a host synchronisation): that ``cu_seqlens_*`` start at 0, never
    decrease and end at ``total_q`` / ``total_k``. Whatever they hold, no key outside ``k`` is
    read: query tokens outside ``[cu_seqlens_q[0], cu_seqlens_q[-1])`` and sequences of negative
    length see no key, and key ranges are clamped into ``[0, total_k)``.

    Args:
        q: ``[total_q, Hq, D]`` float32, float16, bfloat16 (or float64); any strides.
        k: ``[total_k, Hkv, D]``, same dtype; ``Hq`` a multiple of ``Hkv`` (grouped-query
            attention without copying K/V). v: ``[total_k, Hkv, Dv]``.
        cu_seqlens_q, cu_seqlens_k: ``[num_sequences + 1]`` int32 (or int64) cumulative lengths,
            on ``q``'s device.
        max_seqlen_q, max_seqlen_k: accepted for FlashAttention's signature and not used (the
            key ranges come from the cumulative lengths).
        scale: score scale, default ``1 / sqrt(D)`` (FlashAttention's ``softmax_scale``).
        causal, window_size: the bottom-right causal mask and the local window above.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        sinks: ``[Hq]`` attention-sink logits (GPT-OSS ``s_aux``), differentiable.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` ``[total_q, Hq, Dv]`` contiguous in ``q``'s dtype, or ``(out, lse)`` with ``lse``
        ``[Hq, total_q]`` float32 (float64 for float64 inputs), as FlashAttention returns it.
    """
    name = "varlen_attention"
    _check_float(name, "q", q, 3, "[total_q, num_heads, head_dim]")
    _check_float(name, "k", k, 3, "[total_k, num_kv_heads, head_dim]")
    _check_float(name, "v", v, 3, "[total_k, num_kv_heads, head_dim_v]")
    _check_same(name, "k", k, q, "q")
    _check_same(name, "v", v, q, "q")
    _check_index(name, "cu_seqlens_q", cu_seqlens_q, 1, "[num_sequences + 1]", q)
    _check_index(name, "cu_seqlens_k", cu_seqlens_k, 1, "[num_sequences + 1]", q)
    if cu_seqlens_q.shape[0] < 1:
        _fail(name, "cu_seqlens_q must hold at least one entry (num_sequences + 1)")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        _fail(
            name,
            f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens_q has {cu_seqlens_q.shape[0]}"
            " (both num_sequences + 1)",
        )
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        _fail(
            name,
            f"v must be [total_k, num_kv_heads, head_dim_v] like k {tuple(k.shape)}, got {tuple(v.shape)}",
        )
    window = _check_window(name, window_size)
    if cu_seqlens_q.shape[0] == 1:  # no sequence at all: every token sees no key
        ranges = torch.zeros(1, q.shape[0], 2, dtype=torch.int32, device=q.device)
    else:
        ranges = varlen_key_ranges(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal, window)
    out, lse = attention_bshd(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale, softcap, sinks, ranges)
    out = out[0]
    return (out, lse[0]) if return_lse else out


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _write_positions(cache_seqlens: torch.Tensor, new_tokens: int, capacity: int) -> torch.Tensor:
    """Where the new tokens go: ``[B]`` first positions, clamped so that all ``new_tokens`` fit."""
    return cache_seqlens.to(torch.int64).clamp(0, capacity - new_tokens)


_DIRECT_KVCACHE = []  # [safeattn._C._attention_kvcache], once _C has loaded


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a KV cache, appending new keys in place, as FlashAttention's ``flash_attn_with_kvcache``.

    Sequence ``b`` holds ``cache_seqlens[b]`` tokens in the cache. With ``k`` and ``v`` (``Sn``
    new tokens each), they are first written into the cache in place at positions
    ``cache_seqlens[b] .. cache_seqlens[b] + Sn - 1`` (through ``block_table`` for a paged
    cache); then the ``Sq`` queries attend to the ``Lk = cache_seqlens[b] + Sn`` keys, aligned
    bottom-right as in ``varlen_attention`` (query ``i`` sits at key ``i + Lk - Sq``; ``causal``
    and ``window_size`` as there). Cache slots from ``Lk`` on are never attended: whatever they
    hold (NaN, stale tokens) does not reach the output.

    Layouts:

    - contiguous: ``k_cache`` ``[B, S_max, Hkv, D]``; the attention reads it in place as the
      strided view ``[B, Hkv, S_max, D]``.
    - paged: ``k_cache`` ``[num_blocks, page_size, Hkv, D]`` and ``block_table`` ``[B, max_blocks]``
      int32: position ``p`` of sequence ``b`` is slot ``p % page_size`` of page
      ``block_table[b, p // page_size]``. The CUDA decode kernel reads the pages in place;
      every other route gathers each sequence's pages into a contiguous
      ``[B, max_blocks * page_size, Hkv, D]`` copy first. The write goes to the pages directly.

    Not checked (that would take a host synchronisation), with the behaviour it gets instead,
    never a read or write outside the cache: ``cache_seqlens`` beyond the capacity (``S_max``, or
    ``max_blocks * page_size``) less ``Sn``, or negative, is clamped into ``[0, capacity - Sn]``
    (the new tokens then overwrite the last ones); ``block_table`` entries outside
    ``[0, num_blocks)`` (Transformers pads with -1) are clamped into it, so such a page reads and
    writes page 0 or the last page; pages listed twice share their slots.

    Args:
        q: ``[B, Sq, Hq, D]`` float32, float16, bfloat16 (or float64); ``Hq`` a multiple of ``Hkv``.
        k_cache, v_cache: the cache (layouts above), ``q``'s dtype and device; ``v_cache`` may have
            its own head dim ``Dv``. Written in place when ``k``, ``v`` are given.
        cache_seqlens: ``[B]`` int32 (or int64) tokens already in the cache, or one int for all.
        k, v: None, or ``[B, Sn, Hkv, D]`` and ``[B, Sn, Hkv, Dv]`` new keys and values.
        block_table: ``[B, max_blocks]`` int32 (or int64) for a paged cache; ``page_size``
            (``k_cache.shape[1]``) must be 16 to 256.
        softmax_scale: score scale, default ``1 / sqrt(D)``.
        causal, window_size: FlashAttention's bottom-right causal mask and local window.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        sinks: ``[Hq]`` attention-sink logits.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` ``[B, Sq, Hq, Dv]`` contiguous in ``q``'s dtype, or ``(out, lse)`` with ``lse``
        ``[B, Hq, Sq]`` float32 (float64 for float64 inputs). Differentiable in ``q``, the
        cache's read values and ``sinks`` (``k``/``v`` through the in-place write).
    """
    if not torch.compiler.is_compiling():
        # A step without gradients, in C++ from here (csrc/python_module.cpp): NotImplemented
        # sends what it does not take to the checks below, whose messages are the API's.
        if not _DIRECT_KVCACHE:
            from . import _C

            _DIRECT_KVCACHE.append(_C._attention_kvcache)
        result = _DIRECT_KVCACHE[0](
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            k,
            v,
            block_table,
            softmax_scale,
            causal,
            window_size,
            softcap,
            sinks,
        )
        if result is not NotImplemented:
            return result if return_lse else result[0]
    name = "attention_with_kvcache"
    _check_float(name, "q", q, 4, "[batch, q_length, num_heads, head_dim]")
    paged = block_table is not None
    cache_text = (
        "[num_blocks, page_size, num_kv_heads, head_dim]"
        if paged
        else "[batch, max_seqlen, num_kv_heads, head_dim]"
    )
    _check_float(name, "k_cache", k_cache, 4, cache_text)
    _check_float(name, "v_cache", v_cache, 4, cache_text)
    _check_same(name, "k_cache", k_cache, q, "q")
    _check_same(name, "v_cache", v_cache, q, "q")
    batch, q_length, heads, head_dim = q.shape
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        _fail(
            name,
            f"v_cache must match k_cache {tuple(k_cache.shape)} but its head dim, got {tuple(v_cache.shape)}",
        )
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        _fail(name, f"k_cache has head_dim {k_cache.shape[3]} but q has {head_dim}")
    if kv_heads == 0 or heads % kv_heads != 0:
        _fail(name, f"q's heads ({heads}) must be a multiple of the cache's kv heads ({kv_heads})")
    if paged:
        _check_index(name, "block_table", block_table, 2, "[batch, max_blocks]", q)
        if block_table.shape[0] != batch:
            _fail(name, f"block_table has batch {block_table.shape[0]} but q has {batch}")
        page_size = k_cache.shape[1]
        if not _PAGE_SIZES[0] <= page_size <= _PAGE_SIZES[1]:
            _fail(name, f"page_size (k_cache.shape[1]) must be 16 to 256, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            _fail(name, f"k_cache has batch {k_cache.shape[0]} but q has {batch}")
        capacity = k_cache.shape[1]
    if (k is None) != (v is None):
        _fail(name, "k and v must be given together (new tokens to append) or both be None")
    new_tokens = 0
    if k is not None:
        _check_float(name, "k", k, 4, "[batch, new_tokens, num_kv_heads, head_dim]")
        _check_float(name, "v", v, 4, "[batch, new_tokens, num_kv_heads, head_dim_v]")
        _check_same(name, "k", k, q, "q")
        _check_same(name, "v", v, q, "q")
        if (k.shape[0], k.shape[2], k.shape[3]) != (batch, kv_heads, head_dim):
            _fail(name, f"k must be [{batch}, new_tokens, {kv_heads}, {head_dim}], got {tuple(k.shape)}")
        if tuple(v.shape) != (*k.shape[:3], v_cache.shape[3]):
            _fail(
                name,
                f"v must be [{batch}, {k.shape[1]}, {kv_heads}, {v_cache.shape[3]}], got {tuple(v.shape)}",
            )
        new_tokens = k.shape[1]
        if new_tokens > capacity:
            _fail(
                name, f"k holds {new_tokens} new tokens but the cache holds at most {capacity} per sequence"
            )
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index(name, "cache_seqlens", cache_seqlens, 1, "[batch]", q)
        if cache_seqlens.shape[0] != batch:
            _fail(name, f"cache_seqlens has {cache_seqlens.shape[0]} entries but q has batch {batch}")
    else:
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int64, device=q.device)
    window = _check_window(name, window_size)

    if not _needs_grad(q, k_cache, v_cache, k, v, sinks):
        # The C++ route (csrc/ops/attention_kvcache.h): one call, the same rules; on CUDA the
        # decode kernel reads the pages in place.
        out, lse = torch.ops.safeattn._attention_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens.to(torch.int32),
            k,
            v,
            None if block_table is None else block_table.to(torch.int32),
            softmax_scale,
            bool(causal),
            window[0],
            window[1],
            float(softcap or 0.0),
            sinks,
        )
        return (out, lse) if return_lse else out

    start = _write_positions(cache_seqlens, new_tokens, capacity)  # [B] int64
    if paged:
        num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
        pages = block_table.to(torch.int64).clamp(0, num_blocks - 1)  # [B, max_blocks]
    if new_tokens:
        position = start[:, None] + torch.arange(new_tokens, device=q.device)  # [B, Sn], < capacity
        if paged:
            index = (pages.gather(1, position // page_size), position % page_size)
        else:
            index = (torch.arange(batch, device=q.device)[:, None].expand_as(position), position)
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
    kv_length = start + new_tokens  # [B]

    if paged:
        # Each sequence's pages in order: [B, max_blocks, page_size, H, D] -> [B, capacity, H, D].
        keys = k_cache[pages].flatten(1, 2)
        values = v_cache[pages].flatten(1, 2)
        # The gathered copy is ours: zero the slots past each sequence's length, so that a
        # kernel multiplying masked probabilities (0) by the values never meets a NaN there.
        unused = (torch.arange(capacity, device=q.device) >= kv_length[:, None])[:, :, None, None]
        keys.masked_fill_(unused, 0)
        values.masked_fill_(unused, 0)
    else:
        keys, values = k_cache, v_cache
    query_index = torch.arange(q_length, device=q.device)[None, :]  # [1, Sq]
    ranges = _row_ranges(
        query_index,
        torch.full_like(query_index, q_length),
        torch.zeros_like(query_index),
        kv_length[:, None],
        causal,
        window,
        capacity,
    )  # [B, Sq, 2]
    out, lse = attention_bshd(q, keys, values, softmax_scale, softcap, sinks, ranges)
    return (out, lse) if return_lse else out


def attention_bshd(q, k, v, scale, softcap, sinks, key_ranges, is_causal=False, q_offset=0):
    """The op on FlashAttention's layout: q ``[B, Sq, Hq, D]``, k / v ``[B, Sk, Hkv, D]`` (read in
    place through transposed views), GQA allowed; returns ``out`` ``[B, Sq, Hq, Dv]`` (contiguous:
    the op stores its ``[B, Hq, Sq, Dv]`` output in that layout) and ``lse`` ``[B, Hq, Sq]``."""
    out, lse = _call_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        None,
        0.0,
        is_causal,
        scale,
        True,
        q_offset,
        0,
        float(softcap or 0.0),
        sinks,
        key_ranges,
    )
    return out.transpose(1, 2), lse
