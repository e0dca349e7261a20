"""Hugging Face Transformers drop-in: ``attn_implementation="safeattn"``.

Importing this module registers ``"safeattn"`` in Transformers' ``AttentionInterface`` (the
attention function) and ``AttentionMaskInterface`` (the mask function); both are needed, since a
model asks each interface for its part by the same name::

    import safeattn.transformers  # registers "safeattn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="safeattn")

What the model gets, compared with ``"sdpa"``:

- the same outputs on real tokens; on fully padded query rows (left padding) the attention output
  is exactly 0 and nothing is NaN;
- masks built by the native ``safeattn.sdpa_mask`` op from Transformers' own mask functions
  (causal, bidirectional, sliding window, chunked with left padding, padding, packed sequences,
  bidirectional blocks, and ``and_masks`` / ``or_masks`` of those at any nesting), which
  ``safeattn._mask_reader`` reads into mask descriptions. A mask function it does not recognise
  (a user overlay) is evaluated by Transformers' own ``sdpa_mask`` instead: correct and slower,
  and said through ``logging`` at INFO level once per process and reason (logger
  ``safeattn.transformers``). The mask is None exactly where Transformers' sdpa mask is
  None (so causal attention keeps its mask-free path), except with a static cache on an
  accelerator, where the query offset is a device tensor and reading it would be a host sync: there
  a mask is built instead (same result);
- a mask that holds causality and key padding alone (the common case: a padded batch in a causal
  model; with 5.x, whose query offset is a number) runs as the op's ``is_causal`` at the mask's
  positions plus a ``[B, 1, 1, KV]`` key mask (the rule ``safeattn.attention`` applies to a
  ``safeattn.MaskDescription``), the same elements as the dense mask the model receives, which
  the sm_90a kernels run without summarising a dense mask or testing diagonal tiles element by
  element (the CPU kernels find the same bounds in the dense mask). The dense mask is still what
  the model sees and what any other code reads; a mask changed in place, sliced or copied runs as
  the dense mask it is;
- grouped-query attention without copying K/V, Gemma2's logit ``softcap`` and GPT-OSS's attention
  sinks (``s_aux``), both of which ``"sdpa"`` ignores.

Transformers 5.x and 4.57.x are supported; their mask-function keywords differ (5.x passes
``q_length``, ``q_offset``, ``device``; 4.57 passes ``cache_position``) and are told apart at run
time from the keywords of each call.

``patch_masks()`` also serves Transformers' ``"sdpa"`` and ``"eager"`` masks from the native op,
process-wide, for models that keep their attention implementation.

Dropout: the ``attention`` op implements none, so a non-zero ``dropout`` (a model in training
mode with ``config.attention_dropout > 0``) raises ``NotImplementedError`` saying so, instead of
silently training without it. Set ``config.attention_dropout = 0`` (most configs' default) or
train with ``"sdpa"``. Models in eval mode always pass 0.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch
import torch.nn.functional as F
from transformers import masking_utils as _mu
from transformers.masking_utils import AttentionMaskInterface

try:  # 5.x and 4.57 both export it at the top level; the module moved between versions.
    from transformers import AttentionInterface
except ImportError:  # pragma: no cover
    from transformers.modeling_utils import AttentionInterface

from . import _mask_reader
from ._mask_reader import NotRecognised, read_mask_function
from .ops import MaskDescription, _call_attention, _described_mask
from .serving import attention_with_kvcache, varlen_attention

__all__ = [
    "NAME",
    "PAGED_NAME",
    "attention_forward",
    "eager_mask",
    "paged_attention_forward",
    "patch_masks",
    "sdpa_mask",
    "unpatch_masks",
]

NAME = "safeattn"
# Continuous batching (``model.generate_batch``, the ContinuousBatchingManager) runs a model whose
# attn_implementation starts with "paged|": registering this name makes ours one of them.
PAGED_NAME = "paged|safeattn"

_logger = logging.getLogger(__name__)

# Transformers' own constructions, kept before anything here is registered: the fallback for
# mask functions the reader does not recognise, and what unpatch_masks() restores.
_TF_SDPA_MASK = _mu.sdpa_mask
_TF_EAGER_MASK = _mu.eager_mask


# --------------------------------------------------------------------------------------------
# Skipping the mask where Transformers' sdpa mask does
# --------------------------------------------------------------------------------------------
_IGNORE_CAUSAL_PARAMS = tuple(inspect.signature(_mu._ignore_causal_mask_sdpa).parameters)
_IGNORE_BIDIRECTIONAL = getattr(_mu, "_ignore_bidirectional_mask_sdpa", None)


def _is_tracing(*tensors) -> bool:
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return True
    return any(isinstance(t, torch.fx.Proxy) for t in tensors)


def _padded(attention_mask, kv_length, kv_offset):
    """The 2-D mask right-padded with False to kv_offset + kv_length, as Transformers pads it."""
    if attention_mask is None:
        return None
    missing = kv_length + kv_offset - attention_mask.shape[-1]
    return F.pad(attention_mask, (0, missing)) if missing > 0 else attention_mask


def _skip_causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_size) -> bool:
    """Transformers' own _ignore_causal_mask_sdpa, called with this version's arguments."""
    if isinstance(q_offset, torch.Tensor):
        if q_offset.device.type == "cpu":
            q_offset = int(q_offset)  # a CPU read, no device synchronisation
        else:
            # Reading a device tensor would be a host sync: treat it as a non-zero offset, which
            # only turns off the static-cache prefill skip (a mask is built; same attention).
            q_offset = 1
    if "q_offset" in _IGNORE_CAUSAL_PARAMS:  # 5.x
        return _mu._ignore_causal_mask_sdpa(
            padding_mask, q_length, kv_length, q_offset, kv_offset, local_size
        )
    return _mu._ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, kv_offset, local_size)  # 4.57


# --------------------------------------------------------------------------------------------
# Mask functions
# --------------------------------------------------------------------------------------------
_FALLBACK_LOGGED: set = set()


def _log_once(message: str, level: int = logging.DEBUG) -> None:
    """Logs `message` once per process (never while torch.compile traces)."""
    if torch.compiler.is_compiling() or message in _FALLBACK_LOGGED:
        return
    _FALLBACK_LOGGED.add(message)
    _logger.log(level, "safeattn: %s", message)


def _log_fallback(reason: str) -> None:
    """Says at INFO, once per process and reason, that a mask goes to Transformers' construction."""
    _log_once(
        f"mask not recognised ({reason}); using Transformers' own mask construction (correct, slower)",
        logging.INFO,
    )


def _build_mask(kwargs: dict, *, float_dtype, skip_causal: bool, allow_bidirectional_skip: bool):
    """Shared body of the mask functions. ``float_dtype`` None: bool mask; else eager's float mask.

    Returns (handled, mask). handled False: the caller falls back to Transformers.
    """
    batch_size = kwargs["batch_size"]
    kv_length = kwargs["kv_length"]
    kv_offset = kwargs.get("kv_offset", 0)
    attention_mask = kwargs.get("attention_mask")
    local_size = kwargs.get("local_size")
    cache_position = kwargs.get("cache_position")
    if cache_position is not None:  # 4.57: query positions as a [Q] tensor
        q_length = cache_position.shape[0]
        q_offset = 0
        q_positions = cache_position
        device = cache_position.device
    else:  # 5.x
        q_length = kwargs["q_length"]
        q_offset = kwargs.get("q_offset", 0)
        q_positions = None
        if isinstance(q_offset, torch.Tensor):
            # Static cache: the start position stays on the device (no host sync).
            q_positions, q_offset = q_offset, 0
        device = kwargs.get("device", "cpu")
    device = torch.device(device)

    description = read_mask_function(kwargs.get("mask_function", _mu.causal_mask_function))
    if isinstance(description, NotRecognised):
        _log_fallback(description.reason)
        return False, None

    if not _is_tracing(attention_mask):
        if skip_causal or allow_bidirectional_skip:
            padding_mask = _padded(attention_mask, kv_length, kv_offset)
            # 5.x's test reads the start position (a 0-d tensor with a static cache); 4.57's none.
            start = q_positions if q_positions is not None and q_positions.dim() == 0 else q_offset
            if skip_causal and _skip_causal(padding_mask, q_length, kv_length, start, kv_offset, local_size):
                return True, None
            if allow_bidirectional_skip and _IGNORE_BIDIRECTIONAL is not None:
                if _IGNORE_BIDIRECTIONAL(padding_mask, kv_length, local_size):
                    return True, None

    if q_positions is not None and q_positions.dim() == 0:
        q_positions = q_positions.to(torch.long)
    described = description.with_padding(attention_mask)
    mask = described.materialise(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        q_positions=q_positions,
        dtype=float_dtype if float_dtype is not None else torch.bool,
        use_finfo_min=float_dtype is not None,
        device=device,
    )
    if float_dtype is None and q_positions is None and not _is_tracing(attention_mask):
        _note_description(mask, described, kv_length, q_offset, kv_offset)
    return True, mask


# --------------------------------------------------------------------------------------------
# Causal + padding masks run as is_causal and a key mask
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Noted:
    """What a bool mask built here stands for when it holds no more than causality (or none), key
    padding, a window and chunks: its description at the positions ``q_offset`` / ``kv_offset``,
    which ``safeattn.attention``'s rule (``ops._described_mask``) runs as ``is_causal``, a
    ``[B, 1, 1, KV]`` key mask and the key ranges of the window and chunks. The same elements as the dense mask, but the kernels skip the
    tiles past the diagonal instead of testing each element there (H200, B4 H16 S4096 D128:
    0.511 against 0.646 ms forward, benchmarks/notes_attention_cuda.md; on the CPU about even
    since its kernels bound their key loops by a dense mask's span). ``version`` is the mask's
    ``_version`` when noted: a mask changed in place since then runs as the dense mask it is, as
    does any new tensor made from it (a slice, a copy), which carries no note, and a mask made
    under ``torch.inference_mode`` (no version counter: never noted)."""

    description: MaskDescription
    q_offset: int
    kv_offset: int
    version: int


_NOTE = "_safeattn_description"


def _note_description(
    mask: torch.Tensor, described: MaskDescription, kv_length: int, q_offset: int, kv_offset: int
) -> None:
    """Notes on ``mask`` (a plain attribute, eager only) what it stands for, when that is
    causality, padding, a window and chunks: no packed sequences or blocks (those would run as
    this same dense mask). Not on a tensor made under ``torch.inference_mode``: it has no
    version counter to tell a change in place. The padding is kept as bool on the mask's device,
    as wide as the mask's positions, so that each layer's key mask is a view of it."""
    if mask.is_inference() or not (described.is_causal_and_padding() or described.has_key_ranges()):
        return
    keys = described.padding_mask
    if keys is not None:
        keys = _padded(keys, kv_length, kv_offset).to(device=mask.device, dtype=torch.bool)
        described = dataclasses.replace(described, padding_mask=keys)
    setattr(mask, _NOTE, _Noted(described, int(q_offset), int(kv_offset), mask._version))


def _noted(mask: torch.Tensor | None, q_length: int, kv_length: int) -> _Noted | None:
    """The note on ``mask`` if it still holds: the same tensor, unchanged, of these lengths."""
    if mask is None or _is_tracing(mask):
        return None
    note = getattr(mask, _NOTE, None)
    if note is None or mask._version != note.version or tuple(mask.shape[-2:]) != (q_length, kv_length):
        return None
    return note


def _tf_mask(tf_fn, kwargs: dict, float_dtype) -> torch.Tensor | None:
    """Transformers' own construction (``tf_fn``: its sdpa_mask or eager_mask) for a mask this
    module does not build.

    Under torch.compile before torch 2.14 (where the mask closures cannot be read, so every mask
    lands here) the 2-D padding mask is applied by broadcasting instead of by Transformers'
    padding_mask_function, whose gather ``padding_mask[batch_idx, kv_idx]`` inductor's CPU code
    generation miscompiles there (pytorch #178244: "'tmp2' was not declared in this scope").
    """
    attention_mask = kwargs.get("attention_mask")
    if _mask_reader.DYNAMO_READS_CLOSURES or not torch.compiler.is_compiling():
        return tf_fn(**kwargs)
    if attention_mask is None or attention_mask.dim() != 2:  # no 2-D padding: no gather to avoid
        return tf_fn(**kwargs)
    kv_length, kv_offset = kwargs["kv_length"], kwargs.get("kv_offset", 0)
    keep = _padded(attention_mask, kv_length, kv_offset)[:, kv_offset : kv_offset + kv_length]
    keep = keep.to(torch.bool)[:, None, None, :]
    unpadded = {
        **kwargs,
        "attention_mask": None,
        "allow_is_causal_skip": False,
        "allow_is_bidirectional_skip": False,
    }
    mask = tf_fn(**unpadded)  # with both skips off, a tensor
    if mask is None:
        return tf_fn(**kwargs)
    if float_dtype is None:
        return mask & keep
    return mask.masked_fill(~keep, torch.finfo(float_dtype).min)


def sdpa_mask(**kwargs) -> torch.Tensor | None:
    """The ``"safeattn"`` mask function (and the ``"sdpa"`` one after ``patch_masks()``).

    Takes the keywords Transformers passes to an ``AttentionMaskInterface`` function (5.x:
    ``batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
    local_size, allow_is_causal_skip, allow_is_bidirectional_skip, use_vmap, device, dtype,
    config``; 4.57: ``cache_position`` instead of ``q_length`` / ``q_offset`` / ``device``) and
    returns what ``transformers.masking_utils.sdpa_mask`` returns: a bool ``[B, 1, Q, KV]`` mask
    (True attends) or None where the attention may run causal without a mask. ``use_vmap`` only
    matters for mask functions it does not recognise, which go to Transformers' construction.
    """
    handled, mask = _build_mask(
        kwargs,
        float_dtype=None,
        skip_causal=kwargs.get("allow_is_causal_skip", True),
        allow_bidirectional_skip=kwargs.get("allow_is_bidirectional_skip", False),
    )
    if handled:
        return mask
    return _tf_mask(_TF_SDPA_MASK, kwargs, None)


def eager_mask(**kwargs) -> torch.Tensor | None:
    """Transformers' ``"eager"`` mask built natively (served after ``patch_masks()``).

    A float ``[B, 1, Q, KV]`` mask of ``dtype`` (default float32): 0 to attend,
    ``torch.finfo(dtype).min`` to block, exactly as ``transformers.masking_utils.eager_mask``.
    It is None only for a bidirectional mask with nothing to mask when
    ``allow_is_bidirectional_skip`` is set (5.x), as Transformers'.
    """
    dtype = kwargs.get("dtype") or torch.float32
    handled, mask = _build_mask(
        kwargs,
        float_dtype=dtype,
        skip_causal=False,
        allow_bidirectional_skip=kwargs.get("allow_is_bidirectional_skip", False),
    )
    if handled:
        return mask
    return _tf_mask(_TF_EAGER_MASK, kwargs, dtype)


def patch_masks() -> None:
    """Serve Transformers' ``"sdpa"`` and ``"eager"`` masks from the native op, process-wide.

    For models that keep ``attn_implementation="sdpa"`` or ``"eager"``: their masks (same
    values, same None cases) are then built by ``safeattn.sdpa_mask`` instead of by evaluating
    Python mask functions. Mask functions it does not recognise still go to Transformers' own
    construction. ``unpatch_masks()`` restores Transformers' functions.
    """
    AttentionMaskInterface.register("sdpa", sdpa_mask)
    AttentionMaskInterface.register("eager", eager_mask)


def unpatch_masks() -> None:
    """Undo ``patch_masks()``: Transformers' own ``"sdpa"`` and ``"eager"`` masks again."""
    AttentionMaskInterface.register("sdpa", _TF_SDPA_MASK)
    AttentionMaskInterface.register("eager", _TF_EAGER_MASK)


# --------------------------------------------------------------------------------------------
# Attention function
# --------------------------------------------------------------------------------------------
def _kernel_devices() -> frozenset:
    """Device types with kernels for safeattn::attention and its backward (read once, so tracing
    sees a constant): a forward alone would break training on that device."""
    try:
        torch.ops.safeattn.attention  # noqa: B018  raises in a build without the op
    except (AttributeError, RuntimeError):
        return frozenset()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return frozenset(
        d
        for d, key in (("cpu", "CPU"), ("cuda", "CUDA"))
        if has("safeattn::attention", key) and has("safeattn::_attention_backward", key)
    )


_ATTENTION_KERNEL_DEVICES = _kernel_devices()


def _attention_op(device: torch.device):
    """The op (ops._call_attention: torch.ops.safeattn.attention by its C++ entry), or None where
    it has no kernels for `device` (a build without CUDA, another accelerator): there the
    composite below keeps the same semantics."""
    return _call_attention if device.type in _ATTENTION_KERNEL_DEVICES else None


def _composite_attention(
    query, key, value, attn_mask, scale, is_causal, softcap, sinks, q_offset=0, kv_offset=0
):
    """The op's ATen composite (csrc/ops/attention_composite.cpp, ``_attention_math``: the same
    semantics from plain ATen ops, so it runs on any device), for a device without kernels.

    query [B, Hq, Q, D]; key, value [B, Hkv, KV, D]; attn_mask bool or float, broadcastable to
    [B, Hq, Q, KV]; sinks [Hq] or None. A query row with every key masked gives 0.
    """
    out, _ = torch.ops.safeattn._attention_math(
        query,
        key,
        value,
        attn_mask,
        0.0,
        is_causal,
        scale,
        query.shape[1] != key.shape[1],
        q_offset=q_offset,
        kv_offset=kv_offset,
        softcap=softcap or 0.0,
        sinks=sinks,
    )
    return out


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"safeattn"`` attention function (``AttentionInterface`` signature).

    Args:
        module: the attention layer (``is_causal`` is read from it when not passed).
        query: ``[B, Hq, Q, D]``; key, value: ``[B, Hkv, KV, D]`` (``Hq`` a multiple of
            ``Hkv``: grouped-query attention runs without copying K/V).
        attention_mask: bool ``[B, 1, Q, KV]`` (True attends), an additive float mask, or None.
        dropout: attention dropout probability (0 outside training).
        scaling: score scale (default ``D ** -0.5``).
        is_causal: overrides ``module.is_causal``; causal applies only with no mask and ``Q > 1``.
        softcap: ``softcap * tanh(score / softcap)`` after scaling (Gemma2 / Gemma3).
        s_aux: ``[Hq]`` attention-sink logits (GPT-OSS): an extra key with no value per head.
        position_bias: ``[B or 1, H or 1, Q, KV]`` additive bias (T5-style), added to the scores
            on top of the mask (blocked keys stay blocked).

    Returns:
        ``(out [B, Q, Hq, D] contiguous, None)``; a query row with every key masked gives 0.
    """
    if kwargs.get("output_attentions", False):
        _log_once("output_attentions=True: safeattn attention returns no weights (None)")
    q_length = query.shape[2]
    kv_length = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] > kv_length:
        # A mask built for a longer cache (as 4.57's sdpa integration allows): its first keys.
        attention_mask = attention_mask[:, :, :, :kv_length]

    q_offset = kv_offset = 0
    key_ranges = None
    note = _noted(attention_mask, q_length, kv_length)
    if note is not None:
        # A mask built here: is_causal at its positions, a key mask and (windows, chunks) key ranges.
        q_offset, kv_offset = note.q_offset, note.kv_offset
        attention_mask, is_causal, key_ranges = _described_mask(
            note.description, query, key, q_offset, kv_offset
        )
    else:
        # As Transformers' sdpa integration: the kwarg wins over the module; causal only for a
        # multi-token query with no mask (a single decoded token attends every cached key). The
        # shape test comes first so a SymInt q_length stays a plain bool under torch.compile.
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        is_causal = bool(q_length > 1 and attention_mask is None and is_causal)

    # Keys past the last query's position are hidden by causality: a static-cache prefill (empty
    # cache, no mask: its unused slots) or a noted mask over a longer cache. Dropping them saves
    # their work.
    visible = q_offset + q_length - kv_offset
    if is_causal and 0 < visible < kv_length:
        key = key[:, :, :visible, :]
        value = value[:, :, :visible, :]
        if position_bias is not None:
            position_bias = position_bias[:, :, :, :visible]
        if attention_mask is not None:
            attention_mask = attention_mask[:, :, :, :visible]

    if position_bias is not None:
        # An additive bias (T5-style). Blocked keys get -inf, not Transformers' finfo.min, so a
        # fully masked row stays 0; the op applies is_causal together with a mask.
        if attention_mask is None:
            attention_mask = position_bias
        elif attention_mask.dtype == torch.bool:
            attention_mask = torch.where(attention_mask, position_bias, float("-inf"))
        else:
            attention_mask = position_bias + attention_mask

    if dropout:
        # The op has no dropout; say what to change rather than let training run without it.
        raise NotImplementedError(
            f"safeattn attention: dropout is not implemented (got dropout={dropout}); set "
            "config.attention_dropout = 0, or use attn_implementation='sdpa' to train with attention dropout"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = float(softcap) if softcap else 0.0
    enable_gqa = query.shape[1] != key.shape[1]
    op = _attention_op(query.device)
    if op is not None:
        out, _ = op(
            query,
            key,
            value,
            attention_mask,
            0.0,
            is_causal,
            scale,
            enable_gqa,
            q_offset=q_offset,
            kv_offset=kv_offset,
            softcap=softcap,
            sinks=s_aux,
            key_ranges=key_ranges,
        )
    else:
        _log_once(
            f"no safeattn attention kernel for {query.device.type}; attention runs as composite PyTorch ops"
        )
        if key_ranges is not None:  # drawn: [B, 1, Q, KV] ANDed with the mask
            keys = torch.arange(key.shape[2], device=key.device)
            keep = (keys >= key_ranges[..., :1]) & (keys < key_ranges[..., 1:])
            attention_mask = keep[:, None] if attention_mask is None else attention_mask & keep[:, None]
        out = _composite_attention(
            query, key, value, attention_mask, scale, is_causal, softcap, s_aux, q_offset, kv_offset
        )
    # out is [B, Hq, Q, D] laid out as [B, Q, Hq, D], so this transpose is already contiguous.
    return out.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------------------------
# Continuous batching
# --------------------------------------------------------------------------------------------
def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    cache=None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | dict | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | dict | None = None,
    block_table: torch.Tensor | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"paged|safeattn"`` attention function: Transformers' continuous batching.

    Follows ``transformers.integrations.flash_paged.paged_attention_forward``. The batch is
    packed: query ``[1, Hq, total_q, D]``, key and value ``[1, Hkv, total_new, D]`` (the new
    tokens), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` the cumulative lengths (``cu_seq_lens_k`` and
    ``max_seqlen_k`` may be dicts keyed by layer type). Without ``block_table``, the new keys go
    into the ``PagedAttentionCache`` by ``cache.update`` (its ``read_index`` / ``write_index``
    kwargs), which returns every key each sequence reads, and ``safeattn.varlen_attention`` runs
    causal (bottom-right) with the layer's window ``w`` as ``(w - 1, 0)`` (the ``sliding_window``
    kwarg, else ``module.sliding_window``).
    With ``block_table`` (decode-only batches, ``[groups, B, max_blocks]``),
    ``safeattn.attention_with_kvcache`` appends the new token of each sequence in place and
    attends over the pages. Unlike ``"paged|sdpa"``, it needs no attention mask (none is built),
    and honours ``softcap`` and ``s_aux`` (attention sinks).

    Returns ``(out [total_q, Hq, Dv], None)``.
    """
    if cache is None:
        raise ValueError(
            "safeattn: `paged|safeattn` was called without a paged attention cache (cache=...); it runs "
            "the packed batches of continuous batching. Use attn_implementation='safeattn' for a standard forward."
        )
    if dropout:
        raise NotImplementedError(
            f"safeattn paged attention: dropout is not implemented (got dropout={dropout})"
        )
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    # The model's sliding_window kwarg, else the layer's attribute (the one flash_paged reads):
    # Mistral passes the kwarg and has no attribute, while its paged cache keeps a window per layer.
    sliding_window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    layer_type = "sliding_attention" if sliding_window else "full_attention"
    if isinstance(cu_seq_lens_k, dict):
        cu_seq_lens_k = cu_seq_lens_k[layer_type]
        max_seqlen_k = max_seqlen_k[layer_type]
    softcap = float(softcap) if softcap else 0.0
    if block_table is None:
        # [1, Hkv, n, D] new tokens in; every key the sequences read out, [total_k, Hkv, D].
        key, value = cache.update(
            key_states=key,
            value_states=value,
            layer_idx=module.layer_idx,
            read_index=kwargs["read_index"],
            write_index=kwargs["write_index"],
        )
        out = varlen_attention(
            query[0].transpose(0, 1),  # [total_q, Hq, D], a view
            key,
            value,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_seqlen_q,
            max_seqlen_k,
            scale=scale,
            causal=True,
            window_size=window,
            softcap=softcap,
            sinks=s_aux,
        )
        return out, None
    group, index_in_group = cache.layer_index_to_group_indices[module.layer_idx]
    pages = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    k_cache = cache.key_cache[index_in_group].view(pages)
    v_cache = cache.value_cache[index_in_group].view(pages)
    batch = key.shape[2]
    # cu_seq_lens_k counts the new token too: the cache held one fewer before this step.
    cache_seqlens = cu_seq_lens_k[1 : batch + 1] - cu_seq_lens_k[:batch] - 1
    out = attention_with_kvcache(
        query[0].transpose(0, 1)[:, None],  # [B, 1, Hq, D]
        k_cache,
        v_cache,
        cache_seqlens.to(torch.int32),
        key[0].transpose(0, 1)[:, None],
        value[0].transpose(0, 1)[:, None],
        block_table=block_table[group],
        softmax_scale=scale,
        causal=True,
        window_size=window,
        softcap=softcap,
        sinks=s_aux,
    )
    return out[:, 0], None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
AttentionInterface.register(PAGED_NAME, paged_attention_forward)
