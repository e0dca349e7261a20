"""safe_softmax, masked_softmax and their backward ops against the float64 references.

Runs on CPU; the CUDA cases run where a GPU is visible (same file on the GPU host).
"""

from __future__ import annotations

import math

import pytest
import safeattn
import torch
from conftest import DEVICES, NEEDS_CUDA
from safeattn import reference

LOW_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPES = [*LOW_DTYPES, torch.float64]
NEG_INF = float("-inf")

# Absolute floor of the forward tolerance (outputs are in [0, 1]); the bound is also at least
# twice the error of torch.softmax computing the same thing in the same dtype (flash-attention's
# rule), so it tracks what the dtype can give.
FWD_ATOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# Gradients are compared with the reference backward evaluated on the same (rounded) inputs, so
# only the final rounding and the float32 accumulation differ.
BWD_TOL = {
    torch.float64: dict(atol=1e-12, rtol=1e-10),
    torch.float32: dict(atol=1e-6, rtol=1e-4),
    torch.float16: dict(atol=1e-4, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-3, rtol=2e-2),
}


def assert_forward_close(actual, expected64, peer, what):
    """actual (any dtype) vs the float64 reference; peer: torch computing it in actual's dtype."""
    assert (
        actual.shape == expected64.shape
    ), f"{what}: shape {tuple(actual.shape)} != {tuple(expected64.shape)}"
    nan = expected64.isnan()
    assert torch.equal(actual.isnan().cpu(), nan.cpu()), f"{what}: NaN positions differ from the reference"
    err = (actual.double() - expected64).abs().masked_fill(nan, 0)
    peer_err = (peer.double() - expected64).abs().masked_fill(nan, 0).nan_to_num(0)
    bound = max(2 * peer_err.max().item() if peer_err.numel() else 0.0, FWD_ATOL[actual.dtype])
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= bound, f"{what}: max error {worst:.3g} > bound {bound:.3g}"


def torch_masked_softmax(scores, mask, scale, dim):
    """What PyTorch users write today, in the scores' dtype (NaN on fully masked rows)."""
    x = scores * scale
    if mask is not None:
        x = x.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else x + mask.to(x.dtype)
    return torch.softmax(x, dim)


# ---- safe_softmax forward ----------------------------------------------------------------

SHAPES_DIMS = [
    ((1,), 0),
    ((17,), -1),
    ((5, 1), -1),
    ((7, 1000), -1),
    ((3, 65536), 1),
    ((2, 150001), -1),  # longer than one staged chunk: the online path
    ((4, 17, 33), 0),
    ((4, 17, 33), 1),
    ((4, 17, 33), 2),
    ((2, 3, 5, 97), 1),
    ((3, 1025, 2), 1),
    ((2, 6000, 19), 1),  # dim_size x vector too big to stage: the re-reading column path
    ((), 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", SHAPES_DIMS, ids=[f"{s}-{d}" for s, d in SHAPES_DIMS])
def test_safe_softmax_matches_reference(device, dtype, shape, dim):
    x = torch.randn(shape, device=device).mul_(3).to(dtype)
    out = safeattn.safe_softmax(x, dim)
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    assert_forward_close(out, reference.safe_softmax(x, dim), torch.softmax(x, dim), f"{shape} dim {dim}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_safe_softmax_non_contiguous(device, dtype):
    base = torch.randn(6, 40, 50, device=device).to(dtype)
    for x, dim in [
        (base.transpose(1, 2), -1),
        (base[:, ::2, 1:], 1),
        (base.permute(2, 0, 1), 0),
        (base[..., 3], -1),
    ]:
        assert not x.is_contiguous()
        out = safeattn.safe_softmax(x, dim)
        assert_forward_close(
            out, reference.safe_softmax(x, dim), torch.softmax(x, dim), f"view {tuple(x.shape)}"
        )


@pytest.mark.parametrize("device", DEVICES)
def test_safe_softmax_dtype_argument(device):
    x = torch.randn(5, 300, device=device, dtype=torch.bfloat16)
    out = safeattn.safe_softmax(x, -1, dtype=torch.float32)
    assert out.dtype == torch.float32, f"dtype=float32 gave {out.dtype}"
    expected = torch.softmax(x, -1, dtype=torch.float32)
    torch.testing.assert_close(
        out, expected, atol=1e-6, rtol=1e-5, msg="dtype=float32 differs from torch.softmax"
    )
    down = safeattn.safe_softmax(x.float(), -1, dtype=torch.float16)
    assert down.dtype == torch.float16, f"dtype=float16 gave {down.dtype}"
    torch.testing.assert_close(down, torch.softmax(x.float(), -1, dtype=torch.float16), atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((6, 37), -1), ((4, 70000), -1), ((5, 23, 4), 1), ((23, 3, 2), 0)])
def test_fully_neg_inf_slices_zero_and_nan_propagates(device, dtype, shape, dim):
    # Built with the softmax dim last, slices as rows, then moved into place.
    moved = torch.randn(shape, device=device).movedim(dim, -1).contiguous()
    rows = moved.view(-1, moved.shape[-1])
    rows[0] = NEG_INF  # all -inf -> 0
    rows[1, ::3] = NEG_INF  # some -inf -> softmax of the rest
    rows[2, 1] = float("nan")  # NaN -> NaN slice
    rows[3, 2] = float("inf")  # a real infinity is not masking -> NaN slice
    x = moved.movedim(-1, dim).contiguous().to(dtype)
    out = safeattn.safe_softmax(x, dim)
    out_rows = out.movedim(dim, -1).reshape(rows.shape)
    assert (out_rows[0] == 0).all(), "an all -inf slice must give 0"
    assert out_rows[2].isnan().all() and out_rows[3].isnan().all(), "NaN / +inf slices must be NaN"
    assert not out_rows[4:].isnan().any() and not out_rows[:2].isnan().any(), "NaN leaked into other slices"
    assert_forward_close(
        out, reference.safe_softmax(x, dim), torch.ops.aten._safe_softmax(x, dim), "special slices"
    )


@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensors(device):
    for shape, dim in [((0, 5), -1), ((3, 0), -1), ((3, 0, 4), 1), ((2, 0, 4), 0)]:
        x = torch.randn(shape, device=device, requires_grad=True)
        out = safeattn.safe_softmax(x, dim)
        assert out.shape == x.shape, f"{shape}: output shape {tuple(out.shape)}"
        out.sum().backward()
        assert x.grad.shape == x.shape, f"{shape}: gradient shape {tuple(x.grad.shape)}"
        m = safeattn.masked_softmax(x.detach(), torch.ones(shape, dtype=torch.bool, device=device), dim=dim)
        assert m.shape == x.shape, f"{shape}: masked output shape {tuple(m.shape)}"


# ---- safe_softmax backward ---------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,dim", [((7, 1000), -1), ((2, 65536), -1), ((4, 17, 33), 1), ((3, 5, 9), 0), ((), 0)]
)
def test_safe_softmax_backward_matches_reference(device, dtype, shape, dim):
    x = torch.randn(shape, device=device).mul_(2).to(dtype)
    if x.dim() > 0:
        x.select(0, 0).fill_(NEG_INF)  # a fully masked slice (for dim != 0)
    x.requires_grad_(True)
    out = safeattn.safe_softmax(x, dim)
    grad = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, grad)
    expected = reference.safe_softmax_backward(grad, out.detach(), dim)
    assert gx.dtype == dtype, f"gradient dtype {gx.dtype}"
    assert not gx.isnan().any(), "the gradient holds NaN"
    torch.testing.assert_close(gx.double(), expected, **BWD_TOL[dtype], msg=f"gradient {shape} dim {dim}")
    if x.dim() > 1 and dim != 0:
        assert (gx.select(0, 0) == 0).all(), "a fully masked slice must get gradient 0"


@pytest.mark.parametrize("device", DEVICES)
def test_backward_input_dtype_and_non_contiguous(device):
    x = torch.randn(8, 300, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = safeattn.safe_softmax(x, -1, dtype=torch.float32)
    grad = torch.randn(300, 8, device=device).t()  # non-contiguous incoming gradient
    (gx,) = torch.autograd.grad(out, x, grad)
    assert gx.dtype == torch.bfloat16, f"gradient must come back in the input dtype, got {gx.dtype}"
    expected = reference.safe_softmax_backward(grad, out.detach(), -1)
    torch.testing.assert_close(gx.double(), expected, atol=1e-3, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_never_nan_on_masked_elements(device):
    # inf / NaN arriving as grad_out at elements whose output is 0 must not leak.
    x = torch.randn(4, 50, device=device)
    x[0] = NEG_INF
    x[1, :10] = NEG_INF
    x.requires_grad_(True)
    out = safeattn.safe_softmax(x, -1)
    grad = torch.randn_like(out)
    grad[0] = float("nan")
    grad[1, :10] = float("inf")
    (gx,) = torch.autograd.grad(out, x, grad)
    assert not gx.isnan().any(), "NaN / inf gradients at zero outputs leaked"
    assert (gx[0] == 0).all() and (gx[1, :10] == 0).all(), "masked elements must get gradient 0"
    expected = reference.safe_softmax_backward(grad, out.detach(), -1)
    torch.testing.assert_close(gx.double(), expected, atol=1e-6, rtol=1e-4)


# ---- every last-dim row strategy of the CUDA kernels --------------------------------------

# Row lengths that reach each CUDA strategy (32 values per thread): lanes of a warp in groups of
# 4 to 32 (up to 1024), one block of 64 to 256 threads (up to 8192), a cluster of 2, 4 or 8
# blocks (up to 65536), then the read-twice path; odd lengths take the one-element loads.
ROW_LENGTHS = [8, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 1023, 8193, 70001]


def special_rows(n, device):
    """Five rows of n: all -inf; -inf on the first 60% (whole blocks of a split row see only
    -inf); a NaN at the end; +inf in the middle; a normal row whose max sits near the end."""
    x = torch.randn(5, n, device=device).mul_(3)
    x[0] = NEG_INF
    x[1, : (3 * n) // 5] = NEG_INF
    x[2, -1] = float("nan")
    x[3, n // 2] = float("inf")
    x[4, n - 1 - n // 9] = 40.0
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.slow
def test_every_row_strategy(device, dtype):
    for n in ROW_LENGTHS:
        x = special_rows(n, device).to(dtype)
        out = safeattn.safe_softmax(x, -1)
        assert (out[0] == 0).all(), f"n={n}: an all -inf row must give 0"
        assert out[2].isnan().all() and out[3].isnan().all(), f"n={n}: NaN / +inf rows must be NaN"
        assert not out[[0, 1, 4]].isnan().any(), f"n={n}: NaN leaked into another row"
        expected, peer = reference.safe_softmax(x, -1), torch.ops.aten._safe_softmax(x, -1)
        assert_forward_close(out, expected, peer, f"n={n}")
        # The masked variants of the same kernels: a bool mask (one row fully masked) and a bias.
        keep = torch.rand(5, n, device=device) > 0.3
        keep[4] = False
        clean = torch.where(x.isnan() | (x == float("inf")), 0.0, x)
        masked = safeattn.masked_softmax(clean, keep, 0.5)
        assert (masked[4] == 0).all(), f"n={n}: a fully masked row must give 0"
        peer = torch_masked_softmax(clean, keep, 0.5, -1).nan_to_num(0)
        assert_forward_close(masked, reference.masked_softmax(clean, keep, 0.5), peer, f"n={n} bool mask")
        bias = torch.randn(1, n, device=device).to(dtype)
        biased = safeattn.masked_softmax(clean, bias, 0.5)
        peer = torch_masked_softmax(clean, bias, 0.5, -1).nan_to_num(0)
        assert_forward_close(biased, reference.masked_softmax(clean, bias, 0.5), peer, f"n={n} bias")
        # Backward on the rows without NaN.
        y = out[[0, 1, 4]].contiguous()
        grad = torch.randn_like(y)
        gx = torch.ops.safeattn._safe_softmax_backward(grad, y, -1, dtype)
        expected = reference.safe_softmax_backward(grad, y, -1)
        assert not gx.isnan().any(), f"n={n}: the gradient holds NaN"
        assert (gx[0] == 0).all(), f"n={n}: an all -inf row must get gradient 0"
        torch.testing.assert_close(gx.double(), expected, **BWD_TOL[dtype], msg=f"n={n}: gradient")


def test_long_float32_rows_accurate():
    # The CPU rows sum exp(x - max) into four vector accumulators: at 65536 elements a single
    # one (8 lanes, the baseline variant) reached a relative error of 6.1e-6 against float64,
    # as torch's own softmax does; four give 7.6e-7. Rows of 3 N(0, 1), error relative to each
    # row's largest probability.
    torch.manual_seed(0)
    for n in (65536, 70001, 1 << 20):
        x = torch.randn(4, n).mul_(3)
        out = safeattn.safe_softmax(x, -1).double()
        expected = reference.safe_softmax(x.double(), -1)
        err = ((out - expected).abs().amax(-1) / expected.amax(-1)).max().item()
        assert err < 2e-6, f"n={n}: relative error {err:.3g} against float64"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.bfloat16, (300000, 128)),  # groups of 4 lanes
        (torch.float32, (20000, 2048)),  # one block of 64 threads per row
        (torch.bfloat16, (9000, 8192)),  # one block of 256 threads
        (torch.float32, (9000, 16384)),  # clusters of 2 blocks
    ],
)
def test_many_rows_per_block_cuda(dtype, shape):
    # More rows than the grid holds, so blocks (and clusters) loop over rows and reuse their
    # shared-memory slots; the last rows are the special ones.
    x = torch.randn(shape, device="cuda").mul_(3).to(dtype)
    x[-1] = NEG_INF
    x[-2, -1] = float("nan")
    x[-3, : shape[1] // 2] = NEG_INF
    out = safeattn.safe_softmax(x, -1)
    assert (out[-1] == 0).all(), "an all -inf row must give 0"
    assert out[-2].isnan().all(), "a NaN row must be NaN"
    assert not out[:-2].isnan().any() and not out[-1].isnan().any(), "NaN leaked into another row"
    assert_forward_close(out, reference.safe_softmax(x, -1), torch.ops.aten._safe_softmax(x, -1), f"{shape}")
    y = out[:-2].contiguous()
    grad = torch.randn_like(y)
    gx = torch.ops.safeattn._safe_softmax_backward(grad, y, -1, dtype)
    expected = reference.safe_softmax_backward(grad, y, -1)
    torch.testing.assert_close(gx.double(), expected, **BWD_TOL[dtype], msg=f"{shape}: gradient")


# ---- masked_softmax ----------------------------------------------------------------------

MASK_CASES = [
    # (scores shape, mask shape, dim)
    ((2, 3, 5, 17), (2, 1, 5, 17), -1),  # [B, 1, Q, KV] against [B, H, Q, KV]
    ((2, 3, 5, 1000), (5, 1000), -1),  # fewer dims
    ((2, 3, 4, 33), (2, 3, 4, 1), -1),  # broadcast along the softmax dim
    ((2, 3, 4, 33), (1, 3, 1, 33), -1),
    ((2, 3, 7, 9), (2, 1, 7, 9), 2),  # another dim
    ((4, 70000), (4, 70000), -1),  # long rows, no broadcast
    ((6, 13), (), -1),
]


def make_mask(kind, shape, device, fully_masked_row=True):
    if kind == "bool":
        m = torch.rand(shape, device=device) > 0.3
        if fully_masked_row and len(shape) >= 2:
            m[(0,) * (len(shape) - 1)] = False  # one slice along the last dim, fully masked
        return m
    m = torch.randn(shape, device=device)
    if fully_masked_row and len(shape) >= 2:
        m[(0,) * (len(shape) - 1)] = NEG_INF
    return m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("case", MASK_CASES, ids=[f"{s}-{m}-{d}" for s, m, d in MASK_CASES])
def test_masked_softmax_matches_reference(device, dtype, kind, case):
    shape, mask_shape, dim = case
    scores = torch.randn(shape, device=device).mul_(2).to(dtype)
    mask = make_mask(kind, mask_shape, device)
    if kind == "float":
        mask = mask.to(dtype)
    out = safeattn.masked_softmax(scores, mask, 0.37, dim)
    expected = reference.masked_softmax(scores, mask, 0.37, dim)
    peer = torch_masked_softmax(scores, mask, 0.37, dim).nan_to_num(0)
    assert_forward_close(out, expected, peer, f"{kind} mask {mask_shape} on {shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_masked_softmax_mask_dtypes_and_views(device):
    scores = torch.randn(2, 4, 6, 50, device=device, dtype=torch.bfloat16)
    # A float32 bias on bfloat16 scores is added in float32.
    bias32 = torch.randn(2, 1, 6, 50, device=device)
    out = safeattn.masked_softmax(scores, bias32, 0.5)
    assert out.dtype == torch.bfloat16, f"output dtype {out.dtype}"
    assert_forward_close(
        out,
        reference.masked_softmax(scores, bias32, 0.5),
        torch_masked_softmax(scores, bias32.bfloat16(), 0.5, -1),
        "fp32 bias",
    )
    # A float64 bias on float32 scores is cast to float32; a non-contiguous mask is read in place.
    s32 = scores.float()
    bias64 = torch.randn(2, 1, 50, 6, device=device, dtype=torch.float64).transpose(-1, -2)
    assert not bias64.is_contiguous()
    out = safeattn.masked_softmax(s32, bias64)
    assert_forward_close(
        out,
        reference.masked_softmax(s32, bias64.float()),
        torch_masked_softmax(s32, bias64.float(), 1.0, -1),
        "fp64 view",
    )
    boolean = (torch.rand(2, 1, 50, 6, device=device) > 0.5).transpose(-1, -2)
    out = safeattn.masked_softmax(s32, boolean, 2.0)
    assert_forward_close(
        out,
        reference.masked_softmax(s32, boolean, 2.0),
        torch_masked_softmax(s32, boolean, 2.0, -1).nan_to_num(0),
        "bool view",
    )
    # No mask: a plain scaled softmax; dtype argument casts first.
    out = safeattn.masked_softmax(scores, None, 0.25, dtype=torch.float32)
    assert out.dtype == torch.float32, f"dtype=float32 gave {out.dtype}"
    torch.testing.assert_close(out, torch.softmax(scores.float() * 0.25, -1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_nan_poisoned_masked_positions_never_leak(device, dtype):
    scores = torch.randn(2, 3, 8, 40, device=device).to(dtype)
    mask = torch.rand(2, 1, 8, 40, device=device) > 0.4
    mask[0, 0, 0] = False  # fully masked query row
    poisoned = scores.masked_fill(~mask, float("nan")).requires_grad_(True)
    out = safeattn.masked_softmax(poisoned, mask)
    assert not out.isnan().any(), "NaN at masked positions leaked into the output"
    assert (out.masked_select(~mask) == 0).all(), "masked positions must be 0"
    grad = torch.randn_like(out).masked_fill(~mask, float("nan"))
    (gs,) = torch.autograd.grad(out, poisoned, grad)
    assert not gs.isnan().any(), "NaN leaked into the scores' gradient"
    assert (gs.masked_select(~mask) == 0).all(), "masked positions must get gradient 0"
    clean = safeattn.masked_softmax(scores, mask)
    assert torch.equal(out, clean), "the values at masked positions changed the result"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "mask_shape,dim", [((2, 1, 5, 33), -1), ((5, 33), -1), ((2, 3, 5, 33), -1), ((1, 3, 1, 33), 2)]
)
def test_masked_softmax_gradients(device, dtype, mask_shape, dim):
    scores = torch.randn(2, 3, 5, 33, device=device).to(dtype).requires_grad_(True)
    bias = torch.randn(mask_shape, device=device).to(dtype)
    bias[(0,) * (len(mask_shape) - 1)] = NEG_INF  # some fully masked slices
    bias.requires_grad_(True)
    out = safeattn.masked_softmax(scores, bias, 0.6, dim)
    grad = torch.randn_like(out)
    gs, gb = torch.autograd.grad(out, (scores, bias), grad)
    assert gs.dtype == dtype and gb.dtype == dtype, f"gradient dtypes {gs.dtype}, {gb.dtype}"
    assert gb.shape == bias.shape, f"bias gradient shape {tuple(gb.shape)} != {tuple(bias.shape)}"
    gx = reference.safe_softmax_backward(grad, out.detach(), dim)
    tol = BWD_TOL[dtype]
    torch.testing.assert_close(gs.double(), 0.6 * gx, **tol, msg="scores gradient")
    expected_gb = gx.sum_to_size(bias.shape) if len(mask_shape) == 4 else gx.sum((0, 1))
    torch.testing.assert_close(
        gb.double(), expected_gb, atol=tol["atol"] * 16, rtol=tol["rtol"], msg="bias gradient"
    )
    assert not gs.isnan().any() and not gb.isnan().any(), "NaN in a gradient"
    # Deterministic: the same call gives the same bits.
    gs2, gb2 = torch.autograd.grad(safeattn.masked_softmax(scores, bias, 0.6, dim), (scores, bias), grad)
    assert torch.equal(gb, gb2) and torch.equal(gs, gs2), "gradients differ between two identical calls"


def test_gradcheck_float64():
    s = torch.randn(2, 3, 4, 7, dtype=torch.float64, requires_grad=True)
    m = torch.randn(2, 1, 4, 7, dtype=torch.float64, requires_grad=True)
    b = torch.rand(2, 1, 4, 7) > 0.3
    b[0, 0, 1] = False
    for dim in (-1, 1):
        assert torch.autograd.gradcheck(lambda x, d=dim: safeattn.safe_softmax(x, d), (s,))
    assert torch.autograd.gradcheck(lambda x, y: safeattn.masked_softmax(x, y, 0.7), (s, m))
    assert torch.autograd.gradcheck(lambda x, y: safeattn.masked_softmax(x, y, 1.3, dim=2), (s, m))
    assert torch.autograd.gradcheck(lambda x: safeattn.masked_softmax(x, b, 0.7), (s,))


def test_double_backward_matches_aten():
    # Second derivatives go through the backward ops' own autograd (tests/test_autograd_transforms.py
    # covers forward AD, torch.func and gradgradcheck); here one value check against PyTorch.
    x = torch.randn(3, 5, dtype=torch.float64)
    x[1] = NEG_INF
    v = torch.randn(3, 5, dtype=torch.float64)
    upstream = torch.randn(3, 5, dtype=torch.float64)
    results = []
    for fn in (lambda t: safeattn.safe_softmax(t, -1), lambda t: torch.ops.aten._safe_softmax(t, -1)):
        s = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(s), s, upstream, create_graph=True)
        results.append(torch.autograd.grad((g * v).sum(), s)[0])
    torch.testing.assert_close(results[0], results[1], msg="double backward vs aten._safe_softmax")
    assert (results[0][1] == 0).all(), "a fully masked row has second derivative 0"
    m = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    s = x.clone().requires_grad_(True)
    gs, gm = torch.autograd.grad(safeattn.masked_softmax(s, m), (s, m), upstream, create_graph=True)
    second = torch.autograd.grad((gs * v).sum() + (gm * v).sum(), (s, m))
    s2, m2 = x.clone().requires_grad_(True), m.detach().clone().requires_grad_(True)
    gs2, gm2 = torch.autograd.grad(
        torch.ops.aten._safe_softmax(s2 + m2, -1), (s2, m2), upstream, create_graph=True
    )
    expected = torch.autograd.grad((gs2 * v).sum() + (gm2 * v).sum(), (s2, m2))
    for got, want in zip(second, expected, strict=True):
        torch.testing.assert_close(got, want, msg="masked_softmax double backward vs aten._safe_softmax")


# ---- PyTorch's fully masked row cases, for our ops ----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_pytorch_fully_masked_row_cases(device):
    # As test_nn's _safe_softmax checks: masked rows are 0, their gradient is 0, the other rows
    # match softmax, and a real infinity still gives NaN.
    x = torch.randn(4, 6, 8, device=device)
    mask = torch.ones(4, 6, 8, dtype=torch.bool, device=device)
    mask[1, 2] = False
    mask[3] = False
    scores = x.clone().requires_grad_(True)
    out = safeattn.masked_softmax(scores, mask)
    torch_out = torch.ops.aten._safe_softmax(x.masked_fill(~mask, NEG_INF), -1)
    torch.testing.assert_close(out, torch_out, msg="masked_softmax vs aten._safe_softmax")
    assert (out[1, 2] == 0).all() and (out[3] == 0).all(), "fully masked rows must be 0"
    out.sum().backward()
    assert (scores.grad[1, 2] == 0).all() and (scores.grad[3] == 0).all(), "masked rows must get gradient 0"
    assert not scores.grad.isnan().any(), "NaN in the gradient"
    # Real infinities: +inf in a row gives NaN, as in softmax and _safe_softmax.
    y = torch.tensor(
        [[float("inf"), 1.0, 2.0], [NEG_INF, NEG_INF, NEG_INF], [1.0, NEG_INF, 0.0]], device=device
    )
    ours = safeattn.safe_softmax(y, -1)
    theirs = torch.ops.aten._safe_softmax(y, -1)
    assert torch.equal(ours.isnan(), theirs.isnan()), "NaN pattern differs from aten._safe_softmax"
    torch.testing.assert_close(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


# ---- registration: opcheck, torch.compile ----------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(3, 5, 17, device=device, requires_grad=True)
    bias = torch.randn(3, 1, 17, device=device, requires_grad=True)
    boolean = torch.rand(3, 1, 17, device=device) > 0.3
    out = torch.rand(3, 5, 17, device=device)
    grad = torch.randn(3, 5, 17, device=device)
    cases = [
        (torch.ops.safeattn.safe_softmax.default, (x, 1, None)),
        (torch.ops.safeattn.safe_softmax.default, (x.detach().bfloat16(), -1, torch.float32)),
        (torch.ops.safeattn._safe_softmax_backward.default, (grad, out, -1, torch.float32)),
        (torch.ops.safeattn.masked_softmax.default, (x, bias, 0.5, -1, None)),
        (torch.ops.safeattn.masked_softmax.default, (x, boolean, 1.0, 1, None)),
        (torch.ops.safeattn.masked_softmax.default, (x, None, 2.0, -1, None)),
        (
            torch.ops.safeattn._masked_softmax_backward.default,
            (grad, out, bias.detach(), 0.5, -1, torch.float32, True),
        ),
        (
            torch.ops.safeattn._masked_softmax_backward.default,
            (grad, out, boolean, 0.5, -1, torch.float32, False),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_compile_fullgraph_dynamic_forward_backward(device):
    torch._dynamo.reset()

    def fn(scores, bias, boolean):
        a = safeattn.masked_softmax(scores, bias, 0.5)
        b = safeattn.masked_softmax(scores, boolean, 0.5)
        c = safeattn.safe_softmax(scores, 1)
        return a, b, c

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for q in (5, 9):
        boolean = torch.rand(2, 1, q, 11, device=device) > 0.3
        boolean[0, 0, 0] = False
        for scores_grad, bias_grad in [(True, True), (True, False), (False, True), (False, False)]:
            scores = torch.randn(2, 3, q, 11, device=device, requires_grad=scores_grad)
            bias = torch.randn(2, 1, q, 11, device=device, requires_grad=bias_grad)
            eager = fn(scores, bias, boolean)
            got = compiled(scores, bias, boolean)
            for e, g in zip(eager, got, strict=True):
                assert e.requires_grad == g.requires_grad, "requires_grad differs under compile"
                torch.testing.assert_close(g, e)
            inputs = [t for t in (scores, bias) if t.requires_grad]
            if not inputs:
                continue
            weights = [torch.randn_like(e) for e in eager]
            needed = [e for e in eager if e.requires_grad]
            grads_e = torch.autograd.grad(
                needed, inputs, [w for w, e in zip(weights, eager, strict=True) if e.requires_grad]
            )
            grads_c = torch.autograd.grad(
                [g for g in got if g.requires_grad],
                inputs,
                [w for w, e in zip(weights, eager, strict=True) if e.requires_grad],
            )
            for ge, gc in zip(grads_e, grads_c, strict=True):
                torch.testing.assert_close(gc, ge, msg="compiled gradient differs from eager")


# ---- bad inputs: the C++ check and the fake raise the same message -----------------------

BAD_CASES = [
    (
        "safe_softmax dim",
        lambda d: safeattn.safe_softmax(torch.randn(3, 4, device=d), 2),
        r"safe_softmax: dim 2 is out of range for a 2-D tensor \(expected in \[-2, 1\]\)",
    ),
    (
        "safe_softmax 0-D dim",
        lambda d: safeattn.safe_softmax(torch.randn((), device=d), 1),
        r"safe_softmax: dim 1 is out of range for a 0-D tensor",
    ),
    (
        "safe_softmax int input",
        lambda d: safeattn.safe_softmax(torch.ones(3, device=d, dtype=torch.long), 0),
        r"safe_softmax: self must be Float, Double, Half or BFloat16, got Long",
    ),
    (
        "safe_softmax dtype",
        lambda d: safeattn.safe_softmax(torch.ones(3, device=d), 0, dtype=torch.int32),
        r"safe_softmax: dtype must be Float, Double, Half or BFloat16, got Int",
    ),
    (
        "masked dim",
        lambda d: safeattn.masked_softmax(torch.randn(3, 4, device=d), None, 1.0, -3),
        r"masked_softmax: dim -3 is out of range for a 2-D tensor",
    ),
    (
        "mask shape",
        lambda d: safeattn.masked_softmax(
            torch.randn(2, 3, 4, device=d), torch.ones(3, 3, dtype=torch.bool, device=d)
        ),
        r"masked_softmax: mask of shape \[3, 3\] is not broadcastable to scores of shape \[2, 3, 4\]",
    ),
    (
        "mask rank",
        lambda d: safeattn.masked_softmax(
            torch.randn(3, 4, device=d), torch.ones(1, 3, 4, dtype=torch.bool, device=d)
        ),
        r"masked_softmax: mask of shape \[1, 3, 4\] is not broadcastable to scores of shape \[3, 4\]",
    ),
    (
        "mask dtype",
        lambda d: safeattn.masked_softmax(
            torch.randn(3, 4, device=d), torch.ones(3, 4, dtype=torch.long, device=d)
        ),
        r"masked_softmax: mask must be Bool or a floating dtype \(Float, Double, Half, BFloat16\), got Long",
    ),
    (
        "masked scale nan",
        lambda d: safeattn.masked_softmax(torch.randn(3, 4, device=d), None, math.nan),
        r"masked_softmax: scale must be a finite number in float32, got nan",
    ),
    (
        "masked scale inf",
        lambda d: safeattn.masked_softmax(torch.randn(3, 4, device=d), None, -math.inf),
        r"masked_softmax: scale must be a finite number in float32, got -inf",
    ),
    (
        # Finite in float64 but not in float32, where a float32 input is scaled: inf scores.
        "masked scale beyond float32",
        lambda d: safeattn.masked_softmax(torch.randn(3, 4, device=d), None, 1e39),
        r"masked_softmax: scale must be a finite number in float32, got 1e\+39",
    ),
    (
        "masked backward scale",
        lambda d: torch.ops.safeattn._masked_softmax_backward(
            torch.randn(3, 4, device=d), torch.randn(3, 4, device=d), None, math.inf, -1, torch.float32, False
        ),
        r"_masked_softmax_backward: scale must be a finite number in float32, got inf",
    ),
    (
        "backward shapes",
        lambda d: torch.ops.safeattn._safe_softmax_backward(
            torch.randn(3, 4, device=d), torch.randn(3, 5, device=d), -1, torch.float32
        ),
        r"_safe_softmax_backward: grad_out has shape \[3, 4\] but out has shape \[3, 5\]",
    ),
    (
        "mask grad without mask",
        lambda d: torch.ops.safeattn._masked_softmax_backward(
            torch.randn(3, 4, device=d), torch.randn(3, 4, device=d), None, 1.0, -1, torch.float32, True
        ),
        r"_masked_softmax_backward: mask_requires_grad needs a floating mask",
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_masked_softmax_scale_range_is_the_computations(device):
    """A scale beyond float32 is refused for float32 work (above) but taken where the softmax
    runs in float64: float64 scores, or float32 scores with dtype=torch.float64."""
    scores = torch.randn(3, 70, dtype=torch.float64, device=device) * 1e-39
    for x, dtype in ((scores, None), (scores.float(), torch.float64)):
        got = safeattn.masked_softmax(x, None, 1e39, dtype=dtype)
        want = reference.masked_softmax(x, None, 1e39, dtype=dtype)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want.to(got.device), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", "meta", "fake", pytest.param("cuda", marks=NEEDS_CUDA)])
@pytest.mark.parametrize("name,call,message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_inputs_raise(device, name, call, message):
    # One set of C++ checks: "cpu" and "cuda" run them in the kernels' entry points, "meta" in the
    # Meta kernel, "fake" in the Meta kernel under FakeTensorMode (what torch.compile runs).
    with pytest.raises(RuntimeError, match=message):
        if device == "fake":
            with torch._subclasses.FakeTensorMode():
                call("cpu")
        else:
            call(device)


def test_bad_device_raises():
    # A mask on another device: the C++ check on CUDA, and on the CPU with a meta mask (the
    # dispatcher picks the Meta kernel, which runs the same check). Under FakeTensorMode the Meta
    # kernel sees every tensor on meta, and FakeTensorMode raises its own device error.
    scores = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"masked_softmax: mask is on meta, expected cpu \(from scores\)"):
        safeattn.masked_softmax(scores, torch.ones(3, 4, dtype=torch.bool, device="meta"))
    if torch.cuda.is_available():
        with pytest.raises(
            RuntimeError, match=r"masked_softmax: mask is on cpu, expected cuda:\d+ \(from scores\)"
        ):
            safeattn.masked_softmax(scores.cuda(), torch.ones(3, 4, dtype=torch.bool))


# ---- more than 2^31 elements (CUDA only: too slow and large for the CPU runner) ----------


def _cuda_free_bytes():
    if not torch.cuda.is_available():
        return 0
    free, _total = torch.cuda.mem_get_info()
    return free


@pytest.mark.skipif(_cuda_free_bytes() < 24 * 2**30, reason="needs a CUDA GPU with 24 GiB free")
def test_more_than_2_pow_31_elements_cuda():
    rows, cols = 32769, 65536  # 2^31 + 65536 elements
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    x[-1] = NEG_INF
    out = safeattn.safe_softmax(x, -1)
    sample = torch.tensor([0, 1, rows // 2, rows - 3, rows - 2, rows - 1], device="cuda")
    assert_forward_close(
        out[sample], reference.safe_softmax(x[sample], -1), torch.softmax(x[sample], -1), "2^31 rows"
    )
    grad = torch.randn_like(out)
    gx = torch.ops.safeattn._safe_softmax_backward(grad, out, -1, torch.bfloat16)
    expected = reference.safe_softmax_backward(grad[sample], out[sample], -1)
    torch.testing.assert_close(gx[sample].double(), expected, **BWD_TOL[torch.bfloat16])
    del gx, grad
    mask = torch.rand(1, cols, device="cuda") > 0.5
    masked = safeattn.masked_softmax(x, mask, 0.5)
    expected = reference.masked_softmax(x[sample], mask, 0.5)
    assert_forward_close(
        masked[sample], expected, torch_masked_softmax(x[sample], mask, 0.5, -1).nan_to_num(0), "2^31 masked"
    )
