"""Public functions: thin wrappers over ``torch.ops.safeattn.*`` with their documentation."""

from __future__ import annotations

import torch

__all__ = ["masked_softmax", "safe_softmax", "sdpa_mask"]


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
    """Build a ``[batch_size, 1, q_length, kv_length]`` attention mask in one native pass.

    It gives what ``transformers.masking_utils.sdpa_mask`` (bool) and ``eager_mask`` (float)
    give for every mask Transformers composes, without evaluating Python mask functions.

    Positions: query ``i`` sits at ``q_offset + i`` (or at ``q_positions``), key ``j`` at
    ``kv_offset + j``. An element attends when ``((base and packed) or block) and padding``:

    - base: ``kv <= q`` if ``causal``; with ``sliding_window=w`` also ``kv > q - w`` (causal)
      or ``|q - kv| <= w`` (not causal); with ``chunk_size=c`` also
      ``(kv - p) // c == (q - p) // c`` where ``p = chunk_left_padding[b]`` (0 if not given).
    - packed: ``packed_ids[b, q] == packed_ids[b, kv]`` (packed sequences).
    - block: ``block_ids[b, q] == block_ids[b, kv] and block_ids[b, q] >= 0`` (ORed on:
      bidirectional blocks such as image tokens).
    - padding: ``padding_mask[b, kv]``; keys past its width count as padding.

    Example: ``sdpa_mask(1, 5, 5, sliding_window=3, padding_mask=torch.tensor([[0, 1, 1, 1, 1]]))``
    (``■`` attends, ``⬚`` does not)::

        q\\kv 0 1 2 3 4
          0  ⬚ ⬚ ⬚ ⬚ ⬚     <- fully masked row (left padding)
          1  ⬚ ■ ⬚ ⬚ ⬚
          2  ⬚ ■ ■ ⬚ ⬚
          3  ⬚ ■ ■ ■ ⬚
          4  ⬚ ⬚ ■ ■ ■

    Args:
        batch_size, q_length, kv_length: output sizes (ints or SymInts).
        q_offset, kv_offset: positions of the first query and key (>= 0).
        q_positions: integer tensor of query positions instead of ``q_offset``: 0-D (the first
            position, kept on the device: no host sync), ``[q_length]`` (Transformers 4.57's
            ``cache_position``) or ``[batch_size, q_length]``. ``q_offset`` must then be 0.
        causal: causal (True) or bidirectional (False) base mask.
        sliding_window: window size ``w > 0``.
        chunk_size: chunk size ``c > 0``; ``chunk_left_padding``: ``[batch_size]`` integers.
        padding_mask: ``[batch_size, L]`` bool or integer (nonzero attends). ``L`` may be
            shorter than ``kv_offset + kv_length``: the rest counts as padding, as in
            Transformers.
        packed_ids: ``[batch_size, L]`` integer sequence ids, ``L >= kv_offset + kv_length``
            (and ``>= q_offset + q_length``).
        block_ids: ``[batch_size, L]`` integer block ids, ``-1`` for tokens in no block; read
            as ``-1`` past its width.
        dtype: ``torch.bool`` (default; True attends) or a floating dtype (additive: 0
            attends, ``-inf`` blocks).
        use_finfo_min: with a floating dtype, block with ``torch.finfo(dtype).min`` instead of
            ``-inf``, as Transformers' ``eager_mask`` does.
        device: where to build the mask when no tensor argument says it (default CPU).

    Returns:
        A contiguous ``[batch_size, 1, q_length, kv_length]`` tensor. The op has no gradient.
    """
    # Only the keywords that differ from the schema's defaults: each keyword the dispatcher parses
    # costs about 0.4 us, and most calls give two or three of the eleven.
    optional = {
        "q_positions": q_positions,
        "sliding_window": sliding_window,
        "chunk_size": chunk_size,
        "chunk_left_padding": chunk_left_padding,
        "padding_mask": padding_mask,
        "packed_ids": packed_ids,
        "block_ids": block_ids,
        "dtype": dtype,
        "device": torch.device(device) if isinstance(device, str) else device,
    }
    kwargs = {name: value for name, value in optional.items() if value is not None}
    if not causal:
        kwargs["causal"] = False
    if use_finfo_min:
        kwargs["use_finfo_min"] = True
    return torch.ops.safeattn.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, **kwargs)


# ---- softmax family --------------------------------------------------------------------


def safe_softmax(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax over ``dim`` that gives 0, not NaN, on a slice whose every element is ``-inf``.

    Otherwise it is ``torch.softmax``: any rank, any ``dim``, non-contiguous input accepted; a
    slice holding a NaN or ``+inf`` gives NaN (NaN is never hidden); ``dtype`` casts the input
    before the op and the result comes out in it. float16 and bfloat16 accumulate in float32.
    Example (``-inf`` row)::

        x = [[0., 0.],        safe_softmax(x, -1) = [[0.5, 0.5],
             [-inf, -inf]]                          [0.0, 0.0]]   # torch.softmax: NaN

    Gradient: ``out * (grad - sum(grad * out))``, exactly 0 on every element whose output is 0
    (so 0 on fully masked slices, never NaN). As ``aten._safe_softmax``, it also supports forward
    AD (``torch.autograd.forward_ad``, ``torch.func.jvp``: the tangent is the same formula applied
    to the input tangent, 0 on fully masked slices), double backward, and the ``torch.func``
    transforms (``grad``, ``vmap``, ``jacrev``, ``jacfwd``, ``hessian``), all through the fused
    kernels.

    Args:
        input: floating tensor (float32, float64, float16, bfloat16), any shape.
        dim: the dim to normalise over (negative counts from the end).
        dtype: optional floating dtype to compute and return in.

    Returns:
        A contiguous tensor of ``input``'s shape, in ``dtype`` or ``input.dtype``.
    """
    return torch.ops.safeattn.safe_softmax(input, dim, dtype)


def masked_softmax(
    scores: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1,  # an int: a float default makes torch.compile trace every caller twice
    dim: int = -1,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``safe_softmax(scores * scale + mask, dim)`` in one pass, never materialising the sum.

    ``mask`` is broadcastable to ``scores`` (e.g. ``[B, 1, Q, KV]`` against scores
    ``[B, H, Q, KV]``) and is read through broadcast strides, never expanded in memory:

    - bool: True attends, False masks. A masked element is excluded whatever its score holds
      (a NaN or inf score there does not leak).
    - floating: additive (a bias, possibly learnable: it gets a gradient, summed over the
      broadcast dims in a fixed order, so deterministic). A float32 mask on float16/bfloat16
      scores is added in float32; other float masks are cast to the scores' dtype.

    A slice that is fully masked (or all ``-inf``) gives 0 and gradient 0; NaN or ``+inf`` in a
    slice's unmasked values gives NaN, as ``torch.softmax``. Example, one query row over 4 keys
    (``■`` attends, ``⬚`` masked)::

        mask  ■ ■ ⬚ ⬚    ->  softmax over the first two keys, 0 on the others
        mask  ⬚ ⬚ ⬚ ⬚    ->  0 0 0 0 (torch.softmax with -inf: NaN)

    Forward AD, double backward and the ``torch.func`` transforms are supported as for
    ``safe_softmax`` (the bias gets its tangent and second derivatives too); an element whose
    output is 0 (masked) neither gets nor passes a gradient or tangent, even a NaN one.

    Args:
        scores: floating tensor ``[..., dim, ...]`` (float32, float64, float16, bfloat16).
        mask: None, bool or floating tensor broadcastable to ``scores``, same device.
        scale: multiplies the scores before the mask is applied; a finite number (in float32
            unless the computation is float64).
        dim: the dim to normalise over (default the last).
        dtype: optional floating dtype: ``scores`` is cast to it first, the result comes out
            in it (as ``torch.softmax``).

    Returns:
        A contiguous tensor of ``scores``' shape, in ``dtype`` or ``scores.dtype``.
    """
    return torch.ops.safeattn.masked_softmax(scores, mask, scale, dim, dtype)


# ---------------------------------------------------------------------------------------------
# attention

__all__ += ["attention"]


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0,  # ints: a float default makes torch.compile trace every caller again
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    softcap: float = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused scaled-dot-product attention whose fully masked rows are 0, never NaN.

    A drop-in for ``F.scaled_dot_product_attention`` (same argument order) that also returns
    the log-sum-exp, accepts a bool mask or a float bias (with its gradient), grouped-query
    attention, causal masks at any offset, logit soft-capping and attention sinks. The kernel is
    tiled (flash-style): the ``Q x KV`` score matrix is never stored, and the backward
    recomputes the probabilities from ``lse``.

    Per query ``i`` and key ``j`` (scores in float32, float64 for float64 inputs)::

        s_ij = scale * <query_i, key_j>                         scale defaults to 1/sqrt(D)
        s_ij = softcap * tanh(s_ij / softcap)                   if softcap > 0 (Gemma2 order:
        s_ij = s_ij + attn_mask_ij  (float)                      scale, softcap, then mask)
        s_ij = -inf where attn_mask_ij is False (bool), or where is_causal and
               kv_offset + j > q_offset + i
        lse_i = log(sum_j exp(s_ij) + exp(sinks[h]))            sink term only with sinks
        out_i = sum_j exp(s_ij - lse_i) * value_j

    Causal alignment: key ``j`` is visible to query ``i`` iff ``kv_offset + j <= q_offset + i``.
    The defaults (0, 0) align top-left, as SDPA's ``is_causal``; ``q_offset = KV - Q`` aligns
    bottom-right (the queries are the last ``Q`` of the ``KV`` positions: KV-cache decoding,
    chunked prefill). ``Q = 3, KV = 5`` (``■`` attends, ``⬚`` does not)::

        top-left (q_offset=0)       bottom-right (q_offset=2)
          ■ ⬚ ⬚ ⬚ ⬚                   ■ ■ ■ ⬚ ⬚
          ■ ■ ⬚ ⬚ ⬚                   ■ ■ ■ ■ ⬚
          ■ ■ ■ ⬚ ⬚                   ■ ■ ■ ■ ■

    Unlike SDPA, ``is_causal`` may be combined with ``attn_mask``: both apply (AND).

    Safe semantics: a row with no visible key (every key masked, or every score -inf) gives
    ``out`` 0, ``lse`` -inf and 0 gradients; with ``sinks`` such a row gives ``out`` 0 and
    ``lse = sinks[h]``. A NaN in a row's inputs gives NaN (it is never hidden).

    Autograd: first-order gradients run the fused backward kernel. Under a ``torch.func``
    transform (``grad``, ``vmap``, ``jvp``, ``jacrev``, ``jacfwd``, ``hessian``) or with a
    forward-AD dual input, the op computes the same thing with an ATen composite
    (``torch.ops.safeattn._attention_math``: dense ``[B, H, Q, KV]`` scores, so O(Q * KV) memory)
    that every transform and any order of derivative goes through; every other call keeps the
    fused kernels. The op decides (its C++ Autograd kernel), so ``torch.ops.safeattn.attention``
    called directly, as the Transformers drop-in does, behaves the same.
    Double backward outside ``torch.func`` (``create_graph=True`` through the fused op) raises
    "derivative for safeattn::_attention_backward is not implemented": use ``torch.func``
    (e.g. ``torch.func.hessian``) for second derivatives.

    Args:
        query: ``[B, Hq, Q, D]`` float32, float16, bfloat16 (or float64). Any strides: a
            transposed view such as Transformers' ``[B, S, H, D].transpose(1, 2)`` is read in place.
        key: ``[B, Hkv, KV, D]``, same dtype. value: ``[B, Hkv, KV, Dv]``.
        attn_mask: bool (True attends) or float (added; float32 or the query dtype), of shape
            ``[Q, KV]``, ``[H|1, Q, KV]`` or ``[B|1, H|1, Q|1, KV|1]``; broadcast through strides,
            never expanded in memory. A float mask that requires grad gets its gradient, reduced
            to its own shape deterministically.
        dropout_p: must be 0: dropout is not implemented (a non-zero value raises).
        is_causal: apply the causal rule above.
        scale: score scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv`` (query head ``h`` uses key/value head
            ``h // (Hq // Hkv)``); K and V are never repeated in memory. Otherwise ``Hq == Hkv``.
        q_offset, kv_offset: positions of the first query and key, for ``is_causal``.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` before the mask.
        sinks: ``[Hq]`` float logits (GPT-OSS ``s_aux``): one extra logit per head in the softmax
            denominator that takes no value. Differentiable.

    Returns:
        ``(out, lse)``: ``out`` ``[B, Hq, Q, Dv]`` in the query dtype, stored as ``[B, Q, Hq, Dv]``
        (so ``out.transpose(1, 2)`` is contiguous, as Transformers wants it); ``lse`` ``[B, Hq, Q]``
        float32 (float64 for float64 inputs). Both are differentiable.
    """
    return torch.ops.safeattn.attention(
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
