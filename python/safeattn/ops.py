"""Public functions: thin wrappers over ``torch.ops.safeattn.*`` with their documentation."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

__all__ = ["MaskDescription", "masked_softmax", "safe_softmax", "sdpa_mask"]


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


@dataclasses.dataclass(frozen=True, eq=False)
class MaskDescription:
    """An attention mask given by its rules instead of stored: ``sdpa_mask``'s mask, undrawn.

    The fields are ``sdpa_mask``'s keywords and mean what they mean there (its docstring gives
    each rule): an element attends when ``((base AND packed) OR block) AND padding``. Positions
    are not part of a description: ``attention`` takes them from its ``q_offset`` /
    ``kv_offset`` and ``materialise`` from its arguments, so one description serves every layer
    and step of a model. Pass it to ``attention`` as ``attn_mask``; it gives what the dense
    mask ``sdpa_mask(B, Q, KV, q_offset, kv_offset, **description.sdpa_mask_kwargs())`` gives.

    Example, a left-padded batch of causal rows and one padding-free row of two packed
    documents (``[B, L]`` tensors, ``L`` at least ``kv_offset + KV``)::

        padded = MaskDescription(padding_mask=attention_mask)          # causal + padding
        packed = MaskDescription(packed_ids=torch.tensor([[0, 0, 0, 1, 1]]))
        out, lse = safeattn.attention(q, k, v, padded)

    Attributes:
        causal: base ``kv <= q`` (True, the default) or every key (False).
        sliding_window: ``w > 0``: ``kv > q - w`` when causal, ``|q - kv| <= w`` when not.
        chunk_size: ``c > 0``: ``(kv - p) // c == (q - p) // c``, ``p`` from chunk_left_padding.
        chunk_left_padding: ``[B]`` integers, or None (0).
        padding_mask: ``[B, L]`` bool or integer (nonzero attends); keys past ``L`` are padding.
        packed_ids: ``[B, L]`` sequence ids, ANDed: ``ids[b, q] == ids[b, kv]``.
        block_ids: ``[B, L]`` block ids, ORed onto base and packed: ``ids[b, q] == ids[b, kv]
            and ids[b, q] >= 0``.
        packed_ids_are_runs: a promise that each id of ``packed_ids`` covers one run of
            consecutive positions per row (as the ids Transformers derives from
            ``position_ids``, a cumulative sum; its drop-in sets it): ``attention`` then runs
            the packing as key ranges instead of drawing the mask. Not checked (that would
            take a host synchronisation): an id that comes back after another would see the
            keys of its own run only. Not a rule of ``sdpa_mask``.
    """

    causal: bool = True
    sliding_window: int | None = None
    chunk_size: int | None = None
    chunk_left_padding: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    packed_ids: torch.Tensor | None = None
    block_ids: torch.Tensor | None = None
    packed_ids_are_runs: bool = False

    def with_padding(self, padding_mask: torch.Tensor | None) -> MaskDescription:
        """This mask ANDed with one more ``[B, L]`` key padding mask (None: unchanged)."""
        if padding_mask is None:
            return self
        return dataclasses.replace(self, padding_mask=_and_padding(self.padding_mask, padding_mask))

    def sdpa_mask_kwargs(self) -> dict:
        """The keywords of ``safeattn.sdpa_mask`` that build this mask."""
        fields = (field.name for field in dataclasses.fields(self) if field.name != "packed_ids_are_runs")
        return {name: getattr(self, name) for name in fields}

    def materialise(self, batch_size: int, q_length: int, kv_length: int, **call) -> torch.Tensor:
        """The dense ``[batch_size, 1, q_length, kv_length]`` mask, by ``safeattn.sdpa_mask``.

        ``call``: that op's keywords that are not rules: the positions (``q_offset``,
        ``kv_offset``, ``q_positions``) and the output (``dtype``, ``use_finfo_min``, ``device``).
        """
        return sdpa_mask(batch_size, q_length, kv_length, **call, **self.sdpa_mask_kwargs())

    def is_causal_and_padding(self) -> bool:
        """True when the mask is causality (or none) and key padding alone: no window, chunks,
        packed sequences or blocks. ``attention`` runs such a mask as its ``is_causal`` plus a
        ``[B, 1, 1, KV]`` key mask (``key_mask``), never drawn as ``[B, 1, Q, KV]``."""
        return all(x is None for x in (self.sliding_window, self.chunk_size, self.packed_ids, self.block_ids))

    def has_key_ranges(self) -> bool:
        """True when the rules besides causality and padding are a window, chunks and packed ids
        that are runs (``packed_ids_are_runs``): one interval of keys per query row, which
        ``attention`` evaluates from indices (``key_ranges``) rather than drawing the mask."""
        packed = self.packed_ids is not None
        if self.block_ids is not None or (packed and not self.packed_ids_are_runs):
            return False
        return packed or self.sliding_window is not None or self.chunk_size is not None

    def key_ranges(
        self,
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int = 0,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """The window's, the chunks' and (``packed_ids_are_runs``) the packed sequence's keys for
        each query row, as ``attention``'s ``key_ranges``: ``[batch_size, q_length, 2]`` int32
        ``(lo, hi)``, query ``i`` (position ``q_offset + i``) keeping the keys ``lo <= j < hi``
        (positions ``kv_offset + j``). Causality and padding are not in them (``attention``
        applies those as ``is_causal`` and ``key_mask``), nor blocks (``has_key_ranges``)."""
        device = torch.device("cpu") if device is None else device
        # One native op (the rule of sdpa_mask's base interval and packed runs, csrc/ops/sdpa_mask.h):
        # a model makes these once per layer and call, where some twenty small ops cost the GPU's
        # host more than the attention kernel of a short sequence.
        packed = self.packed_ids if self.packed_ids_are_runs else None
        ranges = torch.ops.safeattn._key_ranges(
            batch_size,
            q_length,
            kv_length,
            q_offset,
            kv_offset,
            causal=bool(self.causal),
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
            chunk_left_padding=None
            if self.chunk_left_padding is None
            else self.chunk_left_padding.to(device),
            packed_ids=None if packed is None else packed.to(device),
            device=device,
        )
        return ranges.expand(batch_size, q_length, 2)

    def key_mask(self, kv_length: int, kv_offset: int = 0) -> torch.Tensor | None:
        """The padding's keys at positions ``kv_offset ..`` as a bool ``[B, 1, 1, kv_length]``
        mask (True attends; positions past the padding mask's width are padding), None
        without a padding mask."""
        if self.padding_mask is None:
            return None
        keep = self.padding_mask.bool()[:, kv_offset : kv_offset + kv_length]  # offsets up to int64's
        missing = kv_length - keep.shape[-1]
        if missing > 0:
            keep = F.pad(keep, (0, missing))
        return keep[:, None, None, :]

    def padding_key_bounds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The keys the padding keeps, per batch row, as one interval: ``(start, end, exact)``.

        ``start``, ``end``: ``[B]`` int64, the first kept key position and one past the last
        (both 0 on a row that keeps none); ``exact``: ``[B]`` bool, True where every position in
        ``[start, end)`` is kept (left or right padding, or none), so that a kernel can bound its
        key loop by the interval and drop the per-key padding test on those rows. Computed on the
        padding mask's device with no host synchronisation. None without a padding mask.
        """
        if self.padding_mask is None:
            return None
        keep = self.padding_mask.bool()
        width = keep.shape[-1]
        position = torch.arange(width, device=keep.device)
        kept = keep.sum(-1)
        start = torch.where(keep, position, width).amin(-1)
        end = torch.where(keep, position + 1, 0).amax(-1)
        start = torch.where(kept > 0, start, 0)
        return start, end, kept == end - start


def _and_padding(first: torch.Tensor | None, second: torch.Tensor) -> torch.Tensor:
    """Two ``[B, L]`` padding masks ANDed; the narrower counts as padding past its end."""
    if first is None:
        return second
    width = max(first.shape[-1], second.shape[-1])
    combined = None
    for mask in (first, second):
        mask = mask.bool()
        if mask.shape[-1] < width:
            mask = F.pad(mask, (0, width - mask.shape[-1]))
        combined = mask if combined is None else combined & mask
    return combined


def _op_keywords(q_offset=0, kv_offset=0, softcap=0, sinks=None, key_ranges=None) -> dict:
    """The op's keyword-only arguments that differ from their schema defaults, for
    ``torch.ops.safeattn.attention(..., **keywords)``. The op parses every keyword it is given by
    name: the five defaults passed cost a decode step's call 1.6-2 us of host time (AMD EPYC, B=1
    Hq=8 Hkv=2 Q=1 KV=16, no gradient: the op alone 10.1-10.6 us with them, 8.5 without; SDPA
    7.6). A symbolic or tensor offset is always passed (never compared here: no guard, no sync)."""
    keywords = {}
    if type(q_offset) is not int or q_offset != 0:
        keywords["q_offset"] = q_offset
    if type(kv_offset) is not int or kv_offset != 0:
        keywords["kv_offset"] = kv_offset
    if type(softcap) not in (int, float) or softcap != 0:
        keywords["softcap"] = softcap
    if sinks is not None:
        keywords["sinks"] = sinks
    if key_ranges is not None:
        keywords["key_ranges"] = key_ranges
    return keywords


_DIRECT_ATTENTION = []  # [safeattn._C._attention], once _C has loaded (it loads after this module)


def _call_attention(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    q_offset=0,
    kv_offset=0,
    softcap=0,
    sinks=None,
    key_ranges=None,
):
    """``torch.ops.safeattn.attention`` with these arguments. In eager mode through
    ``safeattn._C._attention`` (the op's typed C++ entry: the same dispatcher call without
    torch.ops' boxed schema parsing, 1.5-2 us less host time a call), which declines anything but
    plain tensors, bools and Python numbers, or a ``__torch_function__`` mode; under
    ``torch.compile`` and for what it declines, ``torch.ops`` with only the keywords that differ
    from their defaults (``_op_keywords``)."""
    positional = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not torch.compiler.is_compiling():
        if not _DIRECT_ATTENTION:
            from . import _C

            _DIRECT_ATTENTION.append(_C._attention)
        result = _DIRECT_ATTENTION[0](*positional, q_offset, kv_offset, softcap, sinks, key_ranges)
        if result is not NotImplemented:
            return result
    return torch.ops.safeattn.attention(
        *positional, **_op_keywords(q_offset, kv_offset, softcap, sinks, key_ranges)
    )


def _op_mask_arguments(attn_mask, is_causal, key_ranges, query, key, q_offset, kv_offset):
    """``attention``'s ``(attn_mask, is_causal, key_ranges)`` as the op takes them: a
    ``MaskDescription`` resolved by ``_described_mask``, anything else as given. Also what
    ``_testing.attention_path`` asks about."""
    if not isinstance(attn_mask, MaskDescription):
        return attn_mask, is_causal, key_ranges
    if is_causal:
        raise ValueError(
            "safeattn.attention: is_causal must be False when attn_mask is a MaskDescription "
            "(its `causal` field says whether the mask is causal)"
        )
    if key_ranges is not None:
        raise ValueError("safeattn.attention: key_ranges must be None when attn_mask is a MaskDescription")
    return _described_mask(attn_mask, query, key, q_offset, kv_offset)


def _described_mask(
    description: MaskDescription, query: torch.Tensor, key: torch.Tensor, q_offset, kv_offset
) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """What the op runs for a described mask: ``(attn_mask, is_causal, key_ranges)``.

    Causality (or none), key padding, a window and chunks: ``is_causal``, the ``[B, 1, 1, KV]``
    key mask and (with a window or chunks) the op's ``key_ranges``, one interval of keys per
    query row, so the sm_90a kernels skip the tiles outside them and test their edges from
    indices; the other kernels draw them. Packed sequences and blocks: the dense mask, built by
    the native ``sdpa_mask`` in one pass, which the kernels summarise per tile (the GPU) or per
    query tile (the CPU) so that fully masked tiles are skipped; ``is_causal`` is kept alongside
    where the mask is causal anyway (no blocks), which bounds the key loops by the diagonal too.
    """
    if q_offset < 0 or kv_offset < 0:
        raise ValueError(
            f"safeattn.attention: q_offset and kv_offset are positions (>= 0) with a MaskDescription, "
            f"got q_offset={q_offset}, kv_offset={kv_offset}"
        )
    batch_size, q_length, kv_length = query.shape[0], query.shape[-2], key.shape[-2]
    if description.is_causal_and_padding() or description.has_key_ranges():
        keys = description.padding_mask
        # sdpa_mask's checks of the padding mask, for the path that does not call it (the rules'
        # run in the key ranges' op).
        if keys is not None and (keys.dim() != 2 or keys.shape[0] != batch_size):
            raise ValueError(
                f"safeattn.attention: attn_mask.padding_mask must be [B, L] with B = {batch_size} "
                f"(the query's batch), got {tuple(keys.shape)}"
            )
        if keys is not None and (keys.is_floating_point() or keys.is_complex()):
            raise ValueError(
                f"safeattn.attention: attn_mask.padding_mask must be bool or integer, got {keys.dtype}"
            )
        keys = description.key_mask(kv_length, kv_offset)
        if keys is not None:
            keys = keys.to(query.device)
        ranges = None
        if description.has_key_ranges():  # sdpa_mask's checks of the rules run in the op
            ranges = description.key_ranges(
                batch_size, q_length, kv_length, q_offset, kv_offset, query.device
            )
        return keys, bool(description.causal), ranges
    mask = description.materialise(
        batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset, device=query.device
    )
    return mask, bool(description.causal) and description.block_ids is None, None


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
    attn_mask: torch.Tensor | MaskDescription | None = None,
    dropout_p: float = 0,  # ints: a float default makes torch.compile trace every caller again
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    softcap: float = 0,
    sinks: torch.Tensor | None = None,
    key_ranges: torch.Tensor | None = None,
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
            to its own shape deterministically. Or a ``MaskDescription``: the mask
            ``sdpa_mask`` would build for it at positions ``q_offset`` / ``kv_offset`` (both
            ``>= 0`` then; ``is_causal`` must be False, the description's ``causal`` says it),
            without building it when it is causality (or none), key padding, a window and chunks:
            that runs as ``is_causal``, a ``[B, 1, 1, KV]`` key mask and ``key_ranges``. Packed
            sequences and blocks are built densely by ``sdpa_mask`` for now.
        dropout_p: must be 0: dropout is not implemented (a non-zero value raises).
        is_causal: apply the causal rule above.
        scale: score scale, default ``1 / sqrt(D)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv`` (query head ``h`` uses key/value head
            ``h // (Hq // Hkv)``); K and V are never repeated in memory. Otherwise ``Hq == Hkv``.
        q_offset, kv_offset: positions of the first query and key, for ``is_causal`` and a
            ``MaskDescription``.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` before the mask.
        sinks: ``[Hq]`` float logits (GPT-OSS ``s_aux``): one extra logit per head in the softmax
            denominator that takes no value. Differentiable.
        key_ranges: ``[B, Q, 2]`` int32 ``(lo, hi)``: query ``i`` of batch ``b`` sees only the keys
            ``lo <= j < hi`` (indices into ``key``), ANDed with ``attn_mask`` and ``is_causal``;
            ``hi <= lo`` sees none. A window's or chunk's mask as indices: the H100/H200 kernels
            evaluate them per tile and never draw a ``[B, 1, Q, KV]`` mask (other devices draw
            it). A ``MaskDescription`` with a window or chunks passes its own
            (``MaskDescription.key_ranges``); None then.

    Returns:
        ``(out, lse)``: ``out`` ``[B, Hq, Q, Dv]`` in the query dtype, stored as ``[B, Q, Hq, Dv]``
        (so ``out.transpose(1, 2)`` is contiguous, as Transformers wants it); ``lse`` ``[B, Hq, Q]``
        float32 (float64 for float64 inputs). Both are differentiable.
    """
    if isinstance(attn_mask, MaskDescription):
        attn_mask, is_causal, key_ranges = _op_mask_arguments(
            attn_mask, is_causal, key_ranges, query, key, q_offset, kv_offset
        )
    positional = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _call_attention(*positional, q_offset, kv_offset, softcap, sinks, key_ranges)
