"""Autograd beyond first-order reverse mode: forward AD, torch.func, double backward.

The softmax ops against ``aten._safe_softmax`` (which supports all of it) on the samples of its
PyTorch OpInfo, against finite differences and against loops; ``attention`` (through its ATen
composite ``_attention_math``, used under transforms) against ``reference.attention`` in float64
and against the fused op's first-order gradients. CPU only: the transforms run the same Python
and ATen code on every device, and the fused kernels they call are tested per device elsewhere.
"""

from __future__ import annotations

import pytest
import safeattn
import torch
import torch.autograd.forward_ad as fwAD
from safeattn import reference
from torch.autograd import gradcheck, gradgradcheck

F64 = torch.float64
NEG_INF = float("-inf")
TOL64 = dict(atol=1e-10, rtol=1e-8)


def _assert_close(actual, expected, what, **tol):
    tol = tol or TOL64
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN positions differ"
    torch.testing.assert_close(
        actual.nan_to_num(0.0), expected.to(actual.dtype).nan_to_num(0.0), msg=lambda m: f"{what}: {m}", **tol
    )


def _masked_input(shape, generator, all_masked=False):
    """Random values with -inf where a random bool mask is False (as the _safe_softmax OpInfo)."""
    x = torch.randn(shape, dtype=F64, generator=generator)
    keep = (
        torch.zeros(shape, dtype=torch.bool) if all_masked else torch.rand(shape, generator=generator) > 0.5
    )
    return x.masked_fill(~keep, NEG_INF)


# The shapes and dims of aten._safe_softmax's OpInfo samples (common_methods_invocations.py), plus
# its two-masked-rows case, and a 0-D input.
OPINFO_SAMPLES = [
    ((2, 3, 4), 1, False),
    ((5, 5), 0, False),
    ((2, 3, 4, 5), 2, False),
    ((10,), 0, False),
    ((1, 5, 5), 1, False),
    ((3, 3), -1, True),  # every element masked
]
SAMPLE_IDS = [f"{s}-dim{d}{'-all_masked' if m else ''}" for s, d, m in OPINFO_SAMPLES]


def _sample(shape, dim, all_masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    return _masked_input(shape, g, all_masked), dim


def _two_masked_rows():
    x = torch.randn(6, 7, dtype=F64)
    x[5] = NEG_INF
    x[3] = NEG_INF
    return x


def safe(x, dim):
    return safeattn.safe_softmax(x, dim)


def aten_safe(x, dim):
    return torch.ops.aten._safe_softmax(x, dim)


# ---- safe_softmax: the OpInfo samples through every transform --------------------------------


@pytest.mark.parametrize("shape,dim,all_masked", OPINFO_SAMPLES, ids=SAMPLE_IDS)
def test_safe_softmax_gradcheck_forward_and_reverse(shape, dim, all_masked):
    """What PyTorch's test_forward_mode_AD and test_fn_fwgrad_bwgrad check, for our op."""
    x, dim = _sample(shape, dim, all_masked)
    x.requires_grad_(True)
    fn = lambda t: safe(t, dim)  # noqa: E731
    assert gradcheck(
        fn, (x,), check_forward_ad=True, check_batched_grad=True, check_batched_forward_grad=True
    )
    assert gradgradcheck(fn, (x,), check_fwd_over_rev=True, check_rev_over_rev=True, check_batched_grad=True)


@pytest.mark.parametrize("shape,dim,all_masked", OPINFO_SAMPLES, ids=SAMPLE_IDS)
def test_safe_softmax_jvp_matches_aten(shape, dim, all_masked):
    x, dim = _sample(shape, dim, all_masked)
    t = torch.randn(x.shape, dtype=F64)
    out, tangent = torch.func.jvp(lambda a: safe(a, dim), (x,), (t,))
    out_ref, tangent_ref = torch.func.jvp(lambda a: aten_safe(a, dim), (x,), (t,))
    _assert_close(out, out_ref, "jvp primal")
    _assert_close(tangent, tangent_ref, "jvp tangent vs aten._safe_softmax")
    assert tangent.abs().sum() > 0 or all_masked, "a non-trivial input must give a non-zero tangent"
    with fwAD.dual_level():
        dual = safe(fwAD.make_dual(x, t), dim)
        tangent_api = fwAD.unpack_dual(dual).tangent
    assert tangent_api is not None, "forward_ad: the output has no tangent"
    _assert_close(tangent_api, tangent_ref, "forward_ad tangent vs aten._safe_softmax")


def test_safe_softmax_jvp_matches_finite_differences():
    x = _two_masked_rows()
    t = torch.randn_like(x)
    eps = 1e-6
    numeric = (safe(x + eps * t, -1) - safe(x - eps * t, -1)) / (2 * eps)
    _, tangent = torch.func.jvp(lambda a: safe(a, -1), (x,), (t,))
    _assert_close(tangent, numeric, "jvp vs central differences", atol=1e-8, rtol=1e-6)
    assert (tangent[3] == 0).all() and (tangent[5] == 0).all(), "fully masked rows must have tangent 0"


@pytest.mark.parametrize("shape,dim,all_masked", OPINFO_SAMPLES, ids=SAMPLE_IDS)
def test_safe_softmax_func_grad_jacobians_hessian_match_aten(shape, dim, all_masked):
    x, dim = _sample(shape, dim, all_masked)
    weights = torch.randn(x.shape, dtype=F64)

    def loss(fn):
        return lambda a: (fn(a, dim).pow(3) * weights).sum()

    _assert_close(torch.func.grad(loss(safe))(x), torch.func.grad(loss(aten_safe))(x), "torch.func.grad")
    jac_ref = torch.func.jacrev(lambda a: aten_safe(a, dim))(x)
    _assert_close(torch.func.jacrev(lambda a: safe(a, dim))(x), jac_ref, "jacrev")
    _assert_close(torch.func.jacfwd(lambda a: safe(a, dim))(x), jac_ref, "jacfwd")
    hess_ref = torch.func.hessian(loss(aten_safe))(x)
    _assert_close(torch.func.hessian(loss(safe))(x), hess_ref, "hessian (jacfwd over jacrev)")
    rev_rev = torch.func.jacrev(torch.func.jacrev(loss(safe)))(x)
    _assert_close(rev_rev, hess_ref, "jacrev over jacrev")
    # Plain double backward (create_graph), no torch.func.
    xr = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(safe)(xr), xr, create_graph=True)
    (gg,) = torch.autograd.grad((g * weights).sum(), xr)
    _assert_close(
        gg, hess_ref.reshape(x.numel(), x.numel()).mv(weights.flatten()).reshape(x.shape), "double backward"
    )


@pytest.mark.parametrize("in_dim", [0, 1, -1])
@pytest.mark.parametrize("dim", [0, -1, 1])
def test_safe_softmax_vmap_matches_loop(in_dim, dim):
    x = _masked_input((3, 4, 5), torch.Generator().manual_seed(1))
    x.select(in_dim, 1).fill_(NEG_INF)  # one vmapped slice fully masked
    got = torch.vmap(lambda a: safe(a, dim), in_dims=in_dim)(x)
    expected = torch.stack([safe(s, dim) for s in x.unbind(in_dim)])
    _assert_close(got, expected, f"vmap(in_dims={in_dim}) over dim {dim}")


def test_safe_softmax_vmap_edge_cases():
    # A vmapped 1-D tensor is a batch of 0-D softmaxes (1, or 0 for -inf).
    x = torch.tensor([0.3, NEG_INF, -2.0], dtype=F64)
    _assert_close(torch.vmap(lambda a: safe(a, 0))(x), torch.tensor([1.0, 0.0, 1.0], dtype=F64), "0-D slices")
    # dtype: cast first, as the op.
    y = torch.randn(2, 3, 4, dtype=torch.float32)
    got = torch.vmap(lambda a: safeattn.safe_softmax(a, 1, torch.float64))(y)
    _assert_close(got, safe(y.double(), 2), "vmap with dtype")
    # A dim out of range for the slice is an error naming the slice's rank, not the batch's.
    with pytest.raises(RuntimeError, match=r"safe_softmax: dim 2 is out of range for a 2-D tensor"):
        torch.vmap(lambda a: safe(a, 2))(y)


def test_safe_softmax_nested_vmap_and_vmap_of_grad():
    x = _masked_input((2, 3, 4, 5), torch.Generator().manual_seed(2))
    got = torch.vmap(torch.vmap(lambda a: safe(a, -1)))(x)
    _assert_close(got, safe(x, -1), "vmap of vmap")
    weights = torch.randn(5, dtype=F64)
    per_row = torch.vmap(torch.vmap(torch.func.grad(lambda a: (safe(a, 0).pow(2) * weights).sum())))(x)
    ref = torch.vmap(torch.vmap(torch.func.grad(lambda a: (aten_safe(a, 0).pow(2) * weights).sum())))(x)
    _assert_close(per_row, ref, "vmap of grad")


# ---- safe_softmax: fully masked rows and NaN -------------------------------------------------


def test_safe_softmax_fully_masked_rows_have_zero_tangent_and_gradient():
    x = _two_masked_rows()
    t = torch.randn_like(x)
    _, tangent = torch.func.jvp(lambda a: safe(a, -1), (x,), (t,))
    assert (tangent[[3, 5]] == 0).all(), "fully masked rows: tangent must be exactly 0"
    assert tangent[[0, 1, 2, 4]].abs().sum() > 0, "other rows: a tangent"
    # Even a NaN tangent or upstream gradient on a fully masked row stays out.
    t_nan = t.clone()
    t_nan[3] = float("nan")
    _, tangent = torch.func.jvp(lambda a: safe(a, -1), (x,), (t_nan,))
    assert (tangent[3] == 0).all() and not tangent.isnan().any(), "NaN tangent on a fully masked row leaked"
    grad = torch.func.vjp(lambda a: safe(a, -1), x)[1](t_nan)[0]
    assert (
        grad[3] == 0
    ).all() and not grad.isnan().any(), "NaN upstream gradient on a fully masked row leaked"
    hess = torch.func.hessian(lambda a: safe(a, -1).pow(2).sum())(x)
    assert (hess[3] == 0).all() and (hess[:, :, 3] == 0).all(), "fully masked rows: second derivatives 0"
    assert not hess.isnan().any(), "NaN in the Hessian"


def test_safe_softmax_nan_propagates_through_transforms():
    x = torch.randn(3, 4, dtype=F64)
    x[1, 2] = float("nan")
    t = torch.randn_like(x)
    out, tangent = torch.func.jvp(lambda a: safe(a, -1), (x,), (t,))
    out_ref, tangent_ref = torch.func.jvp(lambda a: aten_safe(a, -1), (x,), (t,))
    assert out[1].isnan().all() and tangent[1].isnan().all(), "a NaN row gives NaN value and tangent"
    _assert_close(tangent, tangent_ref, "NaN pattern and values vs aten._safe_softmax")
    grad = torch.func.grad(lambda a: safe(a, -1).pow(2).sum())(x)
    assert grad[1].isnan().all() and not grad[[0, 2]].isnan().any(), "NaN stays in its row"


def test_safe_softmax_low_precision_jvp():
    x = torch.randn(4, 33, dtype=torch.float32)
    x[2] = NEG_INF
    t = torch.randn_like(x)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        _, tangent = torch.func.jvp(lambda a: safe(a, -1), (x.to(dtype),), (t.to(dtype),))
        _, ref = torch.func.jvp(lambda a: aten_safe(a, -1), (x.double(),), (t.double(),))
        assert tangent.dtype == dtype, f"tangent dtype {tangent.dtype}, expected {dtype}"
        _assert_close(tangent.double(), ref, f"{dtype} tangent", atol=tol, rtol=tol)
    # With dtype=: the input is cast first, the tangent too.
    _, tangent = torch.func.jvp(lambda a: safeattn.safe_softmax(a, -1, torch.float64), (x,), (t,))
    _, ref = torch.func.jvp(lambda a: aten_safe(a.double(), -1), (x,), (t,))
    assert tangent.dtype == F64, "tangent follows the output dtype"
    _assert_close(tangent, ref, "jvp with dtype=float64")


# ---- masked_softmax ------------------------------------------------------------------------------


def masked_ref(scores, mask, scale, dim):
    """masked_softmax written with aten._safe_softmax (differentiable in every mode)."""
    x = scores * scale
    if mask is not None:
        x = x.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else x + mask
    return aten_safe(x, dim)


def _masked_case(kind, seed=3):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, 4, 6, dtype=F64, generator=g)
    if kind == "bool":
        mask = torch.rand(2, 1, 4, 6, generator=g) > 0.4
        mask[0, 0, 1] = False  # a fully masked row
        mask[1, 0, 2, 0] = True
    elif kind == "float":
        mask = torch.randn(2, 1, 4, 6, dtype=F64, generator=g)
        mask[1, 0, 3] = NEG_INF  # a fully masked row
        mask[0, 0, 0, 2] = NEG_INF
    elif kind == "float_2d":
        mask = torch.randn(4, 6, dtype=F64, generator=g)
    else:
        mask = None
    return scores, mask


MASK_KINDS = ["bool", "float", "float_2d", "none"]


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masked_softmax_gradcheck_forward_and_reverse(kind):
    scores, mask = _masked_case(kind)
    scores.requires_grad_(True)
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_(True)
        inputs = (scores, mask)
        fn = lambda s, m: safeattn.masked_softmax(s, m, 0.7, dim=2)  # noqa: E731
    else:
        inputs = (scores,)
        fn = lambda s: safeattn.masked_softmax(s, mask, 0.7, dim=2)  # noqa: E731
    assert gradcheck(
        fn, inputs, check_forward_ad=True, check_batched_grad=True, check_batched_forward_grad=True
    )
    assert gradgradcheck(
        fn, inputs, check_fwd_over_rev=True, check_rev_over_rev=True, check_batched_grad=True
    )


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masked_softmax_jvp_grad_hessian_match_reference(kind):
    scores, mask = _masked_case(kind)
    float_mask = mask is not None and mask.is_floating_point()
    t_scores = torch.randn_like(scores)
    if float_mask:
        t_mask = torch.randn_like(mask)
        primals, tangents = (scores, mask), (t_scores, t_mask)

        def ours(s, m):
            return safeattn.masked_softmax(s, m, 0.7)

        def theirs(s, m):
            return masked_ref(s, m, 0.7, -1)
    else:
        primals, tangents = (scores,), (t_scores,)

        def ours(s):
            return safeattn.masked_softmax(s, mask, 0.7)

        def theirs(s):
            return masked_ref(s, mask, 0.7, -1)

    out, tangent = torch.func.jvp(ours, primals, tangents)
    out_ref, tangent_ref = torch.func.jvp(theirs, primals, tangents)
    _assert_close(out, out_ref, "masked_softmax primal")
    _assert_close(tangent, tangent_ref, "masked_softmax jvp")
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        tangent_api = fwAD.unpack_dual(ours(*duals)).tangent
    assert tangent_api is not None, "forward_ad: masked_softmax's output has no tangent"
    _assert_close(tangent_api, tangent_ref, "masked_softmax forward_ad")
    argnums = tuple(range(len(primals)))
    weights = torch.randn_like(out)
    grads = torch.func.grad(lambda *a: (ours(*a).pow(3) * weights).sum(), argnums=argnums)(*primals)
    grads_ref = torch.func.grad(lambda *a: (theirs(*a).pow(3) * weights).sum(), argnums=argnums)(*primals)
    for g, r, name in zip(grads, grads_ref, ("scores", "mask"), strict=False):
        _assert_close(g, r, f"torch.func.grad wrt {name}")
    # The Hessian on a slice (its size is the square of the input's).
    mask_small = mask[:1] if mask is not None and mask.dim() == 4 else mask
    small = (scores[:1, :2], mask_small) if float_mask else (scores[:1, :2],)

    def cube(fn):
        if float_mask:
            return lambda s, m: fn(s, m).pow(3).sum()
        return (
            lambda s: masked_ref(s, mask_small, 0.7, -1).pow(3).sum()
            if fn is theirs
            else (safeattn.masked_softmax(s, mask_small, 0.7).pow(3).sum())
        )

    hess = torch.func.hessian(cube(ours), argnums=argnums)(*small)
    hess_ref = torch.func.hessian(cube(theirs), argnums=argnums)(*small)
    for row, row_ref in zip(hess, hess_ref, strict=True):
        for h, r in zip(row, row_ref, strict=True):
            _assert_close(h, r, "masked_softmax hessian")


@pytest.mark.parametrize("batched", ["scores", "mask", "both"])
@pytest.mark.parametrize("kind", ["bool", "float", "float_2d"])
def test_masked_softmax_vmap_matches_loop(kind, batched):
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(3, 4, 6, dtype=F64, generator=g)
    if kind == "bool":
        mask = torch.rand(4, 6, generator=g) > 0.4
        mask[1] = False
    else:
        mask = torch.randn(4, 6, dtype=F64, generator=g)
        mask[2] = NEG_INF
        if kind == "float_2d":
            mask = mask[0]  # [6], broadcast over the rows
    n = 5
    scores_in = scores.unsqueeze(1).expand(3, n, 4, 6).clone() if batched != "mask" else scores
    mask_in = torch.stack([mask] * n, dim=-1) if batched != "scores" else mask
    if mask_in.is_floating_point() and batched != "scores":
        mask_in = mask_in + torch.randn(mask_in.shape, dtype=F64, generator=g)
    in_dims = (1 if batched != "mask" else None, -1 if batched != "scores" else None)
    got = torch.vmap(lambda s, m: safeattn.masked_softmax(s, m, 0.5, dim=1), in_dims=in_dims)(
        scores_in, mask_in
    )
    expected = torch.stack(
        [
            safeattn.masked_softmax(
                scores_in.select(1, i) if in_dims[0] is not None else scores_in,
                mask_in.select(-1, i) if in_dims[1] is not None else mask_in,
                0.5,
                dim=1,
            )
            for i in range(n)
        ]
    )
    _assert_close(got, expected, f"masked_softmax vmap ({kind} mask, {batched} batched)")


def test_masked_softmax_per_example_bias_gradients():
    # vmap over grad with a shared (unbatched) bias: each example gets its own bias gradient,
    # which needs the backward op's vmap rule to keep the batch dim of the mask gradient.
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 3, 5, dtype=F64, generator=g)  # 4 examples
    bias = torch.randn(5, dtype=F64, generator=g)
    weights = torch.randn(3, 5, dtype=F64, generator=g)

    def loss(s, b, fn):
        return (fn(s, b).pow(2) * weights).sum()

    ours = torch.vmap(
        torch.func.grad(lambda s, b: loss(s, b, lambda x, m: safeattn.masked_softmax(x, m)), argnums=1),
        in_dims=(0, None),
    )(scores, bias)
    theirs = torch.stack(
        [
            torch.func.grad(lambda b, s=s: loss(s, b, lambda x, m: masked_ref(x, m, 1.0, -1)))(bias)
            for s in scores
        ]
    )
    _assert_close(ours, theirs, "per-example bias gradients")
    jac = torch.func.jacrev(lambda b: safeattn.masked_softmax(scores, b), argnums=0)(bias)
    jac_ref = torch.func.jacrev(lambda b: masked_ref(scores, b, 1.0, -1))(bias)
    _assert_close(jac, jac_ref, "jacrev wrt a broadcast bias")


def test_masked_softmax_masked_elements_pass_no_nan():
    # NaN in a masked element's tangent or upstream gradient: the element's output is 0, so it
    # neither gets nor passes anything; the other elements are untouched.
    scores, mask = _masked_case("bool")
    t = torch.randn_like(scores).masked_fill(~mask, float("nan"))
    _, tangent = torch.func.jvp(lambda s: safeattn.masked_softmax(s, mask), (scores,), (t,))
    _, ref = torch.func.jvp(lambda s: masked_ref(s, mask, 1.0, -1), (scores,), (t.nan_to_num(0.0),))
    assert not tangent.isnan().any(), "NaN tangent of a masked element leaked"
    _assert_close(tangent, ref, "tangent with NaN on masked elements")
    assert (tangent[0, :, 1] == 0).all(), "fully masked row: tangent 0"
    upstream = torch.randn_like(scores).masked_fill(~mask, float("nan"))
    grad = torch.func.vjp(lambda s: safeattn.masked_softmax(s, mask), scores)[1](upstream)[0]
    assert not grad.isnan().any() and (grad[0, :, 1] == 0).all(), "NaN upstream gradient leaked"


def test_backward_ops_vmap_match_loop():
    g = torch.Generator().manual_seed(6)
    out = safeattn.safe_softmax(_masked_input((4, 3, 5), g), -1)
    grad = torch.randn(4, 3, 5, dtype=F64, generator=g)
    got = torch.vmap(lambda a, b: torch.ops.safeattn._safe_softmax_backward(a, b, 0, F64), in_dims=(0, 1))(
        grad, out.transpose(0, 1)
    )
    expected = torch.stack(
        [torch.ops.safeattn._safe_softmax_backward(a, b, 0, F64) for a, b in zip(grad, out, strict=True)]
    )
    _assert_close(got, expected, "_safe_softmax_backward vmap")
    bias = torch.randn(3, 1, dtype=F64, generator=g)
    op = torch.ops.safeattn._masked_softmax_backward
    for requires_grad in (True, False):
        got_s, got_m = torch.vmap(lambda a, b, r=requires_grad: op(a, b, bias, 0.5, -1, F64, r))(grad, out)
        loop = [op(a, b, bias, 0.5, -1, F64, requires_grad) for a, b in zip(grad, out, strict=True)]
        _assert_close(got_s, torch.stack([s for s, _ in loop]), "_masked_softmax_backward vmap: grad_scores")
        if requires_grad:
            _assert_close(
                got_m, torch.stack([m for _, m in loop]), "_masked_softmax_backward vmap: grad_mask"
            )
        else:
            assert got_m.numel() == 0, "no mask gradient asked: the placeholder stays empty"


def test_every_softmax_op_has_a_batching_rule():
    # Without one, vmap still gives the right values, through a loop of one op call per slice.
    for op in ("safe_softmax", "_safe_softmax_backward", "masked_softmax", "_masked_softmax_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(
            f"safeattn::{op}", "FuncTorchBatched"
        ), f"safeattn::{op} has no vmap rule"


def test_plain_calls_keep_the_fused_graph():
    # Outside transforms: one node per op (the fused kernels), as before.
    x = torch.randn(3, 5, requires_grad=True)
    out = safeattn.safe_softmax(x, -1)
    assert type(out.grad_fn).__name__ == "_SafeSoftmaxBackward", type(out.grad_fn).__name__
    with torch.no_grad():
        assert safeattn.safe_softmax(x, -1).grad_fn is None, "no graph without grad mode"


# ---- attention -----------------------------------------------------------------------------


def _attention_case(name, dtype=F64, seed=7):
    """(query, key, value, kwargs) for one configuration, small enough for float64 Hessians."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, dtype=F64, generator=g).to(dtype)

    b, hq, hkv, q_len, kv_len, d = 2, 2, 2, 3, 5, 4
    kwargs = {}
    if name == "gqa":
        hq, hkv = 4, 2
        kwargs["enable_gqa"] = True
    q, k, v = rand(b, hq, q_len, d), rand(b, hkv, kv_len, d), rand(b, hkv, kv_len, d + 1)
    if name == "bool_mask":
        mask = torch.rand(b, 1, q_len, kv_len, generator=g) > 0.4
        mask[0, 0, 1] = False  # a fully masked row
        mask[1, 0, 0, 0] = True
        kwargs["attn_mask"] = mask
    elif name == "bias":
        bias = rand(1, hq, q_len, kv_len)
        bias[0, 1, 2] = NEG_INF  # a fully masked row
        kwargs["attn_mask"] = bias
    elif name == "causal_offsets":
        kwargs.update(is_causal=True, q_offset=1, kv_offset=2)  # query 0 (position 1) sees no key
    elif name == "softcap_scale":
        kwargs.update(softcap=2.5, scale=0.9)
    elif name == "sinks":
        kwargs["sinks"] = rand(hq)
        kwargs.update(is_causal=True, kv_offset=1)  # row 0 sees no key, only the sink
    elif name == "key_ranges_bias":
        # Key ranges (drawn into the mask for the composite) with a bias that takes a gradient:
        # row 1 of batch 0 keeps no key, the others windows and ranges past the ends.
        ranges = torch.tensor([[[0, 2], [3, 3], [1, 9]], [[-2, 4], [2, 5], [0, 5]]], dtype=torch.int32)
        kwargs.update(key_ranges=ranges, attn_mask=rand(1, hq, q_len, kv_len))
    return q, k, v, kwargs


ATTENTION_CASES = [
    "plain",
    "gqa",
    "bool_mask",
    "bias",
    "causal_offsets",
    "softcap_scale",
    "sinks",
    "key_ranges_bias",
]
# The composite op itself takes no key ranges (attention draws them into the mask before it).
MATH_CASES = [name for name in ATTENTION_CASES if name != "key_ranges_bias"]


def _differentiable(kwargs):
    """The kwargs that are tensors with a gradient (a float bias, sinks)."""
    return [n for n in ("attn_mask", "sinks") if n in kwargs and kwargs[n].is_floating_point()]


def _call(fn, q, k, v, kwargs, extra):
    return fn(q, k, v, **dict(kwargs, **dict(zip(_differentiable(kwargs), extra, strict=True))))


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_func_grad_matches_reference_and_fused(name):
    q, k, v, kwargs = _attention_case(name)
    extra = [kwargs[n] for n in _differentiable(kwargs)]
    g = torch.Generator().manual_seed(8)
    w_out = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=F64, generator=g)
    w_lse = torch.randn(q.shape[:3], dtype=F64, generator=g)

    def loss(fn):
        def f(q, k, v, *extra):
            out, lse = _call(fn, q, k, v, kwargs, extra)
            # lse is -inf on empty rows: weigh only its finite entries.
            return (out * w_out).sum() + torch.where(lse.isfinite(), lse * w_lse, 0.0).sum()

        return f

    argnums = tuple(range(3 + len(extra)))
    primals = (q, k, v, *extra)
    grads = torch.func.grad(loss(safeattn.attention), argnums=argnums)(*primals)
    grads_ref = torch.func.grad(loss(reference.attention), argnums=argnums)(*primals)
    leaves = [p.clone().requires_grad_(True) for p in primals]
    grads_fused = torch.autograd.grad(loss(safeattn.attention)(*leaves), leaves)
    for i, (got, ref, fused) in enumerate(zip(grads, grads_ref, grads_fused, strict=True)):
        _assert_close(got, ref, f"{name}: torch.func.grad arg {i} vs reference")
        _assert_close(got, fused, f"{name}: torch.func.grad arg {i} vs the fused op's gradient")


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_jvp_matches_reference(name):
    q, k, v, kwargs = _attention_case(name)
    extra = [kwargs[n] for n in _differentiable(kwargs)]
    primals = (q, k, v, *extra)
    g = torch.Generator().manual_seed(9)
    tangents = tuple(torch.randn(p.shape, dtype=F64, generator=g) for p in primals)
    (out, lse), (t_out, t_lse) = torch.func.jvp(
        lambda *a: _call(safeattn.attention, *a[:3], kwargs, a[3:]), primals, tangents
    )
    (out_r, lse_r), (t_out_r, t_lse_r) = torch.func.jvp(
        lambda *a: _call(reference.attention, *a[:3], kwargs, a[3:]), primals, tangents
    )
    fused_out, fused_lse = _call(safeattn.attention, q, k, v, kwargs, extra)
    _assert_close(out, fused_out, f"{name}: composite out vs fused")
    _assert_close(lse, fused_lse, f"{name}: composite lse vs fused")
    _assert_close(out, out_r, f"{name}: out")
    _assert_close(t_out, t_out_r, f"{name}: out tangent")
    finite = lse_r.isfinite()
    _assert_close(t_lse[finite], t_lse_r[finite], f"{name}: lse tangent")
    assert (t_lse[~finite] == 0).all(), f"{name}: an empty row's lse tangent must be 0"
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        dual_out, _ = _call(safeattn.attention, *duals[:3], kwargs, duals[3:])
        api_tangent = fwAD.unpack_dual(dual_out).tangent
    assert api_tangent is not None, f"{name}: forward_ad gave no tangent"
    _assert_close(api_tangent, t_out_r, f"{name}: forward_ad out tangent")


def test_attention_jvp_matches_finite_differences():
    q, k, v, kwargs = _attention_case("bool_mask")
    g = torch.Generator().manual_seed(10)
    tq, tk, tv = (torch.randn(t.shape, dtype=F64, generator=g) for t in (q, k, v))
    eps = 1e-6

    def f(a, b, c):
        return safeattn.attention(a, b, c, **kwargs)[0]

    numeric = (f(q + eps * tq, k + eps * tk, v + eps * tv) - f(q - eps * tq, k - eps * tk, v - eps * tv)) / (
        2 * eps
    )
    _, tangent = torch.func.jvp(f, (q, k, v), (tq, tk, tv))
    _assert_close(tangent, numeric, "attention jvp vs central differences", atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("name", ["plain", "gqa", "bool_mask", "sinks"])
def test_attention_vmap_matches_loop(name):
    q, k, v, kwargs = _attention_case(name, dtype=torch.float32)
    n = 3
    g = torch.Generator().manual_seed(11)
    qs = torch.randn((n, *q.shape), generator=g)
    got_out, got_lse = torch.vmap(lambda a: safeattn.attention(a, k, v, **kwargs))(qs)
    loop = [safeattn.attention(a, k, v, **kwargs) for a in qs]
    _assert_close(got_out, torch.stack([o for o, _ in loop]), f"{name}: vmap out", atol=1e-5, rtol=1e-5)
    _assert_close(got_lse, torch.stack([s for _, s in loop]), f"{name}: vmap lse", atol=1e-5, rtol=1e-5)
    # Batched K and V too (in_dims on another dim), and per-example gradients.
    ks = torch.randn((k.shape[0], n, *k.shape[1:]), generator=g)
    got = torch.vmap(lambda a, b: safeattn.attention(a, b, v, **kwargs)[0], in_dims=(0, 1))(qs, ks)
    expected = torch.stack([safeattn.attention(a, ks[:, i], v, **kwargs)[0] for i, a in enumerate(qs)])
    _assert_close(got, expected, f"{name}: vmap over query and key", atol=1e-5, rtol=1e-5)
    per_example = torch.vmap(torch.func.grad(lambda a: safeattn.attention(a, k, v, **kwargs)[0].sum()))(qs)
    loop_grads = []
    for a in qs:
        a = a.clone().requires_grad_(True)
        safeattn.attention(a, k, v, **kwargs)[0].sum().backward()
        loop_grads.append(a.grad)
    _assert_close(per_example, torch.stack(loop_grads), f"{name}: vmap of grad", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MATH_CASES)
def test_attention_composite_gradcheck_and_gradgradcheck(name):
    q, k, v, kwargs = _attention_case(name)
    q, k, v = q[:1], k[:1], v[:1]  # one batch: finite differences of second order are costly
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = kwargs["attn_mask"][:1]
    names = _differentiable(kwargs)
    primals = tuple(t.clone().requires_grad_(True) for t in (q, k, v, *(kwargs[n] for n in names)))

    def fn(q, k, v, *extra):
        out, lse = _call(torch.ops.safeattn._attention_math, q, k, v, kwargs, extra)
        return out, torch.where(lse.isfinite(), lse, 0.0)  # -inf is not a number finite differences can use

    assert gradcheck(fn, primals, check_forward_ad=True, check_batched_grad=True)
    assert gradgradcheck(fn, primals, check_fwd_over_rev=True)


def test_attention_hessian_matches_reference():
    q, k, v, kwargs = _attention_case("bool_mask")
    q, k, v = q[:1, :1], k[:1, :1], v[:1, :1]
    kwargs = dict(kwargs, attn_mask=kwargs["attn_mask"][:1])

    def loss(fn):
        return lambda a, b: fn(a, b, v, **kwargs)[0].pow(2).sum()

    hess = torch.func.hessian(loss(safeattn.attention), argnums=(0, 1))(q, k)
    hess_ref = torch.func.hessian(loss(reference.attention), argnums=(0, 1))(q, k)
    for row, row_ref in zip(hess, hess_ref, strict=True):
        for h, r in zip(row, row_ref, strict=True):
            _assert_close(h, r, "attention hessian")
    assert (hess[0][0][0, 0, 1] == 0).all(), "a fully masked query row has zero second derivatives"


def test_attention_fully_masked_rows_are_zero_under_transforms():
    q, k, v, kwargs = _attention_case("bool_mask")
    mask = kwargs["attn_mask"]
    v = v.clone()
    v[0, :, mask[0, 0, 1].logical_not().nonzero()[0]] = float("nan")  # a value that row would read
    empty = (0, slice(None), 1)
    t = torch.randn_like(q)
    (out, lse), (t_out, t_lse) = torch.func.jvp(lambda a: safeattn.attention(a, k, v, **kwargs), (q,), (t,))
    assert (out[empty] == 0).all() and (lse[empty] == NEG_INF).all(), "empty row: out 0, lse -inf"
    assert (t_out[empty] == 0).all() and (t_lse[empty] == 0).all(), "empty row: tangents 0"
    # A NaN upstream gradient on the empty row stays out of every gradient.
    upstream = torch.randn_like(out)
    upstream[empty] = float("nan")
    vjp = torch.func.vjp(lambda a, b, c: safeattn.attention(a, b, c, **kwargs)[0], q, k, v.nan_to_num(0.0))[1]
    grad_q, grad_k, grad_v = vjp(upstream)
    assert (grad_q[empty] == 0).all(), "empty row: grad_q 0"
    for name, grad in (("grad_q", grad_q), ("grad_k", grad_k), ("grad_v", grad_v)):
        assert not grad.isnan().any(), f"NaN upstream gradient on an empty row leaked into {name}"


def test_attention_composite_matches_fused_in_low_precision():
    for name in MATH_CASES:
        q, k, v, kwargs = _attention_case(name, dtype=torch.bfloat16)
        kwargs = {
            n: (t.to(torch.float32) if n == "attn_mask" and t.is_floating_point() else t)
            for n, t in kwargs.items()
        }
        out, lse = torch.ops.safeattn._attention_math(q, k, v, **kwargs)
        fused_out, fused_lse = torch.ops.safeattn.attention(q, k, v, **kwargs)
        assert (
            out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        ), f"{name}: dtypes {out.dtype}, {lse.dtype}"
        _assert_close(out.float(), fused_out.float(), f"{name}: bf16 out", atol=2e-2, rtol=2e-2)
        _assert_close(lse, fused_lse, f"{name}: bf16 lse", atol=1e-4, rtol=1e-4)


def test_attention_composite_checks_arguments_as_the_op():
    q, k, v, _ = _attention_case("plain", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="dropout_p must be 0"):
        torch.ops.safeattn._attention_math(q, k, v, dropout_p=0.5)
    with pytest.raises(RuntimeError, match="key has head_dim 3 but query has 4"):
        torch.ops.safeattn._attention_math(q, k[..., :3], v)
    with pytest.raises(RuntimeError, match="pass enable_gqa=True"):
        torch.func.grad(lambda a: safeattn.attention(a, k[:, :1], v[:, :1])[0].sum())(q)


def test_attention_direct_op_under_transforms_matches_the_wrapper():
    # torch.ops.safeattn.attention (what Transformers' drop-in calls) routes itself to the
    # composite under a transform or with a dual input: the same values as safeattn.attention,
    # never an error or a zero tangent.
    q, k, v, _ = _attention_case("plain")
    tangent = torch.randn_like(q)
    got = torch.func.grad(lambda a: torch.ops.safeattn.attention(a, k, v)[0].sum())(q)
    want = torch.func.grad(lambda a: safeattn.attention(a, k, v)[0].sum())(q)
    torch.testing.assert_close(got, want)
    _, got_t = torch.func.jvp(lambda a: torch.ops.safeattn.attention(a, k, v)[0], (q,), (tangent,))
    _, want_t = torch.func.jvp(lambda a: safeattn.attention(a, k, v)[0], (q,), (tangent,))
    torch.testing.assert_close(got_t, want_t)
    assert got_t.abs().max() > 0, "a zero tangent"
    with fwAD.dual_level():
        out, _ = torch.ops.safeattn.attention(fwAD.make_dual(q, tangent), k, v)
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, want_t)


def test_attention_outside_transforms_keeps_the_fused_op():
    q, k, v, _ = _attention_case("plain", dtype=torch.float32)
    q.requires_grad_(True)
    out, _ = safeattn.attention(q, k, v)
    assert "AttentionFunction" in out.grad_fn.name(), out.grad_fn.name()
    assert out.transpose(1, 2).is_contiguous(), "the fused op's [B, Q, H, D] storage"
    # Double backward through the fused kernels is not supported: a clear error, not a zero.
    (grad,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="_attention_backward is not implemented"):
        grad.sum().backward()
    # A dual level with no dual input keeps the fused op as well.
    with fwAD.dual_level():
        out, _ = safeattn.attention(q.detach(), k, v)
    assert out.transpose(1, 2).is_contiguous(), "fused op inside a dual level without dual inputs"
