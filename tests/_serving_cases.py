"""Shared pieces of the serving tests (test_varlen.py, test_kvcache.py): FlashAttention's tolerance
rule as tests/test_attention.py applies it, against the float64 references of reference.py.

Rule: the error against the float64 reference must be at most 2x (3x for gradients) the error of
PyTorch computing the same formula in the inputs' low precision, plus a small absolute floor.
"""

from __future__ import annotations

import torch

FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3, torch.float64: 1e-10}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def low_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision PyTorch's yardstick computes in (float32 for float64 inputs)."""
    return dtype if dtype != torch.float64 else torch.float32


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| over elements, matching infinities (and NaNs) counted as equal."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    same = (got == want) | (got.isnan() & want.isnan())
    diff = (got - want).abs().masked_fill(same, 0.0)
    return diff.max().item() if diff.numel() else 0.0


def compare(name: str, got, ref64, ref_low, factor: float, floor: float) -> None:
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref64.shape)}"
    err = max_err(got, ref64)
    yard = max_err(ref_low, ref64)
    assert (
        err <= factor * yard + floor
    ), f"{name}: error {err:.3g} > {factor} x PyTorch's {yard:.3g} + {floor:g}"


def compare_outputs(dtype, got, ref64, ref_low) -> None:
    """got, ref64, ref_low: (out, lse) each. lse is -inf exactly where the reference's is."""
    floor = FLOOR[dtype]
    compare("out", got[0], ref64[0], ref_low[0], 2, floor)
    compare("lse", got[1], ref64[1], ref_low[1], 2, floor)
    assert torch.equal(
        got[1].isneginf().cpu(), ref64[1].isneginf().cpu()
    ), "lse is -inf on other rows than the reference's"


def compare_grads(dtype, names, inputs, got_out, ref_out, low_out, seed: int = 1) -> None:
    """Gradients of sum(out * g) for one random g, against the references' (3x rule)."""
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(got_out.shape, generator=gen).to(device=got_out.device, dtype=dtype)
    got = torch.autograd.grad(got_out, inputs, grad_out, allow_unused=True)
    want = torch.autograd.grad(ref_out, inputs, grad_out.to(ref_out.dtype), allow_unused=True)
    low = torch.autograd.grad(low_out, inputs, grad_out.to(low_out.dtype), allow_unused=True)
    for name, g, w, lo in zip(names, got, want, low, strict=True):
        assert (g is None) == (w is None), f"{name}: gradient presence differs from the reference"
        if g is None:
            continue
        scale = max(1.0, w.abs().max().item())  # gradients scale with what they multiply
        compare(name, g, w, lo, 3, FLOOR[dtype] * scale * 4)
