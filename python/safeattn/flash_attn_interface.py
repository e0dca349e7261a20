"""FlashAttention's Python API served by safeattn: ``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_with_kvcache``.

The module is named after FlashAttention 3's ``flash_attn_interface`` and exposes the three
functions Transformers and inference engines call, with FlashAttention 2's signatures (plus
vLLM's ``s_aux`` attention sinks), so code written against FlashAttention moves over by its
import line, and Transformers' Hub-kernel route (``attn_implementation="org/repo"``, which looks
these names up on the loaded module and requires ``flash_attn_varlen_func``) can load it as a
kernel module. The functions are thin adapters over ``safeattn.varlen_attention``,
``safeattn.attention`` and ``safeattn.attention_with_kvcache``, whose docstrings give the
semantics (FlashAttention's: causal aligned bottom-right, ``window_size=(left, right)`` with -1
unbounded); what safeattn adds is that a row seeing no key gives 0, never NaN.

Accepted and ignored: ``max_seqlen_q`` / ``max_seqlen_k`` (the ranges come from the cumulative
lengths), ``deterministic`` (the forward is deterministic; the backward follows safeattn's own
setting), ``num_splits``. Not implemented, raising ``NotImplementedError`` when given: dropout,
ALiBi slopes, rotary embedding inside the kernel, ``cache_batch_idx``, ``cache_leftpad``,
attention probabilities (``return_attn_probs`` returns ``None`` in their place).
"""

from __future__ import annotations

import torch

from .serving import _row_ranges, attention_bshd, attention_with_kvcache, varlen_attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _unsupported(function: str, **given) -> None:
    for name, value in given.items():
        if value is not None and value is not False and not (name == "dropout_p" and value == 0):
            raise NotImplementedError(f"safeattn.flash_attn_interface.{function}: {name} is not implemented")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
):
    """FlashAttention's ``flash_attn_varlen_func`` (see ``safeattn.varlen_attention``).

    q ``[total_q, Hq, D]``, k ``[total_k, Hkv, D]``, v ``[total_k, Hkv, Dv]``; ``cu_seqlens_*``
    ``[num_sequences + 1]`` int32; ``s_aux`` ``[Hq]`` attention sinks. Returns ``out``
    ``[total_q, Hq, Dv]``, or ``(out, softmax_lse [Hq, total_q], None)`` with
    ``return_attn_probs``.
    """
    _unsupported(
        "flash_attn_varlen_func", dropout_p=dropout_p, alibi_slopes=alibi_slopes, block_table=block_table
    )
    out, lse = varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap or 0.0,
        sinks=s_aux,
        return_lse=True,
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: torch.Tensor | None = None,
):
    """FlashAttention's ``flash_attn_func``: q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``,
    v ``[B, Sk, Hkv, Dv]``, causal aligned bottom-right (query ``i`` sees keys ``j <= i + Sk - Sq``),
    ``window_size`` as in ``varlen_attention``. Returns ``out`` ``[B, Sq, Hq, Dv]``, or
    ``(out, softmax_lse [B, Hq, Sq], None)`` with ``return_attn_probs``."""
    _unsupported("flash_attn_func", dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "safeattn.flash_attn_interface.flash_attn_func: q, k and v must be 4-D [batch, seqlen, heads, "
            f"head_dim], got {q.dim()}-D, {k.dim()}-D and {v.dim()}-D"
        )
    batch, q_length, k_length = q.shape[0], q.shape[1], k.shape[1]
    left, right = (int(x) for x in window_size)
    key_ranges = None
    is_causal = False
    if left >= 0 or (right >= 0 and not causal):
        rows = torch.arange(q_length, device=q.device)
        length = torch.full_like(rows, k_length)
        key_ranges = _row_ranges(
            rows,
            torch.full_like(rows, q_length),
            torch.zeros_like(rows),
            length,
            causal,
            (left, right),
            k_length,
        ).expand(batch, q_length, 2)
    else:
        # Causal alone needs no ranges: the op's is_causal at bottom-right alignment.
        is_causal = bool(causal)
    out, lse = attention_bshd(
        q, k, v, softmax_scale, softcap, s_aux, key_ranges, is_causal, k_length - q_length if is_causal else 0
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    s_aux: torch.Tensor | None = None,
):
    """FlashAttention's ``flash_attn_with_kvcache`` (see ``safeattn.attention_with_kvcache``):
    appends ``k``/``v`` into the cache in place at ``cache_seqlens`` (through ``block_table`` for a
    paged cache ``[num_blocks, page_size, Hkv, D]``), then attends. ``cache_seqlens`` None means
    every cache slot holds a token (then ``k``/``v`` must be None). Returns ``out``
    ``[B, Sq, Hq, Dv]``, or ``(out, softmax_lse [B, Hq, Sq])`` with ``return_softmax_lse``."""
    _unsupported(
        "flash_attn_with_kvcache",
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        alibi_slopes=alibi_slopes,
    )
    if cache_seqlens is None:
        if k is not None:
            raise ValueError(
                "safeattn.flash_attn_interface.flash_attn_with_kvcache: cache_seqlens is required when k and v "
                "append new tokens"
            )
        cache_seqlens = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    result = attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k,
        v,
        block_table=block_table,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap or 0.0,
        sinks=s_aux,
        return_lse=return_softmax_lse,
    )
    return result
