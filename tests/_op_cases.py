"""The ops as traced functions with inputs for a sequence length n, shared by test_compile.py,
test_export.py and test_concurrency.py (one case per op, private backward ops included)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import safeattn
import torch

HAS_ATTENTION = hasattr(safeattn, "attention")
NEEDS_ATTENTION = pytest.mark.skipif(not HAS_ATTENTION, reason="safeattn.attention is not in this build")
NEG_INF = float("-inf")


# ---- the cases: one traced function per op, with inputs for a sequence length n -----------------
# Each function returns a tuple of tensors. Where it takes a differentiable input, it also builds a
# tensor by sliced assignment from it (pytorch #169179: under compile that tensor could lose
# requires_grad) and feeds it to the op, and returns that tensor too.


def _randn(*shape, device, requires_grad=False, gen):
    return torch.randn(*shape, generator=gen).to(device).requires_grad_(requires_grad)


def _left_padding(b, n, device):
    """[b, n] bool padding mask; row 0 has 2 left pad tokens (its first queries see no key)."""
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[0, :2] = False
    return pad.to(device)


def _mask_fn(pad, q_positions):
    b, n = pad.shape
    sliding = safeattn.sdpa_mask(b, n, n, padding_mask=pad, sliding_window=3)
    additive = safeattn.sdpa_mask(b, n, n, padding_mask=pad, dtype=torch.float32)
    # A decode step: one query at position n - 1 over the n keys.
    decode = safeattn.sdpa_mask(b, 1, n, n - 1, padding_mask=pad, dtype=torch.float16, use_finfo_min=True)
    chunked = safeattn.sdpa_mask(b, n, n, q_positions=q_positions, chunk_size=4, causal=False)
    causal = safeattn.sdpa_mask(b, n, n, device=pad.device)  # no tensor argument: sizes and device
    return sliding, additive, decode, chunked, causal


def _mask_inputs(n, device, gen):
    return (_left_padding(2, n, device), torch.arange(n, device=device) + 2)


def _safe_softmax_fn(x):
    buf = torch.full(x.shape, NEG_INF, dtype=x.dtype, device=x.device)
    buf[:, :, 1:] = x[:, :, 1:]  # query row 0 stays -inf: a fully masked row, output 0
    out = safeattn.safe_softmax(buf, -1)
    # Non-contiguous input, another dim, and the dtype argument.
    out64 = safeattn.safe_softmax(x.transpose(-1, -2), 2, dtype=torch.float64)
    return buf, out, out64


def _safe_softmax_inputs(n, device, gen):
    x = torch.randn(2, 3, n, n, generator=gen)
    x[1, 2, n // 2] = NEG_INF  # a fully -inf row inside x itself
    x[0, 1, :, n // 3] = NEG_INF
    return (x.to(device).requires_grad_(),)


def _masked_softmax_fn(scores, pad, bias):
    b, _, n, _ = scores.shape
    mask = safeattn.sdpa_mask(b, n, n, padding_mask=pad)  # [b, 1, n, n]: left padding masks rows
    buf = torch.zeros(scores.shape, dtype=scores.dtype, device=scores.device)
    buf[:, :, :, 1:] = scores[:, :, :, 1:]
    boolean = safeattn.masked_softmax(buf, mask, 0.5)
    biased = safeattn.masked_softmax(scores, bias, 0.25)  # float bias: gradients for both
    bias_only = safeattn.masked_softmax(scores.detach(), bias, 1.0, -1, torch.float64)
    return buf, boolean, biased, bias_only


def _masked_softmax_inputs(n, device, gen):
    bias = torch.randn(1, 1, n, n, generator=gen)
    bias[0, 0, n - 2] = NEG_INF  # a fully masked row through the bias
    return (
        _randn(2, 3, n, n, device=device, requires_grad=True, gen=gen),
        _left_padding(2, n, device),
        bias.to(device).requires_grad_(),
    )


def _attention_fn(q, k, v, pad, bias, sinks):
    b, h, n, d = q.shape
    mask = safeattn.sdpa_mask(b, n, n, padding_mask=pad)
    kbuf = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    kbuf[..., : d // 2] = k[..., : d // 2]
    # Float arguments are passed explicitly: a float default restarts the trace (see
    # test_compile.py::test_default_arguments_trace_once), which this case does not test.
    out, lse = safeattn.attention(q, kbuf, v, mask, 0.0, softcap=0.0)
    # Grouped-query (one key/value head for two query heads), causal at an offset, with sinks.
    gqa, gqa_lse = safeattn.attention(
        q, k[:, :1], v[:, :1], None, 0.0, True, enable_gqa=True, q_offset=1, softcap=0.0, sinks=sinks
    )
    # A learnable float bias with soft-capping.
    biased, biased_lse = safeattn.attention(q, k, v, bias, 0.0, softcap=5.0)
    return kbuf, out, lse, gqa, gqa_lse, biased, biased_lse


def _attention_inputs(n, device, gen):
    bias = torch.randn(1, 2, n, n, generator=gen)
    bias[0, 1, 3] = NEG_INF
    return (
        _randn(2, 2, n, 8, device=device, requires_grad=True, gen=gen),
        _randn(2, 2, n, 8, device=device, requires_grad=True, gen=gen),
        _randn(2, 2, n, 8, device=device, requires_grad=True, gen=gen),
        _left_padding(2, n, device),
        bias.to(device).requires_grad_(),
        _randn(2, device=device, requires_grad=True, gen=gen),
    )


def _softmax_backward_ops_fn(grad, out, mask):
    a = torch.ops.safeattn._safe_softmax_backward(grad, out, -1, torch.float32)
    b, c = torch.ops.safeattn._masked_softmax_backward(grad, out, mask, 0.5, -1, torch.float32, True)
    return a, b, c


def _softmax_backward_ops_inputs(n, device, gen):
    scores = torch.randn(2, 3, n, n, generator=gen)
    scores[0, 0, 1] = NEG_INF
    out = torch.softmax(scores, -1).nan_to_num(0.0)
    return (
        _randn(2, 3, n, n, device=device, gen=gen),
        out.to(device),
        _randn(2, 1, n, n, device=device, gen=gen),
    )


def _attention_backward_op_fn(grad_out, grad_lse, q, k, v, out, lse, mask):
    return torch.ops.safeattn._attention_backward(
        grad_out, grad_lse, q, k, v, out, lse, mask, False, 0.35, 0, 0, 0.0, None, True
    )


def _attention_backward_op_inputs(n, device, gen):
    q, k, v = (_randn(2, 2, n, 8, device=device, gen=gen) for _ in range(3))
    mask = _randn(2, 1, n, n, device=device, gen=gen)
    out, lse = safeattn.attention(q, k, v, mask, scale=0.35)
    return (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, mask)


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable[..., tuple]
    make: Callable[..., tuple]  # (n, device, gen) -> the function's arguments
    needs_attention: bool = False


CASES = [
    Case("sdpa_mask", _mask_fn, _mask_inputs),
    Case("safe_softmax", _safe_softmax_fn, _safe_softmax_inputs),
    Case("masked_softmax", _masked_softmax_fn, _masked_softmax_inputs),
    Case("softmax_backward_ops", _softmax_backward_ops_fn, _softmax_backward_ops_inputs),
    Case("attention", _attention_fn, _attention_inputs, needs_attention=True),
    Case(
        "attention_backward_op",
        _attention_backward_op_fn,
        _attention_backward_op_inputs,
        needs_attention=True,
    ),
]
CASE_PARAMS = [
    pytest.param(c, id=c.name, marks=[NEEDS_ATTENTION] if c.needs_attention else []) for c in CASES
]


def make_inputs(case: Case, n: int, device: str, seed: int = 0) -> tuple:
    return case.make(n, device, torch.Generator().manual_seed(seed * 1000 + n))


def clone_inputs(args: tuple, requires_grad: bool = True) -> tuple:
    """Independent leaves with the same values (and requires_grad, unless requires_grad=False)."""
    return tuple(
        a.detach().clone().requires_grad_(requires_grad and a.requires_grad)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    )


def run(fn, args: tuple, seed: int = 1):
    """fn's outputs and the gradients of its differentiable inputs for fixed output weights."""
    outs = fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    diff = [o for o in outs if o.requires_grad]
    if not (leaves and diff):
        return outs, None
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in diff]
    grads = torch.autograd.grad(diff, leaves, weights, allow_unused=True)
    return outs, grads


def assert_same(got, want, what: str):
    """Compiled vs eager: same requires_grad, dtype, shape, values (bool exactly, NaN where NaN)."""
    assert len(got) == len(want), f"{what}: {len(got)} outputs, eager gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None or g is None:
            assert g is None and w is None, f"{what}[{i}]: gradient None in one run only"
            continue
        assert (
            g.requires_grad == w.requires_grad
        ), f"{what}[{i}]: requires_grad {g.requires_grad} under compile, {w.requires_grad} in eager"
        assert (g.dtype, g.shape) == (
            w.dtype,
            w.shape,
        ), f"{what}[{i}]: {g.dtype} {tuple(g.shape)} under compile, eager {w.dtype} {tuple(w.shape)}"
        torch.testing.assert_close(
            g.detach(),
            w.detach(),
            rtol=1e-5,
            atol=1e-6,
            equal_nan=True,
            msg=lambda m, i=i: f"{what}[{i}]: {m}",
        )
