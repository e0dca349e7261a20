"""Fuzzing every op against the float64 references of reference.py: random shapes, strides,
dtypes, masks with fully masked rows, biases with finfo.min rows, offsets near the int64 limits,
and NaN / inf placed in inputs and in upstream gradients.

SAFEATTN_FUZZ_CASES sets the number of random cases per op and device (default 24, what CI
runs; e.g. SAFEATTN_FUZZ_CASES=2000 on demand), SAFEATTN_FUZZ_SEED the first seed (default 0).
Each case is its own seed, so a failure names the seed that reproduces it.

The semantics checked (README, "Contract"): a fully masked row is 0 with lse -inf and passes no
gradient on, whatever its upstream gradient holds; a masked element (False, or a -inf bias) hides
its score, NaN included; a NaN in a query row makes that row NaN and no other.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import safeattn
import torch
from conftest import DEVICES
from safeattn import reference

CASES = int(os.environ.get("SAFEATTN_FUZZ_CASES", "24"))
SEED = int(os.environ.get("SAFEATTN_FUZZ_SEED", "0"))
SEEDS = range(SEED, SEED + CASES)

# Absolute tolerance per input dtype, scaled by the magnitude of the reference value; gradients
# get 4x. float32 scores make every dtype's floor at least float32's.
TOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 6e-3, torch.bfloat16: 4e-2}


def _close(name, got, want, tol, seed):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"seed {seed} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    same = (got == want) | (got.isnan() & want.isnan())
    scale = max(1.0, want[want.isfinite()].abs().max().item()) if want.isfinite().any() else 1.0
    err = (got - want).abs().masked_fill(same, 0.0)
    worst = err.max().item() if err.numel() else 0.0
    assert (
        not math.isnan(worst) and worst <= tol * scale
    ), f"seed {seed} {name}: error {worst:.3g} > {tol:g} x {scale:.3g}"


def _on(device, kwargs: dict) -> dict:
    """kwargs with its tensors moved to device."""
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}


def _strided(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """t itself, or the same values in a non-contiguous layout (a transposed copy viewed back,
    or a slice of a wider buffer)."""
    kind = rng.choice(["plain", "plain", "transposed", "sliced"])
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced":
        wide = torch.empty((*t.shape[:-1], 2 * t.shape[-1] + 1), dtype=t.dtype, device=t.device)
        wide.fill_(float("nan") if t.is_floating_point() else 0)
        view = wide[..., 1::2]
        view.copy_(t)
        return view
    return t


# ---- attention -------------------------------------------------------------------------------


def _attention_case(seed: int, device: str):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float64])
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 4])
    batch = rng.choice([1, 2])
    q_len, kv_len = rng.choice([1, 3, 17, 64, 97]), rng.choice([1, 5, 17, 64, 130])
    head_dim = rng.choice([8, 40, 64, 64, 128])
    head_dim_v = head_dim if rng.random() < 0.8 else rng.choice([8, 32])

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = (
        rand(batch, hq, q_len, head_dim),
        rand(batch, hkv, kv_len, head_dim),
        rand(batch, hkv, kv_len, head_dim_v),
    )
    kwargs = {"enable_gqa": hq != hkv}
    mask_kind = rng.choice(["none", "bool", "float", "finfo", "bias"])
    if mask_kind != "none":
        shape = rng.choice(
            [(q_len, kv_len), (batch, 1, q_len, kv_len), (1, hq, q_len, kv_len), (batch, hq, 1, kv_len)]
        )
        allowed = torch.rand(shape, generator=gen) > rng.choice([0.1, 0.5, 0.9])
        if len(shape) >= 2 and shape[-2] > 1 and rng.random() < 0.7:
            allowed[..., rng.randrange(shape[-2]), :] = False  # a fully masked row
        if mask_kind == "bool":
            mask = allowed
        else:
            mask_dtype = rng.choice([torch.float32, dtype])
            blocked = torch.finfo(mask_dtype).min if mask_kind == "finfo" else float("-inf")
            mask = torch.zeros(shape, dtype=mask_dtype).masked_fill(~allowed, blocked)
            if mask_kind == "bias":
                mask = mask + torch.randn(shape, generator=gen)
            mask = mask.to(mask_dtype)
        kwargs["attn_mask"] = mask.to(device)
    if rng.random() < 0.4:
        kwargs["is_causal"] = True
        offsets = [(0, 0), (kv_len - q_len, 0), (0, 3), (2**63 - 1, 0), (-(2**63), 2**62), (5, 2**62)]
        kwargs["q_offset"], kwargs["kv_offset"] = rng.choice(offsets)
    if rng.random() < 0.2:
        kwargs["softcap"] = rng.choice([5.0, 30.0])
    if rng.random() < 0.2:
        kwargs["scale"] = rng.choice([0.0, 0.05, 2.0])
    if rng.random() < 0.15:
        kwargs["sinks"] = torch.randn(hq, generator=gen).to(device)
    q, k, v = (_strided(t, rng).requires_grad_() for t in (q, k, v))
    return rng, gen, dtype, q, k, v, kwargs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_attention_fuzz(device, seed):
    rng, gen, dtype, q, k, v, kwargs = _attention_case(seed, device)
    out, lse = safeattn.attention(q, k, v, **kwargs)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ref_out, ref_lse = reference.attention(q, k, v, score_dtype=acc, **kwargs)
    tol = TOL[dtype]
    _close("out", out, ref_out, tol, seed)
    _close("lse", lse, ref_lse, max(tol, 1e-5), seed)
    assert torch.equal(lse.isneginf().cpu(), ref_lse.isneginf().cpu()), f"seed {seed}: -inf lse rows differ"
    empty = ref_lse.isneginf()
    assert (out[empty.to(out.device)] == 0).all(), f"seed {seed}: a fully masked row is not 0"

    # Upstream gradients, with NaN and inf on the fully masked rows: they must change nothing.
    grad_out = torch.randn(out.shape, generator=gen).to(out.device, dtype)
    grad_lse = torch.randn(lse.shape, generator=gen).to(lse.device)
    poisoned_out, poisoned_lse = grad_out.clone(), grad_lse.clone()
    poisoned_out[empty.to(out.device)] = float("nan")
    poisoned_lse[empty.to(lse.device)] = float("inf")
    grad_out = grad_out.masked_fill(empty.to(out.device).unsqueeze(-1), 0.0)
    grad_lse = grad_lse.masked_fill(empty.to(lse.device), 0.0)
    inputs = (q, k, v)
    got = torch.autograd.grad([out, lse], inputs, [poisoned_out, poisoned_lse])
    finite_lse = torch.where(ref_lse.isfinite(), ref_lse, 0.0)
    want = torch.autograd.grad([ref_out, finite_lse], inputs, [grad_out.to(ref_out.dtype), grad_lse.to(acc)])
    for name, g, w in zip(("grad_query", "grad_key", "grad_value"), got, want, strict=True):
        assert torch.isfinite(
            g
        ).all(), f"seed {seed} {name}: NaN or inf (upstream NaN on an empty row leaked?)"
        _close(name, g, w, 4 * tol, seed)


def _description(rng, gen, batch, q_len, kv_len, q_offset, kv_offset):
    """Random sdpa_mask rules over key positions up to kv_offset + kv_len (packed and block ids
    only where the positions are small enough to hold them as [B, L] tensors)."""
    rules = {"causal": rng.random() < 0.7}
    if rng.random() < 0.3:
        rules["sliding_window"] = rng.choice([1, 3, 17, 2**63 - 1])
    if rng.random() < 0.2:
        rules["chunk_size"] = rng.choice([1, 4, 16])
        if rng.random() < 0.5:
            rules["chunk_left_padding"] = torch.randint(-2, 6, (batch,), generator=gen)
    width = max(kv_offset + kv_len, q_offset + q_len)
    small = width < 10_000
    if rng.random() < 0.6:
        kind = rng.choice(["random", "left", "right", "short"])
        size = rng.choice([1, 10, kv_len]) if kind == "short" or not small else width
        if kind == "random":
            rules["padding_mask"] = torch.rand(batch, size, generator=gen) > 0.3
        else:
            cut = torch.randint(0, size + 1, (batch, 1), generator=gen)
            positions = torch.arange(size)[None]
            keep = positions >= cut if kind == "left" else positions < cut
            rules["padding_mask"] = keep.to(rng.choice([torch.bool, torch.long]))
    if small and rng.random() < 0.3:
        rules["packed_ids"] = torch.sort(torch.randint(0, 3, (batch, width), generator=gen), dim=-1).values
    if small and rng.random() < 0.15:
        rules["block_ids"] = torch.randint(-1, 3, (batch, width + 2), generator=gen)
    return rules


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_attention_described_fuzz(device, seed):
    # attention(MaskDescription) against the float64 reference with the reference's mask for the
    # same rules at the same positions: values, -inf rows, zeros and gradients.
    rng, gen, dtype, q, k, v, kwargs = _attention_case(seed, device)
    for name in ("attn_mask", "is_causal", "q_offset", "kv_offset"):
        kwargs.pop(name, None)
    batch, q_len, kv_len = q.shape[0], q.shape[2], k.shape[2]
    q_offset, kv_offset = rng.choice([(0, 0), (max(kv_len - q_len, 0), 0), (7, 3), (2**62, 2**62 - 5)])
    rules = _description(rng, gen, batch, q_len, kv_len, q_offset, kv_offset)
    dense = reference.sdpa_mask(batch, q_len, kv_len, q_offset, kv_offset, **rules)
    out, lse = safeattn.attention(
        q,
        k,
        v,
        safeattn.MaskDescription(**_on(device, rules)),
        q_offset=q_offset,
        kv_offset=kv_offset,
        **kwargs,
    )
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ref_out, ref_lse = reference.attention(q, k, v, dense.to(device), score_dtype=acc, **kwargs)
    tol = TOL[dtype]
    _close("out", out, ref_out, tol, seed)
    _close("lse", lse, ref_lse, max(tol, 1e-5), seed)
    assert torch.equal(lse.isneginf().cpu(), ref_lse.isneginf().cpu()), f"seed {seed}: -inf lse rows differ"
    grad_out = torch.randn(out.shape, generator=gen).to(out.device, dtype)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(ref_out, (q, k, v), grad_out.to(ref_out.dtype))
    for name, g, w in zip(("grad_query", "grad_key", "grad_value"), got, want, strict=True):
        _close(name, g, w, 4 * tol, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_attention_nan_in_a_query_row_stays_there(device, seed):
    """A NaN in one query row makes that row's output NaN (never hidden) and no other row."""
    rng, gen, dtype, q, k, v, kwargs = _attention_case(seed, device)
    q = q.detach().clone()
    row = rng.randrange(q.shape[2])
    head = rng.randrange(q.shape[1])
    q[0, head, row, 0] = float("nan")
    out, _ = safeattn.attention(q, k.detach(), v.detach(), **kwargs)
    # Whether the row sees a key (with sinks, lse is finite either way: ask without them).
    no_sinks = {n: a for n, a in kwargs.items() if n != "sinks"}
    _, ref_lse = reference.attention(q, k.detach(), v.detach(), **no_sinks)
    if not bool(ref_lse[0, head, row].isneginf()):
        assert out[0, head, row].isnan().all(), f"seed {seed}: a NaN query row was hidden"
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[0, head, row] = False
    assert not out[others.to(out.device)].isnan().any(), f"seed {seed}: a NaN reached another row"


# ---- the softmax family ----------------------------------------------------------------------


def _softmax_case(seed: int, device: str):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.float64])
    ndim = rng.choice([1, 2, 3, 4])
    shape = [rng.choice([1, 2, 7, 33, 130]) for _ in range(ndim)]
    dim = rng.randrange(-ndim, ndim)
    x = (torch.randn(shape, generator=gen) * rng.choice([1.0, 10.0])).to(dtype)
    # A fully -inf row (empty) and, sometimes, a finfo.min row along `dim`.
    index = [rng.randrange(s) for s in shape]
    index[dim] = slice(None)
    x[tuple(index)] = float("-inf")
    huge_row = rng.random() < 0.3
    if huge_row:
        index2 = [rng.randrange(s) for s in shape]
        index2[dim] = slice(None)
        x[tuple(index2)] = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).min
    return rng, gen, dtype, _strided(x.to(device=device), rng), dim, huge_row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_safe_softmax_fuzz(device, seed):
    rng, gen, dtype, x, dim, _ = _softmax_case(seed, device)
    x.requires_grad_()
    out = safeattn.safe_softmax(x, dim)
    want = reference.safe_softmax(x.detach(), dim)
    tol = TOL[dtype] / 4
    _close("out", out, want, tol, seed)
    grad = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    grad[(want == 0).all(dim, keepdim=True).expand_as(want).to(grad.device)] = float("nan")  # empty rows
    (got,) = torch.autograd.grad(out, x, grad)
    ref_grad = reference.safe_softmax_backward(torch.nan_to_num(grad, nan=0.0), want, dim)
    assert torch.isfinite(got).all(), f"seed {seed}: NaN upstream on an empty row leaked"
    _close("grad", got, ref_grad, 4 * tol, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_masked_softmax_fuzz(device, seed):
    rng, gen, dtype, x, dim, huge_row = _softmax_case(seed, device)
    x = torch.nan_to_num(x.detach(), neginf=0.0).requires_grad_()  # the mask does the masking here
    ndim = x.dim()
    mask_dims = rng.randrange(1, ndim + 1)
    mask_shape = [s if rng.random() < 0.7 else 1 for s in x.shape[ndim - mask_dims :]]
    allowed = torch.rand(mask_shape, generator=gen) > 0.4
    if rng.random() < 0.5:
        mask = allowed
    else:
        # finfo.min on a finfo.min score is -inf in float32 (the kernels' arithmetic) but finite
        # in the float64 reference: a huge row meets -inf only.
        blocked = rng.choice([float("-inf")] if huge_row else [float("-inf"), torch.finfo(torch.float32).min])
        mask = torch.zeros(mask_shape).masked_fill(~allowed, blocked)
        if rng.random() < 0.5:
            mask = (mask + torch.randn(mask_shape, generator=gen)).requires_grad_()
    mask = mask.to(device) if not mask.requires_grad else mask.detach().to(device).requires_grad_()
    # Scores are scaled in float32: finfo.min * 3 is -inf there (an empty row) but finite in the
    # float64 reference, so a huge row is only scaled down.
    scale = rng.choice([1.0, 0.125] if huge_row else [1.0, 0.125, 3.0])
    out = safeattn.masked_softmax(x, mask, scale, dim)
    want = reference.masked_softmax(x.detach(), mask.detach(), scale, dim)
    tol = TOL[dtype] / 4
    _close("out", out, want, tol, seed)
    grad = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    inputs = (x, mask) if mask.requires_grad else (x,)
    got = torch.autograd.grad(out, inputs, grad)
    xr = x.detach().double().requires_grad_()
    mr = mask.detach().double().requires_grad_() if mask.requires_grad else mask.detach()
    ref = reference.masked_softmax(xr, mr, scale, dim)
    ref_inputs = (xr, mr) if mask.requires_grad else (xr,)
    want_grads = torch.autograd.grad(ref, ref_inputs, grad.double(), allow_unused=True)
    # The mask gradient is in the mask's dtype (float32 here) and sums the broadcast dims.
    summed = x.numel() // max(1, mask.numel())
    mask_tol = 4 * max(tol, TOL[torch.float32] / 4) * math.sqrt(summed)
    for name, g, w, t in zip(
        ("grad_scores", "grad_mask"), got, want_grads, (4 * tol, mask_tol), strict=False
    ):
        w = torch.nan_to_num(w) if w is not None else torch.zeros_like(g, dtype=torch.float64)
        _close(name, g, w, t, seed)


# ---- sdpa_mask --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_sdpa_mask_fuzz(device, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = rng.choice([1, 2, 3])
    q_length, kv_length = rng.choice([0, 1, 5, 33]), rng.choice([0, 1, 6, 40])
    kwargs = dict(batch_size=batch, q_length=q_length, kv_length=kv_length, causal=rng.random() < 0.7)
    kwargs["kv_offset"] = rng.choice([0, 0, 3, 2**62, 2**63 - 1 - kv_length])
    total = kwargs["kv_offset"] + kv_length
    if rng.random() < 0.25:
        kwargs["q_positions"] = rng.choice(
            [
                torch.tensor(rng.choice([0, 7, 2**63 - 1])),
                torch.randint(-3, 50, (q_length,)),
                torch.randint(-3, 50, (batch, q_length)),
            ]
        )
    else:
        kwargs["q_offset"] = rng.choice([0, 2, kv_length, 2**62, 2**63 - 1 - q_length])
    if rng.random() < 0.4:
        kwargs["sliding_window"] = rng.choice([1, 3, 17, 2**63 - 1])
    if rng.random() < 0.3:
        kwargs["chunk_size"] = rng.choice([1, 4, 2**62])
        if rng.random() < 0.5:
            kwargs["chunk_left_padding"] = torch.randint(-2, 6, (batch,), generator=gen)
    small = total < 10_000 and kwargs.get("q_offset", 0) < 10_000 and "q_positions" not in kwargs
    if small and rng.random() < 0.3:
        width = max(total, kwargs.get("q_offset", 0) + q_length)
        kwargs["packed_ids"] = torch.sort(torch.randint(0, 3, (batch, width), generator=gen), dim=-1).values
    if small and rng.random() < 0.2:
        kwargs["block_ids"] = torch.randint(-1, 3, (batch, total + 2), generator=gen)
    if rng.random() < 0.5:
        kwargs["padding_mask"] = torch.rand(batch, rng.choice([1, 10, 64]), generator=gen) > 0.3
    if rng.random() < 0.4:
        kwargs["dtype"] = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        kwargs["use_finfo_min"] = rng.random() < 0.5
    want = reference.sdpa_mask(**kwargs)
    got = safeattn.sdpa_mask(**_on(device, kwargs), device=device)
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want), f"seed {seed}: {kwargs}"
