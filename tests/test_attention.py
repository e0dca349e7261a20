"""safeattn.attention against the float64 reference (reference.attention), plus the safe
semantics, gradients, opcheck, torch.compile and argument checks.

Tolerance (FlashAttention's rule): the kernel's error against the float64 reference must be at
most 2x (3x for gradients) the error of PyTorch computing the same formula in the same low
precision (reference.attention with compute_dtype=<input dtype>), plus a small absolute floor.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safeattn
import torch
import torch.nn.functional as F
from conftest import ATTENTION_DEVICES as DEVICES
from conftest import HAS_CUDA_ATTENTION as _HAS_CUDA_KERNEL
from safeattn import reference
from safeattn._testing import attention_path

FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3, torch.float64: 1e-10}


def _qkv(batch, hq, hkv, q_len, kv_len, head_dim, dtype, device, *, dv=None, transposed=False, seed=0):
    """Random q, k, v (requires_grad). transposed: Transformers' [B, S, H, D].transpose(1, 2) views."""
    gen = torch.Generator().manual_seed(seed)
    dv = head_dim if dv is None else dv

    def make(h, s, d):
        if transposed:
            t = torch.randn(batch, s, h, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(batch, h, s, d, generator=gen).to(device=device, dtype=dtype)
        return t.requires_grad_()

    return make(hq, q_len, head_dim), make(hkv, kv_len, head_dim), make(hkv, kv_len, dv)


def _max_err(got, want):
    """Max |got - want| over elements, with matching infinities counted as equal."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    same = (got == want) | (got.isnan() & want.isnan())
    diff = (got - want).abs().masked_fill(same, 0.0)
    return diff.max().item() if diff.numel() else 0.0


def _compare(name, got, ref64, ref_low, factor, floor):
    err = _max_err(got, ref64)
    yard = _max_err(ref_low, ref64)
    assert (
        err <= factor * yard + floor
    ), f"{name}: error {err:.3g} > {factor} x PyTorch's {yard:.3g} + {floor:g}"


def _check_against_reference(
    q, k, v, *, grads=True, check_lse_grad=False, extra_grad_inputs=(), reference_mask=None, **kwargs
):
    """Runs kernel, float64 reference and low-precision reference; compares out, lse and grads.
    ``reference_mask``: the references' ``attn_mask`` where the kernel's is not a tensor (a
    MaskDescription)."""
    dtype = q.dtype
    out, lse = safeattn.attention(q, k, v, **kwargs)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    if reference_mask is not None:
        kwargs = {**kwargs, "attn_mask": reference_mask}
    ref_out, ref_lse = reference.attention(q, k, v, **kwargs)
    low_dtype = dtype if dtype != torch.float64 else torch.float32
    low_out, low_lse = reference.attention(q, k, v, compute_dtype=low_dtype, **kwargs)
    floor = FLOOR[dtype]
    _compare("out", out, ref_out, low_out, 2, floor)
    _compare("lse", lse, ref_lse, low_lse, 2, floor)
    # -inf lse exactly where the reference has it (fully masked rows).
    assert torch.equal(
        lse.isneginf().cpu(), ref_lse.isneginf().cpu()
    ), "lse -inf rows differ from the reference"
    if not grads:
        return out, lse
    inputs = (q, k, v, *extra_grad_inputs)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=dtype)
    grad_lse = torch.randn(lse.shape, generator=gen).to(lse.device) if check_lse_grad else None

    def grads_of(o, lse_, cast):
        outs, gs = [o], [grad_out.to(cast)]
        if grad_lse is not None:
            finite = lse_.isfinite()
            outs.append(torch.where(finite, lse_, 0.0))
            gs.append(grad_lse.to(cast))
        return torch.autograd.grad(outs, inputs, gs)

    got = grads_of(out, lse, dtype)
    want = grads_of(ref_out, ref_lse, torch.float64)
    low = grads_of(low_out, low_lse, low_dtype)
    names = ["grad_query", "grad_key", "grad_value"] + [
        f"grad_extra{i}" for i in range(len(extra_grad_inputs))
    ]
    for name, g, w, lo in zip(names, got, want, low, strict=True):
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        # Gradients scale with the values they multiply: the floor follows their magnitude.
        scale = max(1.0, w.abs().max().item())
        _compare(name, g, w, lo, 3, floor * scale * 4)
    return out, lse


# Sampled grid: head dims 32, 64, 80, 128, 256; Q and KV lengths 1, 17, 128, 1000 taken
# independently; GQA groups 1, 2, 8; every dtype; causal top-left and bottom-right.
GRID = [
    # (head_dim, q_len, kv_len, hq, hkv, dtype, causal)
    (32, 1, 1, 2, 2, torch.float32, None),
    (32, 17, 1000, 8, 1, torch.bfloat16, None),
    (64, 1, 1000, 8, 1, torch.float32, "bottom_right"),
    (64, 128, 128, 4, 2, torch.float16, "top_left"),
    (64, 1000, 17, 2, 2, torch.float32, None),
    (80, 17, 17, 2, 1, torch.bfloat16, "top_left"),
    (80, 128, 1000, 2, 2, torch.float32, "bottom_right"),
    (128, 1, 128, 8, 8, torch.bfloat16, None),
    (128, 1000, 1000, 2, 1, torch.bfloat16, "top_left"),
    (128, 17, 128, 16, 2, torch.float32, None),
    (256, 128, 17, 2, 2, torch.float16, "bottom_right"),
    (256, 17, 1000, 2, 1, torch.float32, "top_left"),
    (256, 1000, 128, 2, 2, torch.bfloat16, None),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("head_dim", "q_len", "kv_len", "hq", "hkv", "dtype", "causal"), GRID)
def test_matches_reference(device, head_dim, q_len, kv_len, hq, hkv, dtype, causal):
    q, k, v = _qkv(1, hq, hkv, q_len, kv_len, head_dim, dtype, device)
    kwargs = {"enable_gqa": hq != hkv}
    if causal is not None:
        kwargs["is_causal"] = True
        kwargs["q_offset"] = kv_len - q_len if causal == "bottom_right" else 0
    _check_against_reference(q, k, v, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_value_dim_and_transposed_views(device, dtype):
    # Transformers' layout: [B, S, H, D] transposed to [B, H, S, D], read in place; Dv != D.
    q, k, v = _qkv(3, 4, 2, 33, 70, 64, dtype, device, dv=40, transposed=True)
    assert not q.is_contiguous()
    out, _ = safeattn.attention(q, k, v, enable_gqa=True, is_causal=True)
    assert out.shape == (3, 4, 33, 40)
    assert out.transpose(1, 2).is_contiguous(), f"out must be stored [B, Q, H, Dv], strides {out.stride()}"
    _check_against_reference(q, k, v, enable_gqa=True, is_causal=True)


def _sdpa_mask_cases(batch, q_len, kv_len):
    pad = torch.ones(batch, kv_len, dtype=torch.bool)
    pad[0, :5] = False  # left padding: the first queries of batch 0 see nothing
    ids = torch.arange(kv_len).div(11, rounding_mode="floor").expand(batch, kv_len).contiguous()
    blocks = torch.full((batch, kv_len), -1)
    blocks[:, 10:20] = 3
    return {
        "causal": {},
        "bidirectional": {"causal": False},
        "sliding": {"sliding_window": 7},
        "sliding_bidirectional": {"causal": False, "sliding_window": 5},
        "chunked_left_padding": {"chunk_size": 8, "chunk_left_padding": torch.tensor([5, 0])[:batch]},
        "padding": {"padding_mask": pad},
        "sliding_padding": {"sliding_window": 4, "padding_mask": pad},
        "packed": {"packed_ids": ids},
        "blocks": {"block_ids": blocks},
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(_sdpa_mask_cases(2, 1, 1)))
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_sdpa_mask_kinds(device, kind, mask_dtype):
    batch, q_len, kv_len = 2, 40, 40
    kw = _sdpa_mask_cases(batch, q_len, kv_len)[kind]
    mask = safeattn.sdpa_mask(batch, q_len, kv_len, dtype=mask_dtype, **kw).to(device)
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, 32, torch.float32, device)
    if kind == "padding":
        # Left-padded queries 0..4 of batch 0 see no key: out 0, lse -inf (the safe semantics).
        out, lse = safeattn.attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.all(out[0, :, :5] == 0) and torch.all(
            lse[0, :, :5].isneginf()
        ), "fully masked rows not 0/-inf"
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True)


# Described masks: attention(MaskDescription) is attention with the mask sdpa_mask would build.
# The sdpa_mask kinds above, and three more combinations of padding.
_DESCRIBED_KINDS = [
    *_sdpa_mask_cases(2, 1, 1),
    "right_padding",
    "bidirectional_padding",
    "packed_padding",
    "chunked_bidirectional",
    "sliding_chunked_padding",
    "packed_runs",
    "sliding_packed_runs_padding",
]
# Kinds whose description promises packed ids in runs (they are: arange // 11), so that attention
# runs them as key ranges.
_RUNS_KINDS = ("packed_runs", "sliding_packed_runs_padding")


def _described_kwargs(kind, batch, width):
    """sdpa_mask's rule keywords for `kind` over key positions 0 .. width - 1."""
    cases = _sdpa_mask_cases(batch, width, width)
    right = torch.ones(batch, width, dtype=torch.long)
    right[1, width - 9 :] = 0  # right padding: the last keys of row 1
    extra = {
        "right_padding": {"padding_mask": right},
        "bidirectional_padding": {"causal": False, "padding_mask": cases["padding"]["padding_mask"]},
        "packed_padding": {**cases["packed"], "padding_mask": cases["padding"]["padding_mask"]},
        "chunked_bidirectional": {**cases["chunked_left_padding"], "causal": False},
        "sliding_chunked_padding": {
            **cases["sliding_padding"],
            "chunk_size": 6,
            "chunk_left_padding": torch.tensor([0, 2])[:batch],
        },
        "packed_runs": cases["packed"],
        "sliding_packed_runs_padding": {**cases["packed"], **cases["sliding_padding"]},
    }
    return dict({**cases, **extra}[kind])


def _described(kw, device, runs=False):
    """The MaskDescription of sdpa_mask's keywords `kw`, its tensors on `device` (runs: packed ids
    promised in runs)."""
    return safeattn.MaskDescription(
        **{n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()},
        packed_ids_are_runs=runs,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(_DESCRIBED_KINDS))
@pytest.mark.parametrize(
    ("q_len", "kv_len", "q_offset", "kv_offset"), [(40, 40, 0, 0), (9, 45, 36, 0), (1, 30, 34, 6)]
)
def test_described_masks_match_sdpa_mask(device, kind, q_len, kv_len, q_offset, kv_offset):
    # Every mask kind at three placements (prefill; a chunk of queries at the end of the keys;
    # one decoded query over keys that start at 6): the description materialises bit for bit
    # to the reference's mask, and attention with it gives what the references give with that
    # mask, forward and backward, fully masked rows included.
    batch = 2
    kw = _described_kwargs(kind, batch, kv_offset + kv_len)
    description = safeattn.MaskDescription(**kw)
    dense = reference.sdpa_mask(batch, q_len, kv_len, q_offset, kv_offset, **kw)
    drawn = description.materialise(batch, q_len, kv_len, q_offset=q_offset, kv_offset=kv_offset)
    assert torch.equal(drawn, dense), f"{kind}: materialise differs from the reference mask"
    description = _described(kw, device, runs=kind in _RUNS_KINDS)
    assert description.has_key_ranges() == (kind in _RUNS_KINDS or kind.startswith(("sliding", "chunked")))
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, 32, torch.float32, device)
    _check_against_reference(
        q,
        k,
        v,
        attn_mask=description,
        enable_gqa=True,
        q_offset=q_offset,
        kv_offset=kv_offset,
        reference_mask=dense.to(device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["padding", "sliding_padding", "packed_padding"])
def test_described_masks_low_precision(device, dtype, kind):
    batch, q_len, kv_len = 2, 130, 130  # more than one tile each way
    kw = _described_kwargs(kind, batch, kv_len)
    dense = reference.sdpa_mask(batch, q_len, kv_len, **kw)
    description = _described(kw, device)
    q, k, v = _qkv(batch, 4, 4, q_len, kv_len, 64, dtype, device)
    out, lse = _check_against_reference(q, k, v, attn_mask=description, reference_mask=dense.to(device))
    dense_out, dense_lse = safeattn.attention(q, k, v, dense.to(device))
    torch.testing.assert_close(out, dense_out, msg=f"{kind}: description against its dense mask")
    torch.testing.assert_close(lse, dense_lse)


def test_described_causal_padding_is_never_drawn(monkeypatch):
    # Causality, key padding, windows and chunks run as is_causal, a [B, 1, 1, KV] key mask at
    # the call's positions and key ranges: sdpa_mask is never called. Packed ids and blocks are
    # drawn (for now).
    batch, q_len, kv_len, kv_offset = 2, 5, 12, 3
    pad = torch.ones(batch, kv_offset + kv_len, dtype=torch.long)
    pad[0, :7] = 0
    q, k, v = _qkv(batch, 2, 2, q_len, kv_len, 16, torch.float32, "cpu")
    from safeattn import ops

    mask, is_causal, ranges = ops._described_mask(
        safeattn.MaskDescription(padding_mask=pad), q, k, 10, kv_offset
    )
    assert is_causal and mask.dtype == torch.bool and mask.shape == (batch, 1, 1, kv_len) and ranges is None
    assert torch.equal(mask[:, 0, 0], pad[:, kv_offset:].bool())
    mask, is_causal, ranges = ops._described_mask(safeattn.MaskDescription(causal=False), q, k, 0, 0)
    assert mask is None and not is_causal and ranges is None, "bidirectional without padding: no mask at all"
    window = safeattn.MaskDescription(sliding_window=3, padding_mask=pad)
    mask, is_causal, ranges = ops._described_mask(window, q, k, 10, kv_offset)
    assert is_causal and mask.shape == (batch, 1, 1, kv_len), "a window: is_causal and the key mask"
    assert ranges.dtype == torch.int32 and ranges.shape == (batch, q_len, 2)
    # Query 0 is at position 10: keys at positions 8, 9, 10 (indices 5, 6, 7) are its window.
    # (the end is the keys' end: causality is is_causal's).
    assert ranges[0, 0].tolist() == [5, kv_len] and ranges[1, 4].tolist() == [9, kv_len]
    blocks = torch.full((batch, kv_offset + kv_len), -1)
    mask, is_causal, ranges = ops._described_mask(
        safeattn.MaskDescription(block_ids=blocks), q, k, 10, kv_offset
    )
    assert not is_causal and ranges is None, "blocks reach past the diagonal: is_causal would hide them"

    def no_drawing(*args, **kwargs):
        raise AssertionError("sdpa_mask called for a causal + padding + window + chunk description")

    monkeypatch.setattr(ops, "sdpa_mask", no_drawing)
    chunks = safeattn.MaskDescription(sliding_window=4, chunk_size=3, padding_mask=pad)
    ids = torch.arange(kv_offset + kv_len).div(4, rounding_mode="floor").expand(batch, -1)
    runs = safeattn.MaskDescription(packed_ids=ids, packed_ids_are_runs=True, padding_mask=pad)
    for description in (safeattn.MaskDescription(padding_mask=pad), window, chunks, runs):
        out, lse = safeattn.attention(q, k, v, description, q_offset=10, kv_offset=kv_offset)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("description", "kwargs", "message"),
    [
        ({}, {"is_causal": True}, "is_causal must be False"),
        (
            {"padding_mask": torch.ones(3, 8, dtype=torch.bool)},
            {},
            r"padding_mask must be \[B, L\] with B = 2",
        ),
        ({"padding_mask": torch.ones(8, dtype=torch.bool)}, {}, "padding_mask must be"),
        ({"padding_mask": torch.ones(2, 8)}, {}, "padding_mask must be bool or integer"),
        ({"padding_mask": torch.ones(2, 8), "sliding_window": 3}, {}, "padding_mask must be bool or integer"),
        ({}, {"q_offset": -1}, "q_offset and kv_offset are positions"),
        ({"sliding_window": 0}, {}, "sliding_window"),
        ({"packed_ids": torch.zeros(2, 3, dtype=torch.long)}, {}, "packed_ids"),
        ({"chunk_size": -2}, {}, "chunk_size"),
        ({"chunk_size": 4, "chunk_left_padding": torch.zeros(3, dtype=torch.long)}, {}, "chunk_left_padding"),
        ({"chunk_size": 4, "chunk_left_padding": torch.zeros(2)}, {}, "chunk_left_padding"),
        (
            {"sliding_window": 3},
            {"key_ranges": torch.zeros(2, 4, 2, dtype=torch.int32)},
            "key_ranges must be None",
        ),
    ],
)
def test_described_mask_bad_inputs(description, kwargs, message):
    q, k, v = _qkv(2, 2, 2, 4, 8, 16, torch.float32, "cpu")
    with pytest.raises((ValueError, RuntimeError), match=message):
        safeattn.attention(q, k, v, safeattn.MaskDescription(**description), **kwargs)


def _random_key_ranges(batch, q_len, kv_len, seed=0):
    """[B, Q, 2] int32 key ranges of every kind: empty (hi <= lo), reaching past both ends of the
    keys, narrow and wide."""
    gen = torch.Generator().manual_seed(seed)
    lo = torch.randint(-6, kv_len + 6, (batch, q_len), generator=gen)
    width = torch.randint(-4, kv_len, (batch, q_len), generator=gen)
    return torch.stack((lo, lo + width), -1).to(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_kind", ["none", "key_mask", "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_key_ranges_match_reference(device, mask_kind, causal):
    # key_ranges ANDed with every kind of mask and with is_causal (bottom-right), GQA, forward
    # and backward against the reference's drawn ranges; rows the ranges empty give 0 / -inf.
    batch, q_len, kv_len = 2, 37, 45
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, 32, torch.float32, device)
    ranges = _random_key_ranges(batch, q_len, kv_len).to(device)
    gen = torch.Generator().manual_seed(3)
    mask = {
        "none": None,
        "key_mask": torch.rand(batch, 1, 1, kv_len, generator=gen) > 0.2,
        "bool": torch.rand(batch, 4, q_len, kv_len, generator=gen) > 0.3,
        "float": torch.randn(1, 4, q_len, kv_len, generator=gen),
    }[mask_kind]
    mask = None if mask is None else mask.to(device)
    out, lse = _check_against_reference(
        q, k, v, attn_mask=mask, key_ranges=ranges, is_causal=causal, q_offset=kv_len - q_len, enable_gqa=True
    )
    empty = ranges[..., 1] <= ranges[..., 0]
    assert empty.any(), "the ranges must empty some rows"
    assert torch.all(out.detach().permute(0, 2, 1, 3)[empty] == 0) and torch.all(
        lse.permute(0, 2, 1)[empty].isneginf()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", ["packed", "random"])
def test_key_ranges_cpu_across_tiles(dtype, shape):
    # The CPU kernels read key ranges themselves (a 64-row query tile walks the union of its rows'
    # ranges, 512 keys at a time, and masks each element outside its row's): ranges across both
    # tile sizes, packed documents (a row's range ends where another's begins inside one key tile),
    # rows with none, ranges past both ends. Forward and backward against the float64 reference's
    # drawn ranges; then NaN keys that no range reaches (never read, or masked whatever their
    # score) must not reach the forward.
    batch, q_len, kv_len = 2, 150, 1100
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, 32, dtype, "cpu")
    if shape == "packed":
        # Query i belongs to document i * 7 // q_len of 7, which holds keys [starts[d], ends[d]):
        # one of a single key, some ending where the next begins, gaps between others.
        starts = torch.tensor([0, 90, 91, 400, 530, 700, 1023])
        ends = torch.tensor([80, 91, 380, 530, 690, 1000, 1090])
        doc = torch.arange(q_len) * 7 // q_len
        ranges = torch.stack((starts[doc], ends[doc]), -1).expand(batch, q_len, 2).to(torch.int32)
        ranges = ranges.clone()
        ranges[1, 10:20] = torch.tensor([5, 5], dtype=torch.int32)  # rows with no key
    else:
        ranges = _random_key_ranges(batch, q_len, kv_len, seed=4)
    for backward in (False, True):
        path = attention_path(q, k, v, enable_gqa=True, key_ranges=ranges, backward=backward)
        assert path.kernel == "cpu" and not path.key_ranges_drawn, f"the CPU kernels read key ranges: {path}"
    out, lse = _check_against_reference(q, k, v, key_ranges=ranges, enable_gqa=True)
    empty = ranges[..., 1] <= ranges[..., 0]
    assert torch.all(out.detach().permute(0, 2, 1, 3)[empty] == 0)
    assert torch.all(lse.permute(0, 2, 1)[empty].isneginf())

    reached = torch.zeros(batch, kv_len, dtype=torch.bool)
    for b in range(batch):
        for lo, hi in ranges[b].tolist():
            reached[b, max(lo, 0) : max(min(hi, kv_len), 0)] = True
    unreached = ~reached
    assert unreached.any() or shape == "random", "some key must be outside every range"
    # (Values are multiplied by p = 0 in a shared key tile, where NaN would leak, as with a drawn
    # mask; and so are NaN keys into dQ: the forward only.)
    with torch.no_grad():
        k_nan = k.detach().clone()
        k_nan[unreached.unsqueeze(1).expand(-1, k.shape[1], -1)] = float("nan")
        out_nan, lse_nan = safeattn.attention(q, k_nan, v, key_ranges=ranges, enable_gqa=True)
    assert not out_nan.isnan().any() and not lse_nan.isnan().any(), "a NaN key outside every range leaked"
    assert torch.equal(out_nan, out.detach()) and torch.equal(lse_nan, lse.detach())


@pytest.mark.parametrize(
    ("key_ranges", "message"),
    [
        (torch.zeros(2, 4, 2, dtype=torch.long), "key_ranges must have dtype Int"),
        (torch.zeros(2, 4, 3, dtype=torch.int32), r"key_ranges must be \[batch, q_length, 2\]"),
        (torch.zeros(1, 4, 2, dtype=torch.int32), r"key_ranges must be \[batch, q_length, 2\]"),
        (torch.zeros(2, 4, dtype=torch.int32), r"key_ranges must be \[batch, q_length, 2\]"),
    ],
)
def test_key_ranges_bad_inputs(key_ranges, message):
    q, k, v = _qkv(2, 2, 2, 4, 8, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=message):
        safeattn.attention(q, k, v, key_ranges=key_ranges)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_described_masks_compile_fullgraph_dynamic(device):
    # Descriptions made inside and passed into a compiled function trace without a break, with
    # symbolic lengths and offsets, and give eager's values and gradients.
    def fn(q, k, v, keep, ids):
        q_offset = k.shape[2] - q.shape[2]
        padded, _ = safeattn.attention(
            q, k, v, safeattn.MaskDescription(padding_mask=keep), q_offset=q_offset
        )
        packed, _ = safeattn.attention(
            q, k, v, safeattn.MaskDescription(packed_ids=ids, padding_mask=keep), q_offset=q_offset
        )
        window = safeattn.MaskDescription(sliding_window=5, chunk_size=7, padding_mask=keep)
        windowed, _ = safeattn.attention(q, k, v, window, q_offset=q_offset)
        return padded.float().square().sum() + packed.float().sum() + windowed.float().abs().sum()

    def inputs(q_len, kv_len):
        q, k, v = _qkv(2, 2, 2, q_len, kv_len, 32, torch.float32, device)
        keep = torch.ones(2, kv_len, dtype=torch.bool, device=device)
        keep[0, :4] = False
        ids = (torch.arange(kv_len, device=device) // 5).expand(2, kv_len).contiguous()
        return (q, k, v, keep, ids), (q, k, v)

    _assert_compiled_matches_eager(fn, inputs)


def _assert_compiled_matches_eager(fn, inputs):
    """fn compiled with fullgraph=True, dynamic=True gives eager's value and gradients at two
    sizes (the second runs the graph with symbolic sizes). ``inputs(q_len, kv_len)`` gives
    (fn's arguments, the ones to differentiate)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for q_len, kv_len in ((9, 17), (12, 33)):
        args, wrt = inputs(q_len, kv_len)
        want = fn(*args)
        want_grads = torch.autograd.grad(want, wrt)
        got = compiled(*args)
        got_grads = torch.autograd.grad(got, wrt)
        torch.testing.assert_close(got, want, msg="compiled forward differs from eager")
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, msg="compiled backward differs from eager")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_bool_mask_fully_masked_rows(device, dtype):
    gen = torch.Generator().manual_seed(3)
    q_len, kv_len = 37, 600  # several key tiles
    mask = torch.rand(2, 1, q_len, kv_len, generator=gen) > 0.7
    mask[0, 0, [0, 5, 36]] = False
    mask[1, 0, 17] = False
    q, k, v = _qkv(2, 2, 2, q_len, kv_len, 64, dtype, device)
    mask = mask.to(device)
    out, lse = safeattn.attention(q, k, v, attn_mask=mask)
    rows = [(0, 0), (0, 5), (0, 36), (1, 17)]
    for b, i in rows:
        assert torch.all(out[b, :, i] == 0), f"out row ({b}, {i}) not 0"
        assert torch.all(lse[b, :, i].isneginf()), f"lse row ({b}, {i}) not -inf"
    _check_against_reference(q, k, v, attn_mask=mask)
    gq, gk, gv = torch.autograd.grad(out.float().sum() + torch.where(lse.isfinite(), lse, 0).sum(), (q, k, v))
    for b, i in rows:
        assert torch.all(gq[b, :, i] == 0), f"grad_query row ({b}, {i}) not 0"
    assert all(g.isfinite().all() for g in (gq, gk, gv)), "non-finite gradient"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bias_shape",
    [(40, 70), (4, 40, 70), (1, 4, 40, 70), (2, 1, 40, 70), (2, 1, 1, 70), (2, 4, 40, 1), (1, 1, 40, 70)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_bias_gradient(device, bias_shape, dtype):
    q, k, v = _qkv(2, 4, 2, 40, 70, 32, dtype, device)
    gen = torch.Generator().manual_seed(5)
    bias_dtype = torch.float32 if len(bias_shape) == 4 and bias_shape[0] == 1 else dtype
    bias = torch.randn(bias_shape, generator=gen).to(device=device, dtype=bias_dtype)
    bias[..., -1:] = float("-inf") if bias_shape[-1] > 1 else bias[..., -1:]  # a masked column
    bias.requires_grad_()
    _check_against_reference(q, k, v, attn_mask=bias, enable_gqa=True, extra_grad_inputs=(bias,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_bias_gradient_several_tiles(device, causal):
    # Several query and key tiles; with causal, whole tiles are skipped and their bias gradient
    # must still be written (0).
    q, k, v = _qkv(1, 2, 2, 150, 300, 32, torch.float32, device)
    gen = torch.Generator().manual_seed(6)
    bias = torch.randn(1, 2, 150, 300, generator=gen).to(device).requires_grad_()
    _check_against_reference(q, k, v, attn_mask=bias, is_causal=causal, extra_grad_inputs=(bias,))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradient_is_deterministic_across_threads(device):
    q, k, v = _qkv(2, 8, 2, 50, 300, 32, torch.float32, device)
    bias = torch.randn(1, 1, 50, 300, device=device, requires_grad=True)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            out, lse = safeattn.attention(q, k, v, bias, enable_gqa=True)
            results.append(torch.autograd.grad(out.sum(), (q, k, v, bias)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b), "gradients differ between runs / thread counts"


@pytest.fixture
def deterministic_fill():
    """torch.use_deterministic_algorithms(True) with fill_uninitialized_memory on (ATen fills
    every new tensor with NaN); both restored after the test."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_outputs_skip_the_fill_and_are_written_in_full(device, deterministic_fill):
    """Under deterministic algorithms ATen fills each new tensor; the output and the gradients,
    which the kernels write in full, skip that pass. They stay right where their memory held NaN
    before the call (the CUDA caching allocator hands back the blocks just freed): rows that see no
    key, padded keys, GQA, Transformers' [B, S, H, D] layout."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, hq, hkv, q_len, kv_len, head_dim = 2, 4, 2, 384, 384, 64
    q, k, v = _qkv(batch, hq, hkv, q_len, kv_len, head_dim, dtype, device, transposed=True, seed=3)
    padding = torch.ones(batch, kv_len, dtype=torch.bool)
    padding[1, :100] = False  # left padding: row 1's first 100 queries see no key under causality
    mask = safeattn.sdpa_mask(batch, q_len, kv_len, padding_mask=padding).to(device)
    grad_out = torch.randn(batch, hq, q_len, head_dim, generator=torch.Generator().manual_seed(4))
    grad_out = grad_out.to(device=device, dtype=dtype)

    def poison():
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            for t in (q, k, v) * 3:
                torch.full(t.shape, float("nan"), device=device, dtype=dtype)

    with torch.profiler.profile(record_shapes=True) as prof:
        poison()
        out, lse = safeattn.attention(q, k, v, attn_mask=mask, enable_gqa=True)
        poison()
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    # The fills of safeattn's own allocations (aten::empty called by a safeattn op) of the outputs'
    # shapes; copies that ATen ops make inside (masked_fill's clone) are theirs.
    written = {tuple(t.shape) for t in (q, k, v, out, *grads)} | {(batch, q_len, hq, head_dim)}

    def filled_by_safeattn(e):
        empty = e.cpu_parent
        return (
            e.name == "aten::fill_"
            and tuple(e.input_shapes[0]) in written
            and empty is not None
            and empty.name == "aten::empty"
            and empty.cpu_parent is not None
            and empty.cpu_parent.name.startswith("safeattn::")
        )

    filled = [e.input_shapes[0] for e in prof.events() if filled_by_safeattn(e)]
    assert not filled, f"the outputs were filled before the kernels wrote them: {filled}"

    torch.use_deterministic_algorithms(False)
    ref_out, ref_lse = reference.attention(q, k, v, attn_mask=mask, enable_gqa=True)
    low_out, _ = reference.attention(q, k, v, attn_mask=mask, enable_gqa=True, compute_dtype=dtype)
    _compare("out", out, ref_out, low_out, 2, FLOOR[dtype])
    assert torch.equal(lse.isneginf().cpu(), ref_lse.isneginf().cpu()), "lse -inf rows differ"
    want = torch.autograd.grad(ref_out, (q, k, v), grad_out.double())
    low = torch.autograd.grad(low_out, (q, k, v), grad_out)
    for name, g, w, lo in zip(("grad_query", "grad_key", "grad_value"), grads, want, low, strict=True):
        _compare(name, g, w, lo, 3, FLOOR[dtype] * max(1.0, w.abs().max().item()) * 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(device, dtype):
    q, k, v = _qkv(1, 4, 2, 45, 300, 64, dtype, device)
    with torch.no_grad():
        q.mul_(4)  # large scores, so that the cap matters
    mask = safeattn.sdpa_mask(1, 45, 300, q_offset=255, sliding_window=100, dtype=dtype).to(device)
    _check_against_reference(q, k, v, attn_mask=mask, softcap=2.0, enable_gqa=True)


@pytest.mark.parametrize("q_len", [1, 3, 16, 17])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "strided_d"])
def test_cpu_decoding_steps(q_len, layout):
    """float32 calls of up to 16 query rows read K in place on the CPU (no packed K^T); 17 rows
    and a K whose head dim is strided take the packed route. Both against the reference: two key
    tiles, GQA, causal bottom-right, a row masked out entirely, a softcap, sinks."""
    batch, hq, hkv, kv_len, head_dim = 2, 8, 2, 700, 64
    gen = torch.Generator().manual_seed(q_len)
    q = torch.randn(batch, hq, q_len, head_dim, generator=gen).requires_grad_()
    if layout == "bhsd":
        k = torch.randn(batch, hkv, kv_len, head_dim, generator=gen)
    elif layout == "bshd":  # Transformers' and the KV caches' layout, read through a transpose
        k = torch.randn(batch, kv_len, hkv, head_dim, generator=gen).transpose(1, 2)
    else:  # the head dim strided: packed
        k = torch.randn(batch, hkv, kv_len, 2 * head_dim, generator=gen)[..., ::2]
    k = k.requires_grad_()
    v = torch.randn(batch, hkv, kv_len, head_dim, generator=gen).requires_grad_()
    sinks = torch.randn(hq, generator=gen)
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    mask &= torch.arange(kv_len) <= torch.arange(q_len)[:, None] + kv_len - q_len
    mask[1, 0, 0] = False  # a row that sees no key
    mask[0, 0, :, :37] = False
    _check_against_reference(
        q, k, v, attn_mask=mask, softcap=30.0, sinks=sinks, enable_gqa=True, check_lse_grad=True
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks(device, dtype):
    q, k, v = _qkv(2, 4, 2, 30, 90, 64, dtype, device)
    sinks = torch.randn(4, device=device, requires_grad=True)
    mask = torch.ones(2, 1, 30, 90, dtype=torch.bool, device=device)
    mask[1, 0, :3] = False  # fully masked rows: out 0, lse = the sink logit
    out, lse = safeattn.attention(q, k, v, attn_mask=mask, sinks=sinks, enable_gqa=True)
    assert torch.all(out[1, :, :3] == 0), "fully masked rows with sinks must be 0"
    torch.testing.assert_close(
        lse[1, :, :3], sinks.detach().float()[:, None].expand(4, 3), msg="lse must be the sink"
    )
    _check_against_reference(
        q, k, v, attn_mask=mask, sinks=sinks, enable_gqa=True, check_lse_grad=True, extra_grad_inputs=(sinks,)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_sink_of_minus_inf_on_empty_rows(device):
    # A sink of -inf is no sink: a row with no visible key then has lse -inf, and every
    # gradient, the sinks' included, is finite and 0 there (exp(sink - lse) is not NaN).
    q, k, v = _qkv(2, 4, 2, 30, 90, 64, torch.bfloat16, device)
    sinks = torch.tensor([-float("inf"), 1.0, -float("inf"), 3.0], device=device, requires_grad=True)
    mask = torch.ones(2, 1, 30, 90, dtype=torch.bool, device=device)
    mask[1, 0, :5] = False  # fully masked rows
    out, lse = safeattn.attention(q, k, v, attn_mask=mask, sinks=sinks, enable_gqa=True)
    assert torch.all(lse[1, [0, 2], :5].isneginf()), "no key and a sink of -inf: lse -inf"
    grad_sinks = torch.autograd.grad(out.float().sum() + torch.where(lse.isfinite(), lse, 0.0).sum(), sinks)[
        0
    ]
    assert grad_sinks.isfinite().all(), f"grad_sinks not finite: {grad_sinks}"
    assert torch.all(grad_sinks[[0, 2]] == 0), "a sink of -inf gets no gradient"
    _check_against_reference(
        q, k, v, attn_mask=mask, sinks=sinks, enable_gqa=True, check_lse_grad=True, extra_grad_inputs=(sinks,)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_lse_gradient(device):
    q, k, v = _qkv(1, 2, 2, 20, 45, 32, torch.float32, device)
    _check_against_reference(q, k, v, is_causal=True, check_lse_grad=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("q_len", "kv_len"), [(1, 9), (5, 9), (9, 9), (9, 5), (70, 600)])
def test_causal_alignments(device, q_len, kv_len):
    q, k, v = _qkv(1, 2, 2, q_len, kv_len, 32, torch.float32, device)
    top_left, _ = safeattn.attention(q, k, v, is_causal=True)
    want = torch.ones(q_len, kv_len, dtype=torch.bool).tril().to(device)
    explicit, _ = safeattn.attention(q, k, v, attn_mask=want)
    torch.testing.assert_close(top_left, explicit, msg="top-left causal != explicit tril mask")
    if q_len <= kv_len:  # every row sees a key: SDPA agrees
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(top_left, sdpa, msg="top-left causal != SDPA is_causal")
    bottom_right, _ = safeattn.attention(q, k, v, is_causal=True, q_offset=kv_len - q_len)
    want = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len).to(device)
    explicit, _ = safeattn.attention(q, k, v, attn_mask=want)
    torch.testing.assert_close(bottom_right, explicit, msg="bottom-right causal != tril(KV - Q) mask")
    # kv_offset shifts the other way; causal and a mask are ANDed.
    shifted, _ = safeattn.attention(q, k, v, is_causal=True, q_offset=7, kv_offset=7)
    torch.testing.assert_close(shifted, top_left, msg="equal offsets must not change the mask")
    pad = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    pad[:, 0] = False
    both, _ = safeattn.attention(q, k, v, attn_mask=pad, is_causal=True)
    explicit, _ = safeattn.attention(q, k, v, attn_mask=pad & torch.ones_like(pad).tril())
    torch.testing.assert_close(both, explicit, msg="is_causal with attn_mask must AND them")
    assert torch.all(both[:, :, 0] == 0), "row 0 sees only the padded key: must be 0"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_sdpa(device, dtype):
    q, k, v = _qkv(2, 4, 4, 100, 130, 64, dtype, device)
    mask = (torch.rand(2, 1, 100, 130) > 0.2).to(device)
    mask[..., 0] = True
    for kwargs in ({}, {"attn_mask": mask}, {"is_causal": True}, {"scale": 0.3}):
        got, _ = safeattn.attention(q, k, v, **kwargs)
        want = F.scaled_dot_product_attention(q, k, v, **kwargs)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            got, want, atol=tol, rtol=tol, msg=f"differs from SDPA with {list(kwargs)}"
        )


@pytest.mark.parametrize("device", DEVICES)
def test_nan_poisoned_padding_never_leaks(device):
    # Every input is a view into a larger NaN-filled buffer (padded head dim, sequence, heads);
    # the kernel must read only the view.
    batch, hq, hkv, q_len, kv_len, d = 2, 4, 2, 37, 530, 40

    def poisoned(h, s, dim, grad=True):
        big = torch.full((batch, s + 3, h + 1, dim + 24), float("nan"), device=device)
        view = big[:, 1 : s + 1, :h, 8 : 8 + dim].transpose(1, 2)
        view.copy_(torch.randn(batch, h, s, dim))
        return view.detach().requires_grad_(grad) if grad else view

    q, k, v = poisoned(hq, q_len, d), poisoned(hkv, kv_len, d), poisoned(hkv, kv_len, d)
    big_mask = torch.full((batch, 1, q_len + 2, kv_len + 5), float("nan"), device=device)
    bias = big_mask[:, :, 1 : q_len + 1, 2 : kv_len + 2]
    bias.copy_(torch.randn(batch, 1, q_len, kv_len))
    bias = bias.detach().requires_grad_()
    sinks = torch.randn(hq, device=device, requires_grad=True)
    out, lse = safeattn.attention(q, k, v, bias, is_causal=True, enable_gqa=True, softcap=20.0, sinks=sinks)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN padding leaked into the forward"
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v, bias, sinks))
    assert not any(g.isnan().any() for g in grads), "NaN padding leaked into a gradient"


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates(device):
    q, k, v = _qkv(1, 2, 2, 10, 700, 32, torch.float32, device)
    q, k, v = q.detach().clone(), k.detach().clone(), v.detach().clone()
    q[0, 0, 3, 5] = float("nan")  # one query row
    k[0, 1, 600, 0] = float("nan")  # one key, visible to every row of head 1
    out, lse = safeattn.attention(q, k, v)
    assert out[0, 0, 3].isnan().all() and lse[0, 0, 3].isnan(), "NaN query row must give NaN"
    assert not out[0, 0, [0, 1, 2, 4]].isnan().any(), "NaN must stay in its own row"
    assert out[0, 1].isnan().all() and lse[0, 1].isnan().all(), "NaN key must reach every row that sees it"
    causal_out, _ = safeattn.attention(q, k, v, is_causal=True)
    assert not causal_out[0, 1].isnan().any(), "a NaN key hidden by the causal mask must not leak"


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sizes(device):
    q, k, v = _qkv(1, 2, 2, 5, 0, 16, torch.float32, device)
    out, lse = safeattn.attention(q, k, v)
    assert torch.all(out == 0) and torch.all(lse.isneginf()), "no keys: out 0, lse -inf"
    q0, k0, v0 = _qkv(1, 2, 2, 0, 7, 16, torch.float32, device)
    out0, lse0 = safeattn.attention(q0, k0, v0)
    assert out0.shape == (1, 2, 0, 16) and lse0.shape == (1, 2, 0), "no queries: empty outputs"
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.all(gq == 0) and gk.shape == k.shape and gv.shape == v.shape, "no keys: grad_query 0"


def _small_case(device, dtype=torch.float64):
    q, k, v = _qkv(2, 4, 2, 6, 9, 8, dtype, device)
    bias = torch.randn(1, 4, 6, 9, dtype=dtype, device=device)
    bias[0, 1, 2] = float("-inf")  # one fully masked row
    sinks = torch.randn(4, dtype=dtype, device=device)
    return q, k, v, bias.requires_grad_(), sinks.requires_grad_()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_gradcheck(device):
    q, k, v, bias, sinks = _small_case(device)

    def fn(q, k, v, bias, sinks):
        out, lse = safeattn.attention(
            q, k, v, bias, is_causal=True, enable_gqa=True, q_offset=3, softcap=3.0, sinks=sinks
        )
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v, bias, sinks), eps=1e-6, atol=1e-5)

    def no_sinks(q, k, v, bias):
        out, lse = safeattn.attention(q, k, v, bias, enable_gqa=True)
        return out, torch.where(lse.isfinite(), lse, 0.0)

    assert torch.autograd.gradcheck(no_sinks, (q, k, v, bias), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, k, v, bias, sinks = _small_case(device, torch.float32)
    bool_mask = torch.rand(6, 9, device=device) > 0.3
    samples = [
        ((q, k, v), {"enable_gqa": True}),
        ((q, k, v, bias), {"enable_gqa": True, "is_causal": True, "q_offset": 3}),
        ((q, k, v, bool_mask), {"enable_gqa": True, "softcap": 5.0, "sinks": sinks}),
    ]
    for args, kwargs in samples:
        torch.library.opcheck(torch.ops.safeattn.attention.default, args, kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_compile_fullgraph_dynamic(device):
    def fn(q, k, v, bias, sinks):
        # Bottom-right causal: q_offset is a symbolic size expression under dynamic=True.
        q_offset = k.shape[2] - q.shape[2]
        out, lse = safeattn.attention(
            q, k, v, bias, is_causal=True, enable_gqa=True, softcap=10.0, sinks=sinks, q_offset=q_offset
        )
        return out.transpose(1, 2).float().square().sum() + lse.sum()

    def inputs(q_len, kv_len):
        q, k, v = _qkv(2, 4, 2, q_len, kv_len, 32, torch.float32, device)
        bias = torch.randn(1, 1, q_len, kv_len, device=device, requires_grad=True)
        sinks = torch.randn(4, device=device, requires_grad=True)
        args = (q, k, v, bias, sinks)
        return args, args

    _assert_compiled_matches_eager(fn, inputs)


def _bad_inputs():
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)

    q, k, v = t(1, 4, 5, 8), t(1, 2, 7, 8), t(1, 2, 7, 6)
    return [
        ((t(4, 5, 8), k, v), {}, "attention: query must be 4-D"),
        ((q, t(2, 7, 8), v), {}, "attention: key must be 4-D"),
        (
            (q.long(), k.long(), v.long()),
            {},
            "attention: query must have dtype Float, Half, BFloat16 or Double, got Long",
        ),
        ((q, k.half(), v), {"enable_gqa": True}, "attention: key has dtype Half but query has Float"),
        ((q, k, v.double()), {"enable_gqa": True}, "attention: value has dtype Double but query has Float"),
        (
            (q, t(2, 2, 7, 8), t(2, 2, 7, 6)),
            {"enable_gqa": True},
            "attention: key has batch 2 but query has 1",
        ),
        ((q, k, t(1, 2, 6, 6)), {"enable_gqa": True}, "attention: value has kv_length 6 but key has 7"),
        ((q, k, t(1, 1, 7, 6)), {"enable_gqa": True}, "attention: value has 1 heads but key has 2"),
        ((q, t(1, 2, 7, 16), v), {"enable_gqa": True}, "attention: key has head_dim 16 but query has 8"),
        (
            (q, k, v),
            {},
            re.escape("attention: query has 4 heads but key and value have 2; pass enable_gqa=True"),
        ),
        (
            (q, t(1, 3, 7, 8), t(1, 3, 7, 6)),
            {"enable_gqa": True},
            re.escape("query heads (4) must be a multiple"),
        ),
        ((q, k, v), {"enable_gqa": True, "dropout_p": 0.1}, "attention: dropout_p must be 0"),
        (
            (q, k, v),
            {"enable_gqa": True, "softcap": -1.0},
            re.escape("attention: softcap must be 0 (none) or a finite positive number in float32, got -1"),
        ),
        ((q, k, v), {"enable_gqa": True, "softcap": math.inf}, "attention: softcap must be 0 .* got inf"),
        ((q, k, v), {"enable_gqa": True, "softcap": math.nan}, "attention: softcap must be 0 .* got nan"),
        (
            (q, k, v),
            {"enable_gqa": True, "softcap": 1e-300},
            "attention: softcap must be 0 .* in float32, got 1e-300",
        ),
        (
            (q, k, v),
            {"enable_gqa": True, "scale": math.inf},
            "attention: scale must be a finite number in float32, got inf",
        ),
        (
            (q, k, v),
            {"enable_gqa": True, "scale": 1e39},
            "attention: scale must be a finite number in float32, got 1e\\+39",
        ),
        (
            (q, k, v, t(5, 7, dtype=torch.int64)),
            {"enable_gqa": True},
            "attention: attn_mask must be Bool, Float or the query",
        ),
        (
            (q, k, v, t(5, 6) > 0),
            {"enable_gqa": True},
            re.escape("attention: attn_mask of shape [5, 6] is not broadcastable"),
        ),
        (
            (q, k, v, t(3, 5, 7) > 0),
            {"enable_gqa": True},
            "attention: attn_mask of shape .* is not broadcastable",
        ),
        ((q, k, v, t(7) > 0), {"enable_gqa": True}, "attention: attn_mask must be 2-D, 3-D or 4-D, got 1-D"),
        (
            (q, k, v),
            {"enable_gqa": True, "sinks": t(2)},
            re.escape("attention: sinks must be [num_heads] = [4], got [2]"),
        ),
    ]


@pytest.mark.parametrize(("args", "kwargs", "message"), _bad_inputs())
@pytest.mark.parametrize("mode", ["eager", "meta", "fake"])
def test_bad_inputs(args, kwargs, message, mode):
    if mode == "meta":
        args = tuple(a.to("meta") for a in args)
        kwargs = {n: (a.to("meta") if isinstance(a, torch.Tensor) else a) for n, a in kwargs.items()}
    if mode == "fake":
        with torch._subclasses.FakeTensorMode() as fake_mode:
            args = tuple(fake_mode.from_tensor(a) for a in args)
            kwargs = {
                n: (fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a) for n, a in kwargs.items()
            }
            with pytest.raises(RuntimeError, match=message):
                safeattn.attention(*args, **kwargs)
        return
    with pytest.raises(RuntimeError, match=message):
        safeattn.attention(*args, **kwargs)


def test_device_mismatch_message():
    q = torch.randn(1, 2, 3, 8)
    mask = torch.ones(3, 3, dtype=torch.bool, device="meta")
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    # A meta mask sends the call to the Meta kernel, whose check (the kernels' own) names it.
    with pytest.raises(RuntimeError, match="attention: attn_mask is on meta, expected cpu"):
        safeattn.attention(q, k, v, mask)
    # Under FakeTensorMode the Meta kernel sees every tensor on meta, so the device check is
    # FakeTensorMode's own (every other check is the op's, see test_bad_inputs); torch 2.6 words it
    # "found two different devices cpu, meta".
    with torch._subclasses.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (q, k, v, mask)]
        with pytest.raises(
            RuntimeError, match="found (at least two|two different) devices,? cpu,? (and )?meta"
        ):
            safeattn.attention(*fakes)


def test_fake_strides_match_kernel():
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    out, lse = safeattn.attention(q, k, v)
    with torch._subclasses.FakeTensorMode() as mode:
        fout, flse = safeattn.attention(*(mode.from_tensor(t) for t in (q, k, v)))
    assert (
        fout.stride() == out.stride() and flse.stride() == lse.stride()
    ), "fake strides differ from the kernel's"
    assert out.stride() == (5 * 4 * 8, 8, 4 * 8, 1)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = (torch.randn(1, 2, 6, 20) for _ in range(3))
    a, _ = safeattn.attention(q, k, v)
    b, _ = safeattn.attention(q, k, v, scale=1 / math.sqrt(20))
    torch.testing.assert_close(a, b, msg="default scale must be 1/sqrt(D)")


# ---- CUDA forward: tensor-core kernel and generic path -----------------------------------------
# The tensor-core kernel covers float16 / bfloat16 with D == Dv in TENSOR_CORE_HEAD_DIMS (those the
# build instantiated; the others, D != Dv, float32 and float64 take the generic path, the ATen
# attention_forward_chunked of csrc/ops/attention_composite.cpp). Its tiles
# are 128 queries x 64 keys, so lengths 1, 17, 97, 1025 cut tiles in every way.

_ON_CUDA = torch.cuda.is_available() and _HAS_CUDA_KERNEL
cuda_only = pytest.mark.skipif(not _ON_CUDA, reason="needs a CUDA GPU and the CUDA attention kernel")
TENSOR_CORE_HEAD_DIMS = [32, 64, 80, 96, 128, 256]
LOW_DTYPES = [torch.bfloat16, torch.float16]


def _check_forward(q, k, v, **kwargs):
    return _check_against_reference(q, k, v, grads=False, **kwargs)


@cuda_only
@pytest.mark.parametrize("head_dim", TENSOR_CORE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_head_dims(head_dim, dtype, causal):
    q, k, v = _qkv(2, 4, 2, 97, 200, head_dim, dtype, "cuda")
    _check_forward(q, k, v, enable_gqa=True, is_causal=causal, q_offset=103 if causal else 0)


@cuda_only
@pytest.mark.parametrize("q_len", [1, 17, 97, 1025])
@pytest.mark.parametrize("kv_len", [1, 17, 97, 1025])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_partial_tiles(q_len, kv_len, head_dim):
    q, k, v = _qkv(1, 2, 1, q_len, kv_len, head_dim, torch.bfloat16, "cuda")
    _check_forward(q, k, v, enable_gqa=True)
    # Causal, both alignments: top-left (rows past KV see every key) and bottom-right.
    _check_forward(q, k, v, enable_gqa=True, is_causal=True)
    _check_forward(q, k, v, enable_gqa=True, is_causal=True, q_offset=kv_len - q_len)


@cuda_only
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_cuda_gqa(group, dtype):
    q, k, v = _qkv(2, 8, 8 // group, 150, 333, 64, dtype, "cuda")
    out, _ = _check_forward(q, k, v, enable_gqa=group > 1, is_causal=True, q_offset=183)
    # Head h reads kv head h // group: the same as attention with K/V repeated.
    k_rep = k.detach().repeat_interleave(group, dim=1)
    v_rep = v.detach().repeat_interleave(group, dim=1)
    dense, _ = safeattn.attention(q.detach(), k_rep, v_rep, is_causal=True, q_offset=183)
    assert torch.equal(out, dense), "GQA must equal attention on repeated K/V, bit for bit"


@cuda_only
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_cuda_decode_shapes(q_len, dtype):
    # Decoding: a few queries (one active warp per CTA), a long cache, GQA 8:1, left padding.
    batch, kv_len = 3, 4101
    q, k, v = _qkv(batch, 16, 2, q_len, kv_len, 128, dtype, "cuda")
    pad = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
    pad[1, ..., :1000] = False
    pad[2, ..., :-q_len] = False  # only its own new keys
    pad = pad.to("cuda")
    _check_forward(q, k, v, enable_gqa=True, is_causal=True, q_offset=kv_len - q_len)
    _check_forward(q, k, v, attn_mask=pad, enable_gqa=True, is_causal=True, q_offset=kv_len - q_len)


@cuda_only
@pytest.mark.parametrize(
    "mask_shape",
    [(150, 333), (4, 150, 333), (2, 1, 150, 333), (1, 4, 150, 333), (2, 4, 1, 333), (2, 1, 150, 1)],
)
@pytest.mark.parametrize("mask_dtype", ["bool", "float32", "query"])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_cuda_broadcast_masks(mask_shape, mask_dtype, dtype):
    q, k, v = _qkv(2, 4, 2, 150, 333, 64, dtype, "cuda")
    gen = torch.Generator().manual_seed(11)
    if mask_dtype == "bool":
        mask = torch.rand(mask_shape, generator=gen) > 0.3
    else:
        mask = torch.randn(mask_shape, generator=gen)
        mask = mask.masked_fill(torch.rand(mask_shape, generator=gen) > 0.7, float("-inf"))
        mask = mask.to(torch.float32 if mask_dtype == "float32" else dtype)
    _check_forward(q, k, v, attn_mask=mask.to("cuda"), enable_gqa=True)


def _tile_mask(batch, q_len, kv_len, dtype):
    """A [B, 1, Q, KV] mask whose tiles (64 or 128 queries x 64 or 128 keys: the mma.sync and the
    sm_90a kernels' sizes) are, by design, fully masked, fully visible, or mixed, with fully masked
    rows; float masks use 0 (visible), -inf (masked) and random bias."""
    gen = torch.Generator().manual_seed(21)
    visible = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    visible[:, :, :, 128:384] = False  # whole key tiles (of 64 or 128 keys) masked for every query
    visible[0, :, 128:256, :] = False  # a whole query tile of batch 0 sees nothing
    visible[1, :, 5:9, :] = False  # fully masked rows inside a tile
    visible[:, :, 300:, 400:470] = torch.rand(batch, 1, q_len - 300, 70, generator=gen) > 0.5  # mixed
    if dtype == torch.bool:
        return visible
    bias = torch.zeros(batch, 1, q_len, kv_len)
    bias[:, :, :, 500:] = torch.randn(batch, 1, q_len, kv_len - 500, generator=gen)  # biased tiles
    return bias.masked_fill(~visible, float("-inf")).to(dtype)


@cuda_only
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_mask_tile_summary(mask_dtype, causal):
    q_len, kv_len = 400, 700
    mask = _tile_mask(2, q_len, kv_len, mask_dtype).to("cuda")
    q, k, v = _qkv(2, 4, 2, q_len, kv_len, 64, torch.bfloat16, "cuda")
    with torch.no_grad():
        # Keys 128..383 are masked for every query: their tiles are skipped, so NaN there never
        # leaks, not even through V (0 * NaN). (A NaN V behind a masked key of a mixed tile does:
        # P V multiplies it by 0.)
        k[:, :, 128:384] = float("nan")
        v[:, :, 128:384] = float("nan")
    kwargs = {"attn_mask": mask, "enable_gqa": True, "is_causal": causal, "q_offset": 300 if causal else 0}
    out, lse = safeattn.attention(q, k, v, **kwargs)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in fully masked tiles leaked"
    assert torch.all(out[0, :, 128:256] == 0) and torch.all(
        lse[0, :, 128:256].isneginf()
    ), "a fully masked query tile must give out 0, lse -inf"
    assert torch.all(out[1, :, 5:9] == 0) and torch.all(
        lse[1, :, 5:9].isneginf()
    ), "fully masked rows not 0/-inf"
    with torch.no_grad():
        k[:, :, 128:384] = 0.0
        v[:, :, 128:384] = 0.0
    _check_forward(q, k, v, **kwargs)


@cuda_only
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_cuda_nan_behind_masked_keys_never_leaks(mask_dtype):
    # NaN keys inside mixed tiles, masked for some rows (False or -inf) and by causality. The mask
    # is a view of 300 keys in rows of 304 (16-byte aligned: the tile summary reads 16 bytes at a
    # time, and the last tile's 44 keys end in a partial load; on sm_90a a bf16 mask comes as TMA
    # tiles, zero-filled past key 300, a float32 one is gathered from global memory).
    q, k, v = _qkv(1, 2, 2, 70, 300, 64, torch.bfloat16, "cuda")
    keys = torch.tensor([3, 100, 250])
    with torch.no_grad():
        k[:, :, keys] = float("nan")
    visible = torch.ones(70, 300, dtype=torch.bool)
    visible[:, keys] = False
    mask = visible if mask_dtype == torch.bool else torch.zeros(70, 300).masked_fill(~visible, float("-inf"))
    wide = torch.zeros(70, 304, dtype=mask_dtype, device="cuda")
    wide[:, :300] = mask.to("cuda", mask_dtype)
    out, lse = safeattn.attention(q, k, v, attn_mask=wide[:, :300])
    assert not out.isnan().any() and not lse.isnan().any(), "a NaN key behind a mask leaked"
    # Causal: key 100 (NaN) is visible from row 50 on (key j <= row i + 50).
    k2 = k.detach().clone()
    k2[:, :, keys] = 0.0
    k2[:, :, 100] = float("nan")
    out, _ = safeattn.attention(q, k2, v, is_causal=True, q_offset=50)
    assert out[0, :, :50].isfinite().all(), "a NaN key hidden by causality leaked into earlier rows"
    assert out[0, :, 50:].isnan().all(), "rows that see the NaN key must be NaN"


@cuda_only
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_cuda_nan_propagates(dtype):
    q, k, v = _qkv(1, 2, 2, 130, 700, 128, dtype, "cuda")
    q, k, v = q.detach().clone(), k.detach().clone(), v.detach().clone()
    q[0, 0, 3, 5] = float("nan")
    k[0, 1, 600, 0] = float("nan")
    out, lse = safeattn.attention(q, k, v)
    assert out[0, 0, 3].isnan().all() and lse[0, 0, 3].isnan(), "NaN query row must give NaN"
    assert not out[0, 0, [0, 1, 2, 4, 129]].isnan().any(), "NaN must stay in its own row"
    assert out[0, 1].isnan().all() and lse[0, 1].isnan().all(), "NaN key must reach every row that sees it"


@cuda_only
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_softcap_and_sinks(dtype, head_dim):
    q, k, v = _qkv(2, 4, 2, 130, 300, head_dim, dtype, "cuda")
    with torch.no_grad():
        q.mul_(4)  # large scores, so that the cap matters
    sinks = torch.randn(4, device="cuda")
    mask = torch.ones(2, 1, 130, 300, dtype=torch.bool)
    mask[1, 0, 120:] = False  # fully masked rows: out 0, lse = the sink logit
    mask = mask.to("cuda")
    _check_forward(q, k, v, softcap=5.0, enable_gqa=True, is_causal=True, q_offset=170)
    out, lse = _check_forward(q, k, v, attn_mask=mask, sinks=sinks, softcap=5.0, enable_gqa=True)
    assert torch.all(out[1, :, 120:] == 0), "fully masked rows with sinks must be 0"
    torch.testing.assert_close(
        lse[1, :, 120:], sinks[:, None].expand(4, 10), msg="lse of an empty row is the sink"
    )


@cuda_only
def test_cuda_layout_and_strides():
    # Transformers' [B, S, H, D] views are read in place; a non-unit last stride and a storage
    # offset that breaks 16-byte alignment are copied on the host; out is [B, Q, H, D] storage.
    q, k, v = _qkv(2, 4, 2, 77, 140, 64, torch.bfloat16, "cuda", transposed=True)
    want, want_lse = safeattn.attention(q.contiguous(), k.contiguous(), v.contiguous(), enable_gqa=True)
    out, lse = _check_forward(q, k, v, enable_gqa=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "strided views must not change the result"
    assert out.stride() == (77 * 4 * 64, 64, 4 * 64, 1), f"out strides {out.stride()}"
    assert lse.dtype == torch.float32 and lse.is_contiguous() and lse.shape == (2, 4, 77), "lse layout"
    big = torch.randn(2, 4, 77, 2 * 64, device="cuda", dtype=torch.bfloat16)
    q_strided = big[..., ::2]  # last stride 2
    q_offset_by_one = big.flatten()[1 : 1 + 2 * 4 * 77 * 64].view(2, 4, 77, 64)  # 2-byte aligned rows
    for qq in (q_strided, q_offset_by_one):
        got, _ = safeattn.attention(qq, k, v, enable_gqa=True)
        ref, _ = safeattn.attention(qq.contiguous().clone(), k, v, enable_gqa=True)
        assert torch.equal(got, ref), f"query with strides {qq.stride()} gives a different result"


@cuda_only
@pytest.mark.parametrize(
    ("dtype", "head_dim", "dv"),
    [(torch.float32, 40, 40), (torch.float32, 64, 64), (torch.bfloat16, 64, 32), (torch.float16, 48, 48)],
)
def test_cuda_generic_path(dtype, head_dim, dv):
    q, k, v = _qkv(2, 4, 2, 97, 150, head_dim, dtype, "cuda", dv=dv)
    mask = (torch.rand(2, 1, 97, 150) > 0.3).to("cuda")
    mask[0, 0, :4] = False
    sinks = torch.randn(4, device="cuda")
    _check_forward(q, k, v, enable_gqa=True, is_causal=True, q_offset=53)
    _check_forward(q, k, v, attn_mask=mask, enable_gqa=True, softcap=3.0)
    out, lse = _check_forward(q, k, v, attn_mask=mask, enable_gqa=True, sinks=sinks)
    assert torch.all(out[0, :, :4] == 0), "fully masked rows must be 0 on the generic path"


@cuda_only
def test_cuda_float64_forward():
    q, k, v, bias, sinks = _small_case("cuda")
    _check_forward(
        q, k, v, attn_mask=bias, enable_gqa=True, is_causal=True, q_offset=3, softcap=3.0, sinks=sinks
    )


@cuda_only
def test_cuda_more_than_2_pow_31_elements():
    # q, k, v, out and the bool mask each hold > 2^31 elements: every offset must be 64-bit.
    batch, q_len, head_dim = 2**31 // (128 * 128) + 1, 128, 128
    need = 4 * batch * q_len * head_dim * 2 + batch * q_len * q_len
    free, _ = torch.cuda.mem_get_info()
    if free < max(40 * 2**30, 1.3 * need):
        pytest.skip(f"needs 40 GB of free GPU memory, has {free / 2**30:.0f} GB")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make():
        return torch.randn(batch, 1, q_len, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = make(), make(), make()
    mask = torch.rand(batch, 1, q_len, q_len, device="cuda", generator=gen) > 0.2
    out, lse = safeattn.attention(q, k, v, attn_mask=mask)
    for b in (0, batch - 1):
        sl = slice(b, b + 1)
        want, want_lse = safeattn.attention(
            q[sl].clone(), k[sl].clone(), v[sl].clone(), attn_mask=mask[sl].clone()
        )
        assert torch.equal(out[sl], want) and torch.equal(lse[sl], want_lse), f"batch {b} differs past 2^31"
    del out, lse
    _check_forward(q[-1:], k[-1:], v[-1:], attn_mask=mask[-1:])


@pytest.mark.parametrize("direction", ["fwd", "bwd", "fwd_sm90", "bwd_sm90"])
def test_generated_instantiations_are_current(direction):
    """The attention_<dir>_d<D>_<dtype>.cu files are what scripts/gen_attention_instances.py writes."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gen_attention_instances.py"
    done = subprocess.run(
        [sys.executable, str(script), "--direction", direction, "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, f"stale generated files (rerun the script): {done.stderr}"


@pytest.mark.slow
def test_cpu_isa_variants_match_reference():
    """Every CPU variant this machine runs (ATEN_CPU_CAPABILITY, read once per process, so one
    subprocess each) matches the float64 reference, forward and backward. The variants take
    different tile GEMMs (the BLAS sgemm below AVX-512, oneDNN's brgemm with it), so an AVX-512
    machine would otherwise test only one of them. Sizes span several query and key tiles."""
    isas = safeattn.build_info()["cpu_isas_runnable"]
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "from test_attention import _qkv, _check_against_reference\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for d, causal in ((64, True), (128, False)):\n"
        "        q, k, v = _qkv(1, 4, 2, 130, 600, d, dtype, 'cpu')\n"
        "        mask = torch.rand(1, 1, 130, 600, generator=torch.Generator().manual_seed(d)) > 0.3\n"
        "        _check_against_reference(q, k, v, attn_mask=None if causal else mask, is_causal=causal,\n"
        "                                 enable_gqa=True, check_lse_grad=True)\n"
    )
    for isa in isas:
        env = dict(__import__("os").environ, ATEN_CPU_CAPABILITY=isa.lower())
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert done.returncode == 0, f"ISA variant {isa}: {done.stderr[-2000:]}"


# ---- edge cases: huge offsets, finfo.min rows, NaN behind -inf, bad private-op input --------


def _reference_grads(q, k, v, out_grad, *, extra=(), lse_grad=None, **kwargs):
    """Gradients of reference.attention w.r.t. q, k, v and `extra` inputs."""
    ref_out, ref_lse = reference.attention(q, k, v, **kwargs)
    outs, grads = [ref_out], [out_grad.to(ref_out.dtype)]
    if lse_grad is not None:
        outs.append(torch.where(ref_lse.isfinite(), ref_lse, 0.0))
        grads.append(lse_grad.to(ref_lse.dtype))
    return ref_out, torch.autograd.grad(outs, (q, k, v, *extra), grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("bias_shape", [(2, 2, 5, 1), (1, 2, 5, 1), (5, 1)])
def test_bias_gradient_over_one_key(device, head_dim, bias_shape):
    """A softmax over one key is constant: a learnable bias there gets gradient 0 (it got
    uninitialised memory on CPU when the bias had the full [B, H, Q, KV] shape and KV == 1)."""
    q, k, v = _qkv(2, 2, 2, 5, 1, head_dim, torch.float32, device)
    for trial in range(3):  # garbage differs from call to call
        bias = (
            torch.randn(bias_shape, generator=torch.Generator().manual_seed(trial))
            .to(device)
            .requires_grad_()
        )
        out, _ = safeattn.attention(q, k, v, bias)
        (grad_bias,) = torch.autograd.grad(out, bias, torch.randn_like(out))
        assert grad_bias.shape == bias.shape
        assert grad_bias.abs().max().item() < 1e-5, f"bias gradient over one key: {grad_bias.flatten()[:4]}"


_HUGE_ROWS = [
    # (input dtype, mask dtype, the value of the row)
    (torch.float32, torch.float32, torch.finfo(torch.float32).min),
    (torch.float32, torch.float32, -1e8),
    (torch.float64, torch.float64, -1e30),
    (torch.bfloat16, torch.bfloat16, torch.finfo(torch.bfloat16).min),
    (torch.bfloat16, torch.float32, torch.finfo(torch.float32).min),
    (torch.float16, torch.float32, torch.finfo(torch.float32).min),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "mask_dtype", "huge"), _HUGE_ROWS)
@pytest.mark.parametrize("head_dim", [8, 64])
def test_rows_of_huge_negative_bias(device, dtype, mask_dtype, huge, head_dim):
    """A row whose every bias is a huge negative constant (Transformers' eager masks: finfo.min)
    is a softmax of equal scores: uniform attention, and gradients consistent with it. The
    scores round to the constant in the compute dtype, so the yardstick is PyTorch computing
    the same formula in that dtype (float32, float64 for float64 inputs)."""
    if device == "cpu" and dtype in (torch.bfloat16, torch.float16) and head_dim == 8:
        pytest.skip("covered by head_dim 64 on CPU")
    q, k, v = _qkv(2, 2, 2, 4, 5, head_dim, dtype, device)
    mask = torch.zeros(4, 5, dtype=mask_dtype)
    mask[1] = huge
    mask[3, :2] = huge  # a row with a few huge entries: those keys get weight 0
    mask = mask.to(device)
    out, lse = safeattn.attention(q, k, v, mask)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    grad_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(4)).to(device)
    got = torch.autograd.grad([out, lse], (q, k, v), [grad_out, grad_lse])
    scores = torch.float64 if dtype == torch.float64 else torch.float32
    ref_out, want = _reference_grads(q, k, v, grad_out, attn_mask=mask, score_dtype=scores, lse_grad=grad_lse)
    compute = torch.float64
    uniform = v.detach().to(compute).mean(dim=2)  # row 1 attends uniformly
    tol = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert (out[:, :, 1].to(compute) - uniform).abs().max().item() < tol * 4, "the huge row is not uniform"
    assert (out.to(compute) - ref_out).abs().max().item() < tol * 4, "out differs from the reference"
    for name, g, w in zip(("grad_query", "grad_key", "grad_value"), got, want, strict=True):
        scale = max(1.0, w.abs().max().item())
        err = (g.to(compute) - w).abs().max().item()
        assert err < tol * 8 * scale, f"{name}: error {err:.3g} against the reference (magnitude {scale:.3g})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("empty_by", ["bool_mask", "causal_shift", "float_mask"])
def test_upstream_nan_on_empty_row_stays_out(device, dtype, empty_by):
    """A fully masked row passes no gradient on: NaN or inf in its upstream gradient (out and lse)
    changes nothing, and its grad_query row is 0."""
    head_dim = 64
    q, k, v = _qkv(1, 2, 2, 6, 7, head_dim, dtype, device)
    kwargs = {}
    if empty_by == "bool_mask":
        mask = torch.ones(6, 7, dtype=torch.bool)
        mask[2] = False
        kwargs["attn_mask"] = mask.to(device)
        empty = [2]
    elif empty_by == "float_mask":
        mask = torch.zeros(6, 7)
        mask[2] = float("-inf")
        kwargs["attn_mask"] = mask.to(device)
        empty = [2]
    else:
        kwargs.update(is_causal=True, q_offset=0, kv_offset=2)  # rows 0 and 1 see no key
        empty = [0, 1]
    out, lse = safeattn.attention(q, k, v, **kwargs)
    gen = torch.Generator().manual_seed(5)
    grad_out = torch.randn(out.shape, generator=gen).to(device, dtype)
    grad_lse = torch.randn(lse.shape, generator=gen).to(device)
    clean_out, clean_lse = grad_out.clone(), grad_lse.clone()
    for r in empty:
        clean_out[:, :, r] = 0
        clean_lse[:, :, r] = 0
        grad_out[:, :, r, ::2] = float("nan")
        grad_out[:, :, r, 1::2] = float("inf")
        grad_lse[:, :, r] = float("nan")
    got = torch.autograd.grad([out, lse], (q, k, v), [grad_out, grad_lse], retain_graph=True)
    want = torch.autograd.grad([out, lse], (q, k, v), [clean_out, clean_lse])
    for name, g, w in zip(("grad_query", "grad_key", "grad_value"), got, want, strict=True):
        assert torch.isfinite(g).all(), f"{name}: a NaN upstream gradient on an empty row leaked"
        assert torch.equal(g, w), f"{name}: differs from the gradient with that row's upstream zeroed"
    for r in empty:
        assert (got[0][:, :, r] == 0).all(), "an empty row's grad_query must be 0"


_OFFSET_CASES = [
    (2**63 - 1, 0),  # every key visible
    (0, 2**63 - 1),  # none
    (-(2**63), 2**63 - 1),  # none, and the difference overflows int64
    (2**63 - 1, -(2**63)),  # all, the difference overflows the other way
    (2**62 + 5, 2**62 + 1),  # shift 4
    (-(2**62) - 1, -(2**62) + 2),  # shift -3: the first rows see nothing
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("q_offset", "kv_offset"), _OFFSET_CASES)
def test_causal_offsets_near_int64_limits(device, q_offset, kv_offset):
    """The causal rule kv_offset + j <= q_offset + i holds exactly whatever the offsets (the
    reference takes their difference in Python integers)."""
    q, k, v = _qkv(1, 2, 2, 5, 6, 64, torch.float32, device)
    _check_against_reference(q, k, v, is_causal=True, q_offset=q_offset, kv_offset=kv_offset)


def _private_backward_args(device="cpu"):
    """Valid arguments of _attention_backward (positional), from a real forward."""
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 5, 7, 8, torch.float32, device))
    out, lse, lse_lo = torch.ops.safeattn._attention_forward(q, k, v, None, 0.0, False, None, True)
    grad_out = torch.randn_like(out)
    return dict(
        grad_out=grad_out,
        grad_lse=None,
        query=q,
        key=k,
        value=v,
        out=out,
        lse=lse,
        attn_mask=None,
        is_causal=False,
        scale=None,
        q_offset=0,
        kv_offset=0,
        softcap=0.0,
        sinks=None,
        grad_mask_needed=False,
        lse_lo=lse_lo,
    )


def _private_backward_bad():
    f = torch.randn
    return [
        (dict(key=f(1, 2, 7, 3)), "_attention_backward: key has head_dim 3 but query has 8"),
        (dict(value=f(1, 2, 2, 8)), "_attention_backward: value has kv_length 2 but key has 7"),
        (
            dict(key=f(1, 0, 7, 8), value=f(1, 0, 7, 8)),
            re.escape("query heads (4) must be a multiple of key/value heads (0)"),
        ),
        (
            dict(key=f(1, 3, 7, 8), value=f(1, 3, 7, 8)),
            re.escape("query heads (4) must be a multiple of key/value heads (3)"),
        ),
        (dict(query=f(4, 5, 8)), "_attention_backward: query must be 4-D"),
        (
            dict(lse=f(1, 4, 3)),
            re.escape("_attention_backward: lse must be [batch, heads, q_length] = [1, 4, 5], got [1, 4, 3]"),
        ),
        (dict(lse_lo=f(1, 4)), re.escape("_attention_backward: lse_lo must be [batch, heads, q_length]")),
        (
            dict(grad_lse=f(1, 4, 2)),
            re.escape("_attention_backward: grad_lse must be [batch, heads, q_length]"),
        ),
        (
            dict(lse=torch.zeros(1, 4, 5, dtype=torch.int64)),
            "_attention_backward: lse must have a floating dtype, got Long",
        ),
        (
            dict(out=f(1, 4, 5, 3)),
            re.escape("_attention_backward: out must be [batch, heads, q_length, head_dim_v] = [1, 4, 5, 8]"),
        ),
        (
            dict(grad_out=f(1, 4, 5, 3)),
            re.escape("_attention_backward: grad_out has shape [1, 4, 5, 3] but out has [1, 4, 5, 8]"),
        ),
        (
            dict(grad_out=f(1, 4, 5, 8).double()),
            "_attention_backward: grad_out has dtype Double but query has Float",
        ),
        (dict(out=f(1, 4, 5, 8).half()), "_attention_backward: out has dtype Half but query has Float"),
        (
            dict(attn_mask=f(3, 7) > 0),
            re.escape("_attention_backward: attn_mask of shape [3, 7] is not broadcastable"),
        ),
        (
            dict(attn_mask=f(5, 7) > 0, grad_mask_needed=True),
            "_attention_backward: grad_mask_needed needs a floating attn_mask",
        ),
        (dict(sinks=f(3)), re.escape("_attention_backward: sinks must be [num_heads] = [4], got [3]")),
        (dict(softcap=math.inf), "_attention_backward: softcap must be 0"),
    ]


@pytest.mark.parametrize(("overrides", "message"), _private_backward_bad())
@pytest.mark.parametrize("mode", ["eager", "meta", "fake"])
def test_private_backward_rejects_bad_arguments(overrides, message, mode):
    """_attention_backward is reachable from Python (and from a traced graph): every argument is
    checked, by the real op and its fake alike, so no call can crash or read out of bounds."""
    args = _private_backward_args()
    args.update(overrides)
    if mode == "meta":
        args = {n: (a.to("meta") if isinstance(a, torch.Tensor) else a) for n, a in args.items()}
    if mode == "fake":
        with torch._subclasses.FakeTensorMode() as fake_mode:
            args = {
                n: (fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a) for n, a in args.items()
            }
            with pytest.raises(RuntimeError, match=message):
                torch.ops.safeattn._attention_backward(**args)
        return
    with pytest.raises(RuntimeError, match=message):
        torch.ops.safeattn._attention_backward(**args)


def _fake_outputs_match_real(op, args):
    """The fake's outputs (shape, dtype, strides, device) against the CPU kernel's."""
    real = op(**args)
    with torch._subclasses.FakeTensorMode() as fake_mode:
        fake = op(
            **{n: (fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a) for n, a in args.items()}
        )
    for i, (f, r) in enumerate(zip(fake, real, strict=True)):
        got, want = (f.shape, f.dtype, f.stride(), f.device), (r.shape, r.dtype, r.stride(), r.device)
        assert got == want, f"{op}: output {i} of the fake is {got}, the kernel's {want}"


@pytest.mark.parametrize("mask", [None, "bool", "float", "float needing grad"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_private_ops_fakes_match_kernels(mask, with_sinks):
    """_attention_forward and _attention_backward: their Meta kernels allocate what the CPU
    kernels return, with and without the optional outputs (grad_mask, grad_sinks)."""
    args = _private_backward_args()
    if mask is not None:
        bias = torch.randn(4, 5, 7)
        args["attn_mask"] = bias > 0 if mask == "bool" else bias
        args["grad_mask_needed"] = mask == "float needing grad"
    if with_sinks:
        args["sinks"] = torch.randn(4)
    forward = {n: args[n] for n in ("query", "key", "value", "attn_mask", "sinks")}
    _fake_outputs_match_real(torch.ops.safeattn._attention_forward, dict(forward, enable_gqa=True))
    _fake_outputs_match_real(torch.ops.safeattn.attention, dict(forward, enable_gqa=True))
    _fake_outputs_match_real(torch.ops.safeattn._attention_backward, args)


def test_private_backward_valid_call_matches_autograd():
    """The valid call of the test above gives what autograd gives (so the battery starts from a
    call that works)."""
    args = _private_backward_args()
    grads = torch.ops.safeattn._attention_backward(**args)
    q, k, v = (args[n].clone().requires_grad_() for n in ("query", "key", "value"))
    out, _ = safeattn.attention(q, k, v, enable_gqa=True)
    want = torch.autograd.grad(out, (q, k, v), args["grad_out"])
    for g, w in zip(grads[:3], want, strict=True):
        torch.testing.assert_close(g, w)


def test_private_backward_reads_strided_rows():
    """lse, lse_lo and grad_lse may be views with any strides (a ring-attention caller slices them
    along the queries): the backward must read them through their strides, not as contiguous."""
    args = _private_backward_args()
    want = torch.ops.safeattn._attention_backward(**args)
    wide = {}
    for name in ("lse", "lse_lo"):
        t = args[name]
        big = torch.full((t.shape[0], t.shape[1], 2 * t.shape[2] + 3), float("nan"))
        big[:, :, 3 : 3 + 2 * t.shape[2] : 2] = t
        wide[name] = big[:, :, 3 : 3 + 2 * t.shape[2] : 2]
        assert not wide[name].is_contiguous()
    got = torch.ops.safeattn._attention_backward(**{**args, **wide})
    for g, w in zip(got[:3], want[:3], strict=True):
        assert torch.equal(g, w), "strided lse / lse_lo read as if contiguous"


# ---- CPU tiles in bf16 / fp16 ---------------------------------------------------------------
# On CPUs with bf16 matrix hardware (AVX512-BF16, AMX) the AVX-512 kernels multiply bf16 tiles in
# bf16 with float32 accumulation (fp16 with AMX-FP16); with oneDNN disabled
# (torch.backends.mkldnn.flags(enabled=False)) they stay in float32, the path of every other CPU.
# The tests below run both wherever they exist.

_CPU_TILES = ["hardware", "float32"]


def _use_cpu_tiles(monkeypatch, tiles):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", tiles != "float32")


def _cpu_lowp_tiles_expected(dtype):
    """Whether this machine's CPU kernels multiply `dtype` tiles in `dtype` (the rule of
    use_lowp_tiles in attention_common.h, seen from Python): the AVX-512 variant, the hardware
    (AVX512-BF16 or AMX-BF16 for bf16, AMX-FP16 for fp16), oneDNN enabled and not held lower."""
    cpu = torch._C._cpu
    if hasattr(cpu, "_get_cpu_capability"):  # torch >= 2.11
        flags = cpu._get_cpu_capability()
    else:  # torch 2.6 to 2.10: one function per flag (AMX tiles stand for AMX-BF16 there, as in C++)
        flags = {
            "amx_fp16": cpu._is_amx_fp16_supported(),
            "avx512_bf16": cpu._is_avx512_bf16_supported(),
            "amx_bf16": cpu._is_amx_tile_supported(),
        }
    if dtype == torch.float16:
        hardware = flags.get("amx_fp16", False)
    else:
        hardware = flags.get("avx512_bf16", False) or flags.get("amx_bf16", False)
    env = __import__("os").environ
    return (
        bool(hardware)
        and safeattn.build_info()["cpu_isa_in_use"] == "AVX512"
        and torch.backends.mkldnn.enabled
        and "ONEDNN_MAX_CPU_ISA" not in env
    )


# (hq, hkv, q_len, kv_len, head_dim, causal): odd lengths around the tiles (64 queries, 512 / 128
# keys, 32-key groups, 64-column blocks), GQA, an odd head dim (its pair padded), decode shapes.
_CPU_TILE_CASES = [
    (2, 2, 1, 1, 64, None),
    (4, 2, 17, 97, 64, "bottom_right"),
    (8, 1, 97, 17, 128, "top_left"),
    (2, 1, 1025, 97, 80, None),
    (2, 2, 1, 1025, 128, None),
    (4, 2, 130, 600, 33, "top_left"),
]


@pytest.mark.parametrize("tiles", _CPU_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "q_len", "kv_len", "head_dim", "causal"), _CPU_TILE_CASES)
def test_cpu_tiles_match_reference(monkeypatch, tiles, dtype, hq, hkv, q_len, kv_len, head_dim, causal):
    _use_cpu_tiles(monkeypatch, tiles)
    q, k, v = _qkv(1, hq, hkv, q_len, kv_len, head_dim, dtype, "cpu", seed=q_len + kv_len)
    kwargs = {"enable_gqa": hq != hkv}
    if causal is not None:
        kwargs["is_causal"] = True
        kwargs["q_offset"] = kv_len - q_len if causal == "bottom_right" else 0
    _check_against_reference(q, k, v, check_lse_grad=True, **kwargs)


@pytest.mark.parametrize("tiles", _CPU_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_tiles_masks_softcap_sinks(monkeypatch, tiles, dtype):
    """A bool mask with fully masked rows (out 0, lse -inf, grad_query 0), then a learnable float
    bias with a masked column, a softcap and sinks, over several query and key tiles."""
    _use_cpu_tiles(monkeypatch, tiles)
    batch, q_len, kv_len = 2, 97, 600
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, 64, dtype, "cpu", transposed=True)
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(batch, 1, q_len, kv_len, generator=gen) > 0.5
    mask[0, 0, [0, 64, 96]] = False
    out, lse = safeattn.attention(q, k, v, attn_mask=mask, enable_gqa=True)
    (grad_q,) = torch.autograd.grad(out.float().sum(), q)
    for i in (0, 64, 96):
        assert torch.all(out[0, :, i] == 0), f"fully masked row {i}: out must be 0"
        assert torch.all(lse[0, :, i].isneginf()), f"fully masked row {i}: lse must be -inf"
        assert torch.all(grad_q[0, :, i] == 0), f"fully masked row {i}: grad_query must be 0"
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True, check_lse_grad=True)

    bias = (torch.randn(1, 4, q_len, kv_len, generator=gen) * 2).to(dtype)
    bias[..., 5] = float("-inf")
    bias.requires_grad_()
    sinks = torch.randn(4, generator=gen).requires_grad_()
    _check_against_reference(
        q,
        k,
        v,
        attn_mask=bias,
        softcap=5.0,
        sinks=sinks,
        enable_gqa=True,
        check_lse_grad=True,
        extra_grad_inputs=(bias, sinks),
    )


@pytest.mark.parametrize("tiles", _CPU_TILES)
def test_cpu_tiles_never_read_hidden_keys(monkeypatch, tiles):
    """NaN in the keys and values that no query sees (past the causal diagonal, inside the key
    group and column block of the last visible key) and NaN around every view never reach the
    forward: the bf16 tiles round their reductions up to whole groups, but only over zeros."""
    _use_cpu_tiles(monkeypatch, tiles)
    q, k, v = (t.detach() for t in _qkv(1, 2, 1, 40, 100, 64, torch.bfloat16, "cpu"))
    k[0, 0, 40:64] = float("nan")  # query 39 (the last) sees keys 0 .. 39
    v[0, 0, 40:64] = float("nan")
    out, lse = safeattn.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not out.isnan().any() and not lse.isnan().any(), "a hidden NaN key or value leaked"
    want, _ = reference.attention(q, k[:, :, :40], v[:, :, :40], is_causal=True, enable_gqa=True)
    assert _max_err(out, want) < 3e-2, "the visible keys give the wrong answer"

    def poisoned(h, s, dim):
        big = torch.full((1, s + 3, h + 1, dim + 24), float("nan"), dtype=torch.bfloat16)
        view = big[:, 1 : s + 1, :h, 8 : 8 + dim].transpose(1, 2)
        view.copy_(torch.randn(1, h, s, dim))
        return view.detach().requires_grad_()

    q, k, v = poisoned(4, 33, 66), poisoned(2, 70, 66), poisoned(2, 70, 66)
    out, lse = safeattn.attention(q, k, v, is_causal=True, q_offset=37, enable_gqa=True)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN padding leaked into the forward"
    grads = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
    assert not any(g.isnan().any() for g in grads), "NaN padding leaked into a gradient"
    _check_against_reference(q, k, v, is_causal=True, q_offset=37, enable_gqa=True)


def _structured_bool_mask(kind, b, h, q_len, kv_len):
    """A [b, h|1, q|1, kv|1] bool mask of a kind whose rows see a span of the keys."""
    i = torch.arange(q_len)[:, None] + (kv_len - q_len)  # bottom-right positions
    j = torch.arange(kv_len)[None, :]
    if kind == "sliding":
        return ((j <= i) & (j > i - 150)).expand(b, 1, q_len, kv_len)
    if kind == "packed":  # documents of 300 keys; a query sees its own document's past
        return ((j <= i) & (j // 300 == i // 300)).expand(b, 1, q_len, kv_len)
    if kind == "left_padding":  # per batch row, keys before `pad` are padding
        pad = torch.tensor([0, 700])[:b, None, None]
        return ((j <= i) & (j >= pad))[:, None]
    if kind == "per_head":  # a different window per head, and one head with no key at all
        heads = [(j > i - 100 * (t + 1)) & (j <= i) & (t != 1) for t in range(h)]
        return torch.stack(heads)[None].expand(b, h, q_len, kv_len)
    if kind == "last_key_only":
        return (j == kv_len - 1).expand(b, 1, q_len, kv_len)
    if kind == "key_padding":  # [b, 1, 1, kv]: stride 0 along the queries
        return (j >= 1000)[None, None].expand(b, 1, 1, kv_len)
    if kind == "row_mask":  # [b, 1, q, 1]: stride 0 along the keys, every other row sees nothing
        return (torch.arange(q_len) % 2 == 0)[None, None, :, None].expand(b, 1, q_len, 1)
    if kind == "transposed":  # a non-contiguous view: the keys stride is not 1
        return ((j <= i) & (j > i - 400)).t().contiguous().t().expand(b, 1, q_len, kv_len)
    raise ValueError(kind)


_SPAN_KINDS = [
    "sliding",
    "packed",
    "left_padding",
    "per_head",
    "last_key_only",
    "key_padding",
    "row_mask",
    "transposed",
]


@pytest.mark.parametrize("kind", _SPAN_KINDS)
@pytest.mark.parametrize("form", ["bool", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_masks_skip_what_they_hide(kind, form, dtype):
    """The span of keys a mask leaves each query tile (False, or -inf in a float mask) bounds the
    CPU kernels' key loops (forward: per 64 queries; backward: per pair of 64 queries and 128
    keys): outside it every score is hidden, so skipping must leave the result as the float64
    reference has it, forward and backward, with spans that start and end mid-tile, rows with no
    key, broadcast and strided masks."""
    q, k, v = _qkv(2, 4, 2, 200, 1100, 64, dtype, "cpu")
    keep = _structured_bool_mask(kind, 2, 4, 200, 1100)
    mask = keep if form == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True)
    if form == "bool":  # the two forms of one mask agree
        out, _ = safeattn.attention(q, k, v, attn_mask=mask, enable_gqa=True)
        bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        out_bias, _ = safeattn.attention(q, k, v, attn_mask=bias, enable_gqa=True)
        torch.testing.assert_close(
            out, out_bias, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2})
        )


def test_cpu_mask_spans_see_nan_biases():
    """A NaN bias is not hidden by the spans: its row is NaN, and no other row."""
    q, k, v = _qkv(1, 2, 2, 130, 1100, 64, torch.float32, "cpu")
    bias = torch.full((1, 1, 130, 1100), float("-inf"))
    bias[..., :10] = 0.0
    bias[0, 0, 70, 1099] = float("nan")  # far past the other rows' span, in its own key tile
    out, _ = safeattn.attention(q, k, v, attn_mask=bias)
    assert out[0, :, 70].isnan().all(), "the NaN bias reached its row"
    assert not out[0, :, :70].isnan().any() and not out[0, :, 71:].isnan().any(), "and no other row"


def test_cpu_mask_spans_keep_bias_gradients():
    """A bias that requires grad gets its gradient on every element, the -inf ones included (0
    there), though its -inf entries leave spans."""
    q, k, v = _qkv(1, 2, 2, 130, 1100, 64, torch.float32, "cpu")
    keep = _structured_bool_mask("sliding", 1, 2, 130, 1100)
    learned = torch.randn(1, 1, 130, 1100).masked_fill(~keep, float("-inf")).requires_grad_()
    _check_against_reference(q, k, v, attn_mask=learned, extra_grad_inputs=(learned,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_low_precision_tiles_are_taken(monkeypatch, dtype):
    """Where the hardware is, the bf16 / fp16 tiles are the ones that run: switching them off
    changes the rounding (P rounded to the input dtype, the scale applied to float32 scores), so
    the two paths give different bits, each within the tolerance of the reference. What
    build_info()["cpu_tiles"] reports is what runs, and on the torch of the main environment the
    tiles are taken wherever the hardware rule says; an older torch's brgemm may fail the probe
    (torch 2.6 did on a CI machine), and then both settings run the same float32 tiles."""
    name = str(dtype).removeprefix("torch.")
    expected = _cpu_lowp_tiles_expected(dtype)
    reported = safeattn.build_info()["cpu_tiles"][name]
    assert reported == name or reported.startswith("float32 ("), reported
    if not expected:
        assert reported != name, f"{name} tiles reported where the hardware rule says there are none"
        pytest.skip(f"this CPU or build multiplies {dtype} tiles in float32 (no matrix hardware for it)")
    probe_failed = "brgemm" in reported
    if probe_failed and "amx" in reported:
        # torch's brgemm takes bf16 tiles in VNNI layout only where it can use AMX (seen with torch
        # 2.11 in a GPU host's VM, whose CPU flags name AVX512-BF16): the probe refuses and the
        # float32 tiles run, as designed; the flags alone cannot tell.
        pytest.skip(f"torch's brgemm needs AMX for {dtype} here: {reported}")
    if probe_failed and torch.__version__ >= (2, 11):  # TorchVersion compares with a tuple
        pytest.fail(f"the hardware is there but the tiles are not taken: {reported}")
    assert reported == name or probe_failed, reported
    q, k, v = _qkv(1, 2, 2, 70, 300, 64, dtype, "cpu")
    runs = []
    for tiles in ("hardware", "float32"):
        _use_cpu_tiles(monkeypatch, tiles)
        want = (
            reported
            if tiles == "hardware" or probe_failed
            else "float32 (torch.backends.mkldnn.enabled is False)"
        )
        assert safeattn.build_info()["cpu_tiles"][name] == want
        _check_against_reference(q, k, v, is_causal=True)
        out, _ = safeattn.attention(q, k, v, is_causal=True)
        runs.append((out, torch.autograd.grad(out.float().sum(), (q, k, v))))
    (out_lowp, grads_lowp), (out_float, grads_float) = runs
    same_out = torch.equal(out_lowp, out_float)
    same_grads = all(torch.equal(a, b) for a, b in zip(grads_lowp, grads_float, strict=True))
    if probe_failed:
        assert same_out and same_grads, f"reported {reported!r}, yet the tile path changed the bits"
        return
    assert not same_out, "the output does not depend on the tile path: not taken"
    assert not same_grads, "the gradients do not depend on the tile path: not taken in the backward"


@pytest.mark.parametrize("tiles", _CPU_TILES)
def test_cpu_tiles_deterministic_across_threads(monkeypatch, tiles):
    """bf16 tiles keep the backward's one-writer-per-element scheme: the same bits for any thread
    count (the bias gradient included)."""
    _use_cpu_tiles(monkeypatch, tiles)
    q, k, v = _qkv(2, 8, 2, 50, 300, 64, torch.bfloat16, "cpu")
    bias = torch.randn(1, 1, 50, 300).requires_grad_()
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            out, lse = safeattn.attention(q, k, v, bias, enable_gqa=True, is_causal=True)
            results.append((out, *torch.autograd.grad(out.float().sum(), (q, k, v, bias))))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b), "results differ between runs / thread counts"


def test_direct_entry_is_the_op():
    """Eager calls reach the op through safeattn._C._attention (its typed C++ entry, less host
    time than torch.ops): the same results bit for bit, the same gradients and the same errors as
    torch.ops.safeattn.attention, for every argument it takes."""
    from safeattn import _C

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    mask = torch.randn(2, 1, 6, 6, generator=gen)
    sinks = torch.randn(4, generator=gen)
    ranges = torch.tensor([[1, 6]], dtype=torch.int32).expand(2, 6, 2).contiguous()
    cases = [
        (None, 0, False, None, True, 0, 0, 0, None, None),
        (mask, 0.0, True, 0.5, True, 2, 1, 30.0, sinks, None),
        (mask > 0, 0, True, None, True, 0, 0, 0, None, ranges),
    ]
    for mask_arg, dropout, causal, scale, gqa, q_at, kv_at, cap, sink, rng in cases:
        direct = _C._attention(q, k, v, mask_arg, dropout, causal, scale, gqa, q_at, kv_at, cap, sink, rng)
        boxed = torch.ops.safeattn.attention(
            q,
            k,
            v,
            mask_arg,
            dropout,
            causal,
            scale,
            gqa,
            q_offset=q_at,
            kv_offset=kv_at,
            softcap=cap,
            sinks=sink,
            key_ranges=rng,
        )
        assert all(torch.equal(a, b) for a, b in zip(direct, boxed, strict=False))
        ref_out, ref_lse = reference.attention(
            q.double(),
            k.double(),
            v.double(),
            attn_mask=None
            if mask_arg is None
            else mask_arg.double()
            if mask_arg.is_floating_point()
            else mask_arg,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
            q_offset=q_at,
            kv_offset=kv_at,
            softcap=cap,
            sinks=None if sink is None else sink.double(),
            key_ranges=rng,
        )
        torch.testing.assert_close(direct[0].double(), ref_out, atol=1e-5, rtol=1e-5)
    leaf = q.clone().requires_grad_()
    (grad,) = torch.autograd.grad(
        _C._attention(leaf, k, v, None, 0, True, None, True, 0, 0, 0, None, None)[0].sum(), leaf
    )
    (ref,) = torch.autograd.grad(
        torch.ops.safeattn.attention(leaf, k, v, None, 0, True, None, True)[0].sum(), leaf
    )
    assert torch.equal(grad, ref)
    with pytest.raises(RuntimeError) as direct_error:
        _C._attention(q, k[..., :4], v, None, 0, False, None, True, 0, 0, 0, None, None)
    with pytest.raises(RuntimeError) as boxed_error:
        torch.ops.safeattn.attention(q, k[..., :4], v, None, 0, False, None, True)
    assert str(direct_error.value) == str(boxed_error.value)


class _SeesOps(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _NamedTensor(torch.Tensor):
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_direct_entry_declines_what_is_not_plain():
    """safeattn._C._attention declines (NotImplemented) a __torch_function__ mode, a tensor
    subclass, a tensor or symbolic offset and any argument of another type, so that
    safeattn.attention takes torch.ops there: modes and subclasses see the op's call as before,
    and bad arguments get torch.ops' messages."""
    from safeattn import _C

    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    plain = (q, k, v, None, 0, False, None, False, 0, 0, 0, None, None)
    assert _C._attention(*plain) is not NotImplemented
    declined = {
        "mode": None,
        "subclass": (q.as_subclass(_NamedTensor),) + plain[1:],
        "tensor offset": plain[:8] + (torch.tensor(1),) + plain[9:],
        "int is_causal": plain[:5] + (1,) + plain[6:],
        "huge offset": plain[:8] + (2**70,) + plain[9:],
        "list mask": plain[:3] + ([1.0],) + plain[4:],
    }
    for name, args in declined.items():
        if args is None:
            with _SeesOps():
                assert _C._attention(*plain) is NotImplemented, name
        else:
            assert _C._attention(*args) is NotImplemented, name
    with _SeesOps() as mode:
        out, _ = safeattn.attention(q, k, v)
    assert torch.ops.safeattn.attention.default in mode.seen or torch.ops.safeattn.attention in mode.seen
    torch.testing.assert_close(out, safeattn.attention(q, k, v)[0])
    _NamedTensor.seen.clear()
    safeattn.attention(q.as_subclass(_NamedTensor), k, v)
    assert _NamedTensor.seen, "the subclass's __torch_function__ saw the op"
    with pytest.raises(TypeError):
        _C._attention(q, k, v)
    with pytest.raises((TypeError, RuntimeError), match="query"):
        safeattn.attention("not a tensor", k, v)


def test_op_keywords_pass_only_what_differs_from_the_defaults():
    """safeattn.attention gives the op no keyword at its schema default (each one passed costs
    host time); a value that differs, a tensor and a symbolic offset are passed as they are."""
    from safeattn.ops import _op_keywords

    schema = torch.ops.safeattn.attention.default._schema
    defaults = {a.name: a.default_value for a in schema.arguments if a.kwarg_only}
    assert set(defaults) == {"q_offset", "kv_offset", "softcap", "sinks", "key_ranges"}, defaults
    assert _op_keywords(**defaults) == {} and _op_keywords() == {}
    sinks, ranges, position = torch.zeros(2), torch.zeros(1, 1, 2, dtype=torch.int32), torch.tensor(0)
    given = {"q_offset": 3, "kv_offset": 1, "softcap": 30.0, "sinks": sinks, "key_ranges": ranges}
    assert _op_keywords(**given) == given
    assert _op_keywords(q_offset=position)["q_offset"] is position  # never compared: no host sync
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    out, lse = safeattn.attention(q, k, v, is_causal=True, q_offset=1)
    ref_out, ref_lse = reference.attention(q.double(), k.double(), v.double(), is_causal=True, q_offset=1)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
