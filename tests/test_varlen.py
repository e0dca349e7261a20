"""safeattn.varlen_attention (and flash_attn_interface's flash_attn_varlen_func / flash_attn_func)
against reference.varlen_attention (reference.attention on each sequence alone, float64), plus
the safe semantics, gradients, gradcheck, torch.compile and argument checks.

Tolerance: FlashAttention's rule (tests/_serving_cases.py, as tests/test_attention.py).
"""

from __future__ import annotations

import re

import pytest
import safeattn
import torch
from _serving_cases import DTYPES, compare_grads, compare_outputs, low_dtype
from conftest import ATTENTION_DEVICES as DEVICES
from safeattn import reference
from safeattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _packed(q_lengths, k_lengths, hq, hkv, head_dim, dtype, device, *, dv=None, seed=0, grad=True):
    """Packed q [total_q, Hq, D], k, v [total_k, Hkv, D|Dv] (leaves) and their cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    dv = head_dim if dv is None else dv

    def make(total, heads, dim):
        return (
            torch.randn(total, heads, dim, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)
        )

    total_q, total_k = sum(q_lengths), sum(k_lengths)
    return (
        make(total_q, hq, head_dim),
        make(total_k, hkv, head_dim),
        make(total_k, hkv, dv),
        _cu(q_lengths, device),
        _cu(k_lengths, device),
    )


def _check(q, k, v, cu_q, cu_k, *, grads=True, sinks=None, **kwargs):
    dtype = q.dtype
    got = safeattn.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True, **kwargs)
    assert got[0].is_contiguous(), "out must be contiguous [total_q, Hq, Dv]"
    assert got[1].shape == (q.shape[1], q.shape[0]), "lse must be [Hq, total_q]"
    ref = reference.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, **kwargs)
    low = reference.varlen_attention(
        q, k, v, cu_q, cu_k, sinks=sinks, compute_dtype=low_dtype(dtype), **kwargs
    )
    compare_outputs(dtype, got, ref, low)
    if grads:
        inputs = [q, k, v] + ([sinks] if sinks is not None else [])
        names = ["grad_q", "grad_k", "grad_v", "grad_sinks"][: len(inputs)]
        compare_grads(dtype, names, inputs, got[0], ref[0], low[0])
    return got


# (q lengths, k lengths): length-0 and length-1 sequences, queries longer than keys (causal rows
# that see nothing), a sequence with queries and no keys, one long sequence over several tiles.
LENGTHS = [
    ([3, 0, 1, 17, 5], [3, 2, 1, 17, 9]),
    ([1, 1, 1], [1, 40, 7]),
    ([6, 2], [2, 0]),
    ([130, 1, 33], [200, 1, 70]),
]
# (window_size, causal)
MASKS = [
    ((-1, -1), False),
    ((-1, -1), True),
    ((2, 0), True),
    ((3, 1), False),
    ((-1, 2), False),
    ((0, 0), False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("q_lengths", "k_lengths"), LENGTHS)
@pytest.mark.parametrize(("window_size", "causal"), MASKS)
def test_matches_reference(device, q_lengths, k_lengths, window_size, causal):
    q, k, v, cu_q, cu_k = _packed(q_lengths, k_lengths, 4, 2, 40, torch.float32, device)
    _check(q, k, v, cu_q, cu_k, causal=causal, window_size=window_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "dv"), [(2, 2, 64, 64), (8, 1, 64, 32), (4, 2, 128, 128)])
def test_dtypes_gqa_softcap_sinks(device, dtype, hq, hkv, head_dim, dv):
    q, k, v, cu_q, cu_k = _packed([5, 0, 17, 1], [9, 3, 17, 0], hq, hkv, head_dim, dtype, device, dv=dv)
    sinks = torch.randn(hq, device=device, requires_grad=True)
    _check(q, k, v, cu_q, cu_k, causal=True, softcap=4.0, sinks=sinks)
    _check(q, k, v, cu_q, cu_k, window_size=(3, 2), scale=0.2)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows_are_zero_with_zero_gradient(device):
    # Sequence 0: 6 queries, 2 keys, causal: rows 0-3 see no key. Sequence 1: no keys at all.
    q, k, v, cu_q, cu_k = _packed([6, 3], [2, 0], 2, 2, 16, torch.float32, device)
    out, lse = safeattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    empty = torch.tensor([0, 1, 2, 3, 6, 7, 8])
    assert torch.all(out[empty] == 0), "rows that see no key must give 0"
    assert torch.all(lse[:, empty].isneginf()), "rows that see no key must give lse -inf"
    assert torch.all(out[[4, 5]] != 0), "rows that see keys must not be 0"
    (grad_q,) = torch.autograd.grad(out.sum(), q)
    assert torch.all(grad_q[empty] == 0) and not grad_q.isnan().any(), "empty rows must pass 0 gradient"


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens(device):
    q, k, v, cu_q, cu_k = _packed([0, 0], [0, 4], 2, 2, 16, torch.float32, device)
    out, lse = safeattn.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0), "no queries: empty outputs"
    q1 = torch.randn(3, 2, 16, device=device)
    none = torch.zeros(1, dtype=torch.int32, device=device)  # zero sequences
    out = safeattn.varlen_attention(q1, k.detach(), v.detach(), none, none)
    assert torch.all(out == 0), "tokens in no sequence give 0"


@pytest.mark.parametrize("device", DEVICES)
def test_nan_outside_the_sequences_never_leaks(request, device):
    if device == "cuda":
        # The key rows past the last sequence share key tiles with its keys, where the CUDA
        # kernels multiply P = 0 by V (test_attention.py's test_cuda_mask_tile_summary): runs, and
        # says XPASS once a kernel bounds its keys by the ranges.
        request.applymarker(
            pytest.mark.xfail(
                reason="CUDA kernels multiply P = 0 by masked V inside mixed tiles", strict=False
            )
        )
    # Keys past cu_seqlens_k[-1] and key rows of other sequences hold NaN; queries past
    # cu_seqlens_q[-1] (padding tokens, as an engine's static buffers have) see no key.
    q, k, v, cu_q, cu_k = _packed([4, 0, 9], [6, 3, 9], 4, 2, 32, torch.float32, device, grad=False)
    k_big = torch.cat((k, torch.full((5, 2, 32), float("nan"), device=device)))
    v_big = torch.cat((v, torch.full((5, 2, 32), float("nan"), device=device)))
    q_big = torch.cat((q, torch.full((2, 4, 32), float("nan"), device=device)))
    out, lse = safeattn.varlen_attention(q_big, k_big, v_big, cu_q, cu_k, causal=True, return_lse=True)
    want = safeattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert not out[:13].isnan().any() and not lse[:, :13].isnan().any(), "NaN outside the sequences leaked"
    torch.testing.assert_close(out[:13], want, msg="padding changed the sequences' output")
    # A NaN key inside sequence 0 reaches only the rows of sequence 0 that see it.
    k_nan = k.clone()
    k_nan[7, 1] = float("nan")  # sequence 1's keys 6..8 have no query; sequence 2's start at 9
    k_nan[2, 0] = float("nan")  # sequence 0, key 2: seen by its rows 0.. (keys j <= i + 2)
    out = safeattn.varlen_attention(q, k_nan, v, cu_q, cu_k, causal=True)
    assert out[:4, :2].isnan().all(), "a NaN key must reach the rows that see it"
    assert not out[4:].isnan().any(), "a NaN key must stay in its own sequence"


@pytest.mark.parametrize("device", DEVICES)
def test_bad_cu_seqlens_never_read_outside(device):
    # Not checked (a host sync): decreasing, not starting at 0, ending past the token counts.
    # The result is documented (in-bounds ranges); nothing outside k is read, nothing raises.
    q, k, v, _, _ = _packed([8], [8], 2, 2, 16, torch.float32, device, grad=False)
    cases = [
        ([0, 5, 3, 8], [0, 2, 9, 8]),
        ([2, 4, 8, 8], [0, 4, 4, 100]),
        ([0, 8, 20, 30], [-5, 3, 8, 8]),
    ]
    for cq, ck in cases:
        cu_q = torch.tensor(cq, dtype=torch.int32, device=device)
        cu_k = torch.tensor(ck, dtype=torch.int32, device=device)
        ranges = safeattn.serving.varlen_key_ranges(cu_q, cu_k, 8, 8, True)
        assert ranges.min() >= 0 and ranges.max() <= 8, f"ranges outside [0, total_k] for {cq}, {ck}"
        out = safeattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
        assert out.shape == q.shape and not out.isnan().any(), f"bad cu_seqlens {cq}, {ck}"


@pytest.mark.parametrize("device", DEVICES)
def test_key_ranges_are_flash_semantics(device):
    # The ranges themselves, against flash_visible's dense mask, on sequences with every
    # relation of Lq and Lk.
    q_lengths, k_lengths = [3, 0, 1, 5, 4], [5, 2, 0, 2, 4]
    cu_q, cu_k = _cu(q_lengths, device), _cu(k_lengths, device)
    for window, causal in MASKS + [((1, 1), True), ((0, -1), False)]:
        ranges = safeattn.serving.varlen_key_ranges(cu_q, cu_k, 13, 13, causal, window)[0].cpu()
        keys = torch.arange(13)
        drawn = (keys >= ranges[:, :1]) & (keys < ranges[:, 1:])
        want = torch.zeros(13, 13, dtype=torch.bool)
        for s in range(len(q_lengths)):
            qs, ks = int(cu_q[s]), int(cu_k[s])
            visible = reference.flash_visible(q_lengths[s], k_lengths[s], causal, window)
            want[qs : qs + q_lengths[s], ks : ks + k_lengths[s]] = visible
        assert torch.equal(
            drawn, want
        ), f"key ranges differ from FlashAttention's mask for {window}, {causal}"


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_and_strided_inputs(device):
    # Packed tensors as views of a wider buffer (Transformers passes q.transpose(1, 2).squeeze(0)).
    q, k, v, cu_q, cu_k = _packed([7, 3], [9, 3], 4, 2, 32, torch.float32, device, grad=False)
    wide_q = torch.zeros(4, 10, 48, device=device)
    wide_q[:, :, 8:40] = q.transpose(0, 1)
    q_view = wide_q[:, :, 8:40].transpose(0, 1).requires_grad_(False)
    got = safeattn.varlen_attention(q_view, k, v, cu_q, cu_k, causal=True)
    want = safeattn.varlen_attention(q.contiguous(), k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(got, want, msg="a strided q view gives another result")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_varlen_func(device):
    q, k, v, cu_q, cu_k = _packed([5, 2], [8, 2], 4, 2, 32, torch.float32, device, grad=False)
    sinks = torch.randn(4, device=device)
    out = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 5, 8, softmax_scale=0.3, causal=True, window_size=(3, 0), s_aux=sinks
    )
    want = safeattn.varlen_attention(
        q, k, v, cu_q, cu_k, scale=0.3, causal=True, window_size=(3, 0), sinks=sinks
    )
    torch.testing.assert_close(out, want, msg="flash_attn_varlen_func differs from varlen_attention")
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 8, return_attn_probs=True)
    assert lse.shape == (4, 7) and probs is None, "return_attn_probs gives (out, lse [Hq, total_q], None)"
    with pytest.raises(NotImplementedError, match="dropout_p is not implemented"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 8, dropout_p=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("window_size", "causal"), [((-1, -1), False), ((-1, -1), True), ((2, 0), True), ((1, 3), False)]
)
@pytest.mark.parametrize(("q_len", "k_len"), [(5, 9), (9, 5), (1, 17)])
def test_flash_attn_func(device, window_size, causal, q_len, k_len):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_len, 4, 32, generator=gen).to(device).requires_grad_()
    k = torch.randn(2, k_len, 2, 32, generator=gen).to(device).requires_grad_()
    v = torch.randn(2, k_len, 2, 32, generator=gen).to(device).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_attn_probs=True)
    assert out.shape == (2, q_len, 4, 32) and lse.shape == (2, 4, q_len)
    # The same as the packed batch of two sequences.
    cu_q = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, k_len, 2 * k_len], dtype=torch.int32, device=device)
    ref, ref_lse = reference.varlen_attention(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, causal=causal, window_size=window_size
    )
    low = reference.varlen_attention(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        cu_q,
        cu_k,
        causal=causal,
        window_size=window_size,
        compute_dtype=torch.float32,
    )
    got = (out.flatten(0, 1), lse.transpose(0, 1).flatten(1, 2))
    compare_outputs(torch.float32, got, (ref, ref_lse), low)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_gradcheck(device):
    q, k, v, cu_q, cu_k = _packed([3, 0, 2, 1], [4, 1, 2, 0], 4, 2, 8, torch.float64, device)
    sinks = torch.randn(4, dtype=torch.float64, device=device, requires_grad=True)

    def fn(q, k, v, sinks):
        out, lse = safeattn.varlen_attention(
            q, k, v, cu_q, cu_k, causal=True, window_size=(2, 0), softcap=3.0, sinks=sinks, return_lse=True
        )
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks), eps=1e-6, atol=1e-5)

    def no_sinks(q, k, v):
        out, lse = safeattn.varlen_attention(q, k, v, cu_q, cu_k, window_size=(1, 1), return_lse=True)
        return out, torch.where(lse.isfinite(), lse, 0.0)

    assert torch.autograd.gradcheck(no_sinks, (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_compile_fullgraph_dynamic(device):
    # Symbolic token counts; the cumulative lengths are data. No graph break, eager's values and
    # gradients at two sizes.
    def fn(q, k, v, cu_q, cu_k, sinks):
        out = safeattn.varlen_attention(
            q, k, v, cu_q, cu_k, 0, 0, causal=True, window_size=(4, 0), softcap=8.0, sinks=sinks
        )
        return out.float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for q_lengths, k_lengths in (([3, 0, 6], [5, 2, 6]), ([7, 1, 2, 4], [7, 9, 2, 0])):
        q, k, v, cu_q, cu_k = _packed(q_lengths, k_lengths, 4, 2, 32, torch.float32, device)
        sinks = torch.randn(4, device=device, requires_grad=True)
        args = (q, k, v, cu_q, cu_k, sinks)
        want = fn(*args)
        want_grads = torch.autograd.grad(want, (q, k, v, sinks))
        got = compiled(*args)
        got_grads = torch.autograd.grad(got, (q, k, v, sinks))
        torch.testing.assert_close(got, want, msg="compiled forward differs from eager")
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, msg="compiled backward differs from eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (host sync is a device matter)")
def test_cuda_no_host_sync():
    q, k, v, cu_q, cu_k = _packed([5, 0, 9], [7, 2, 9], 4, 2, 64, torch.bfloat16, "cuda", grad=False)
    safeattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True)  # warm-up (lazy inits may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        safeattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True, window_size=(3, 0))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_long_sequences(dtype, head_dim):
    # Several key tiles per sequence and sequence boundaries inside tiles (the sm_90a kernels skip
    # the tiles outside each row's range).
    q, k, v, cu_q, cu_k = _packed([300, 1, 0, 517], [700, 64, 5, 517], 8, 2, head_dim, dtype, "cuda")
    _check(q, k, v, cu_q, cu_k, causal=True)
    _check(q, k, v, cu_q, cu_k, window_size=(100, 0), causal=True, grads=False)


def _bad_inputs():
    q, k, v = torch.randn(6, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 7], dtype=torch.int32)
    return [
        ((q[0], k, v, cu, cu_k), {}, "varlen_attention: q must be 3-D"),
        ((q, k[None], v, cu, cu_k), {}, "varlen_attention: k must be 3-D"),
        ((q.long(), k, v, cu, cu_k), {}, "varlen_attention: q must have dtype float32"),
        (
            (q, k.half(), v, cu, cu_k),
            {},
            "varlen_attention: k has dtype torch.float16 but q has torch.float32",
        ),
        ((q, k, v[:5], cu, cu_k), {}, "varlen_attention: v must be"),
        ((q, k, v, cu.float(), cu_k), {}, "varlen_attention: cu_seqlens_q must have dtype int32"),
        ((q, k, v, cu, cu_k[None]), {}, "varlen_attention: cu_seqlens_k must be 1-D"),
        (
            (q, k, v, cu, torch.tensor([0, 3, 7], dtype=torch.int32)),
            {},
            "cu_seqlens_k has 3 entries but cu_seqlens_q has 2",
        ),
        ((q, k, v, cu, cu_k), {"window_size": (-2, 0)}, re.escape("window_size entries must be >= 0, or -1")),
        ((q, k, v, cu, cu_k), {"window_size": 3}, "window_size must be a pair"),
    ]


@pytest.mark.parametrize(("args", "kwargs", "message"), _bad_inputs())
def test_bad_inputs(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        safeattn.varlen_attention(*args, **kwargs)


def test_gqa_heads_must_divide():
    q, k, v = torch.randn(6, 4, 8), torch.randn(7, 3, 8), torch.randn(7, 3, 8)
    cu, cu_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=re.escape("query heads (4) must be a multiple")):
        safeattn.varlen_attention(q, k, v, cu, cu_k)
