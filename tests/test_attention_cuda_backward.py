"""The CUDA backward of safeattn.attention (csrc/ops/cuda/attention_bwd_kernel.cu, its kernels in
generic/ and hopper/) against the float64 reference, on the cases its tensor-core kernels have to
get right: every instantiated head dim x dtype, partial tiles (1, 17, 97, 1025), causal in both
alignments, GQA, masks broadcast over batch / heads, bool masks with fully masked rows, structured
masks whose tiles are skipped or fast-pathed, softcap, sinks, determinism, the two dQ modes
(atomics in the dK/dV kernel by default; the deterministic dQ kernel under
torch.use_deterministic_algorithms(True) or with a mask gradient), the sm_90a kernel (taken on an
H100/H200 in the atomic mode where it covers the call: bf16/fp16, D 64, 96 and 128, no mask, a bool
or a float one (its gradient when the mask is full-size in Q and KV: per element, or summed in
the kernel over a broadcast batch or head dim; not with a softcap), key ranges, softcap, sinks
(and its forward at D 256, whose backward is the generic one); the mma.sync kernels take
everything else, so the cases with softcapped learnable biases, biases broadcast over queries or
keys, and other head dims test them), and the generic path (float32, head dims without an
instantiation, D != Dv, unaligned views).

Tolerance: the rule of tests/test_attention.py (at most 3x PyTorch's own low-precision error
for gradients), through its helper.
"""

from __future__ import annotations

import pytest
import safeattn
import torch
from conftest import cuda_kernel_names
from safeattn import reference
from test_attention import FLOOR, _check_against_reference, _compare, _qkv, _random_key_ranges

_OPS = ("safeattn::attention", "safeattn::_attention_backward")
_HAS_KERNELS = all(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in _OPS)
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _HAS_KERNELS),
    reason="needs a CUDA GPU and both CUDA attention kernels (forward and _attention_backward) registered",
)

DEVICE = "cuda"
# Head dims with tensor-core backward kernels (csrc/ops/cuda/generic/instances/
# attention_bwd_d<D>_<dtype>.cu); a build with SAFEATTN_ATTN_HEAD_DIMS runs the others on the
# generic path, still correct.
TENSOR_CORE_HEAD_DIMS = [32, 64, 96, 128]
# Head dims of the sm_90a kernels, both ways (scripts/gen_attention_instances.py); 256's tiles
# are 64 keys (its own forward test below).
SM90_HEAD_DIMS = [64, 96, 128, 256]
LOW_DTYPES = [torch.bfloat16, torch.float16]

# (q_len, kv_len, causal): partial tiles on both sides, both causal alignments.
SHAPES = [
    (1, 1025, None),
    (17, 97, "top_left"),
    (97, 17, "bottom_right"),
    (97, 1025, "bottom_right"),
    (1025, 97, None),
    (1025, 1025, "top_left"),
]


def _causal_kwargs(causal, q_len, kv_len):
    if causal is None:
        return {}
    return {"is_causal": True, "q_offset": kv_len - q_len if causal == "bottom_right" else 0}


@pytest.fixture(params=["atomic", "kernel"])
def dq_mode(request):
    """The backward's dQ mode: atomics in the dK/dV kernel (the default while deterministic
    algorithms are off and no mask gradient is needed) or the dQ kernel (deterministic algorithms
    on); the setting is restored after the test."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(request.param == "kernel")
    yield request.param
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", TENSOR_CORE_HEAD_DIMS)
@pytest.mark.parametrize(("q_len", "kv_len", "causal"), SHAPES)
def test_tensor_core_matches_reference(dq_mode, head_dim, dtype, q_len, kv_len, causal):
    q, k, v = _qkv(1, 4, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim + q_len)
    _check_against_reference(q, k, v, enable_gqa=True, **_causal_kwargs(causal, q_len, kv_len))


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_gqa_groups(group, causal):
    q, k, v = _qkv(2, 2 * group, 2, 130, 200, 128, torch.bfloat16, DEVICE)
    _check_against_reference(q, k, v, enable_gqa=group != 1, **_causal_kwargs(causal, 130, 200))


@pytest.mark.parametrize("offsets", [(0, 0), (50, 0), (0, 30), (1000, 990)])
def test_causal_offsets(offsets):
    # kv_offset > q_offset hides whole key tiles from the first queries (fully masked rows).
    q_offset, kv_offset = offsets
    q, k, v = _qkv(1, 2, 2, 97, 160, 64, torch.float16, DEVICE)
    _check_against_reference(q, k, v, is_causal=True, q_offset=q_offset, kv_offset=kv_offset)


@pytest.mark.parametrize(
    "bias_shape",
    [
        (1, 4, 97, 130),
        (2, 1, 97, 130),
        (1, 1, 97, 130),
        (97, 130),
        (2, 4, 97, 130),
        (2, 4, 1, 130),
        (2, 4, 97, 1),
        (4, 97, 130),
    ],
)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_learnable_bias_gradient(bias_shape, bias_dtype, causal, kv_heads):
    # [2, 4, 97, 130] takes the assign path (the partial is the gradient). The full-size ones
    # broadcast over the batch, the heads or both ([1, 4], [2, 1], [1, 1] x Q x KV, and the 2-D and
    # 3-D ones, read as [1, 1] and [1, 4]) are summed in the sm_90a kernel with atomics into a
    # buffer of the bias's shape (with GQA a head-shared bias sums all 4 query heads, not the 2 kv
    # groups). Those broadcast over queries or keys go through the staging buffer and its
    # reductions (batch, GQA group, size-1 query / key dims).
    q, k, v = _qkv(2, 4, kv_heads, 97, 130, 64, torch.bfloat16, DEVICE)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(bias_shape, generator=gen).to(device=DEVICE, dtype=bias_dtype)
    if bias_shape[-1] > 1:
        bias[..., 3] = float("-inf")  # a masked column: gradient 0 there
    bias.requires_grad_()
    _check_against_reference(
        q, k, v, attn_mask=bias, enable_gqa=True, is_causal=causal, extra_grad_inputs=(bias,)
    )
    out, _ = safeattn.attention(q, k, v, attn_mask=bias, enable_gqa=True, is_causal=causal)
    (grad_bias,) = torch.autograd.grad(out.float().square().sum(), (bias,))
    if bias_shape[-1] > 1:
        assert torch.all(grad_bias[..., 3] == 0), "the gradient of a -inf bias element must be 0"


@pytest.mark.parametrize("bias_shape", [(1, 4, 97, 136), (2, 1, 97, 136), (1, 1, 97, 136), (2, 4, 97, 136)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_learnable_bias_gradient_tma_tiles(bias_shape, head_dim, causal, kv_heads):
    """A bf16 bias with 16-byte aligned rows (136 keys) comes to the sm_90a backward as TMA tiles
    in Q's stages, read transposed from shared memory (at head dim 128 beside one dQ stage buffer,
    not two); the test above (130 keys) has it gathered. Rows past q_len, the partial last key
    tile, a -inf column, the sums over a shared batch or head dim, and GQA."""
    q, k, v = _qkv(2, 4, kv_heads, 97, 136, head_dim, torch.bfloat16, DEVICE)
    gen = torch.Generator().manual_seed(9)
    bias = torch.randn(bias_shape, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    bias[..., 3] = float("-inf")
    bias.requires_grad_()
    _check_against_reference(
        q, k, v, attn_mask=bias, enable_gqa=True, is_causal=causal, extra_grad_inputs=(bias,)
    )
    out, _ = safeattn.attention(q, k, v, attn_mask=bias, enable_gqa=True, is_causal=causal)
    (grad_bias,) = torch.autograd.grad(out.float().square().sum(), (bias,))
    assert torch.all(grad_bias[..., 3] == 0), "the gradient of a -inf bias element must be 0"


@pytest.mark.parametrize("bias_shape", [(1, 4, 97, 130), (2, 1, 97, 130), (1, 1, 97, 130)])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_learnable_bias_gradient_deterministic(bias_shape, kv_heads):
    """Under deterministic algorithms a bias broadcast over the batch or the heads is not summed
    with atomics in the kernel: its gradient comes per (batch row, head) and is summed in order,
    bit-identical from call to call."""
    q, k, v = _qkv(2, 4, kv_heads, 97, 130, 64, torch.bfloat16, DEVICE)
    gen = torch.Generator().manual_seed(6)
    bias = torch.randn(bias_shape, generator=gen).to(DEVICE).requires_grad_()
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _check_against_reference(
            q, k, v, attn_mask=bias, enable_gqa=True, is_causal=True, extra_grad_inputs=(bias,)
        )
        grads = []
        for _ in range(2):
            out, _ = safeattn.attention(q, k, v, attn_mask=bias, enable_gqa=True, is_causal=True)
            grads.append(torch.autograd.grad(out.float().square().sum(), (bias,))[0])
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    assert torch.equal(
        grads[0], grads[1]
    ), f"{bias_shape}: the deterministic bias gradient differs between calls"


@pytest.mark.parametrize("batch", [5, 1])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_learnable_bias_gradient_in_its_own_shape(batch, bias_dtype, head_dim, causal):
    """A learnable bias with an element for every (batch row, query head) ([B, H, Q, KV], or
    [1, H, Q, KV] at batch 1) has its gradient written by the sm_90a backward in the bias's own
    shape and dtype, each element once (GradMaskWrite::kOwnShape): several query and key tiles,
    partial last tiles, GQA, a -inf column and a fully -inf block of tiles (never visited: its
    gradient must be 0 from the caller's zeros), bit-identical from call to call."""
    heads, q_len, kv_len = 4, 200, 300
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, torch.bfloat16, DEVICE, seed=head_dim + 3)
    gen = torch.Generator().manual_seed(13)
    bias = torch.randn(batch, heads, q_len, kv_len, generator=gen)
    bias[..., 3] = float("-inf")
    bias[:, :, :128, 128:256] = float("-inf")  # whole tiles masked: skipped
    bias = bias.to(DEVICE, bias_dtype).requires_grad_()
    kwargs = {"enable_gqa": True, "is_causal": causal, "q_offset": kv_len - q_len if causal else 0}
    _check_against_reference(q, k, v, attn_mask=bias, extra_grad_inputs=(bias,), **kwargs)
    grads = []
    for _ in range(2):
        out, _ = safeattn.attention(q, k, v, attn_mask=bias, **kwargs)
        grads.append(torch.autograd.grad(out.float().square().sum(), (bias,))[0])
    assert grads[0].dtype == bias_dtype and grads[0].shape == bias.shape
    assert torch.all(grads[0][:, :, :128, 128:256] == 0), "a skipped tile's gradient must be 0"
    assert torch.all(grads[0][..., 3] == 0), "the gradient of a -inf bias element must be 0"
    assert torch.equal(grads[0], grads[1]), "the bias gradient differs between calls"


@pytest.mark.parametrize("bias_shape", [(3, 4, 300, 520), (1, 4, 300, 520)], ids=["BH", "1H"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_learnable_bias_summarised_without_its_values(bias_shape, head_dim, causal):
    """A bias that requires grad is summarised by causality alone (its values unread: every tile
    mixed) in the sm_90a forward and backward; the same values without requires_grad are read
    into the summary (-inf tiles skipped, zero tiles added as nothing). Both routes against the
    reference, and against each other: -inf tiles, zero tiles, rows that see no key (an all -inf
    query tile), partial tiles."""
    batch, heads, q_len, kv_len = 3, 4, 300, 520
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, torch.bfloat16, DEVICE, seed=head_dim + 29)
    gen = torch.Generator().manual_seed(17)
    bias = torch.randn(bias_shape, generator=gen)
    bias[..., :, 128:256] = float("-inf")  # whole key tiles masked
    bias[..., 128:192, 256:384] = 0.0  # whole tiles of zeros
    bias[..., 192:256, :] = float("-inf")  # a query tile of rows that see nothing
    bias = bias.to(DEVICE, torch.bfloat16)
    kwargs = {"enable_gqa": True, "is_causal": causal, "q_offset": kv_len - q_len if causal else 0}
    learnable = bias.clone().requires_grad_()
    out, lse = _check_against_reference(
        q, k, v, attn_mask=learnable, extra_grad_inputs=(learnable,), **kwargs
    )
    with torch.no_grad():
        read_out, read_lse = safeattn.attention(q, k, v, attn_mask=bias, **kwargs)
    torch.testing.assert_close(out, read_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, read_lse, atol=1e-4, rtol=1e-4)
    assert torch.all(out[:, :, 192:256] == 0) and torch.all(
        lse[:, :, 192:256].isneginf()
    ), "rows that see nothing"


def _structured_allowed(batch, q_len, kv_len):
    """[batch, 1, Q, KV] bool: causal, documents of 130 tokens, batch 1 left-padded by 70 keys.

    At these lengths the backward's tile summaries hold every class: tiles above the diagonal,
    across documents or in the padding are fully masked (skipped), tiles inside a document below
    the diagonal are all visible (no per-element test), and tiles on the diagonal, the document
    borders, the padding edge and the sequence ends are mixed.
    """
    i = torch.arange(q_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    allowed = (j <= i) & (i // 130 == j // 130)
    allowed = allowed.expand(batch, 1, q_len, kv_len).clone()
    allowed[1, :, :, :70] = False
    return allowed


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask_kind", ["bool", "bias_full", "bias_broadcast"])
def test_structured_mask_tiles(head_dim, mask_kind):
    # bias_full ([B, Hq, Q, KV] float32) takes the mask-gradient assign path, bias_broadcast
    # ([B, 1, Q, KV]) the staging buffer: in both, skipped tiles must get an exact 0 gradient.
    q_len = kv_len = 300
    q, k, v = _qkv(2, 4, 2, q_len, kv_len, head_dim, torch.bfloat16, DEVICE, seed=head_dim)
    allowed = _structured_allowed(2, q_len, kv_len)
    if mask_kind == "bool":
        _check_against_reference(q, k, v, attn_mask=allowed.to(DEVICE), enable_gqa=True, check_lse_grad=True)
        return
    if mask_kind == "bias_full":
        allowed = allowed.expand(2, 4, q_len, kv_len)
    # 0 where allowed: tiles the summary calls all visible exist for a float mask too.
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).to(DEVICE).requires_grad_()
    _check_against_reference(q, k, v, attn_mask=bias, enable_gqa=True, extra_grad_inputs=(bias,))
    out, _ = safeattn.attention(q, k, v, attn_mask=bias, enable_gqa=True)
    (grad_bias,) = torch.autograd.grad(out.float().square().sum(), (bias,))
    masked = ~allowed.to(DEVICE)
    assert torch.all(grad_bias[masked] == 0), "the gradient of a -inf bias element must be exactly 0"
    assert grad_bias[~masked].abs().sum() > 0, "visible bias elements must get a gradient"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_bool_mask_fully_masked_rows(dtype):
    gen = torch.Generator().manual_seed(3)
    q_len, kv_len = 97, 300
    mask = torch.rand(2, 1, q_len, kv_len, generator=gen) > 0.6
    rows = [(0, 0), (0, 64), (0, 96), (1, 17)]  # first, tile-boundary and last rows
    for b, i in rows:
        mask[b, 0, i] = False
    mask = mask.to(DEVICE)
    q, k, v = _qkv(2, 4, 2, q_len, kv_len, 128, dtype, DEVICE)
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True, check_lse_grad=True)
    out, lse = safeattn.attention(q, k, v, attn_mask=mask, enable_gqa=True)
    loss = out.float().sum() + torch.where(lse.isfinite(), lse, 0).sum()
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v))
    for b, i in rows:
        assert torch.all(gq[b, :, i] == 0), f"grad_query of fully masked row ({b}, {i}) must be 0"
    assert all(g.isfinite().all() for g in (gq, gk, gv)), "fully masked rows made a non-finite gradient"


def test_every_row_masked_gives_zero_gradients():
    q, k, v = _qkv(1, 2, 2, 70, 90, 64, torch.bfloat16, DEVICE)
    mask = torch.zeros(70, 90, dtype=torch.bool, device=DEVICE)
    out, _ = safeattn.attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    for name, g in zip(("query", "key", "value"), grads, strict=True):
        assert torch.all(g == 0), f"grad_{name} must be 0 when every key is masked"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_softcap(dtype, head_dim):
    q, k, v = _qkv(1, 4, 2, 97, 300, head_dim, dtype, DEVICE)
    with torch.no_grad():
        q.mul_(4)  # large scores, so that the cap matters
    _check_against_reference(q, k, v, softcap=2.0, enable_gqa=True, is_causal=True, q_offset=203)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_sinks_and_lse_gradient(dtype):
    q, k, v = _qkv(2, 4, 2, 97, 130, 64, dtype, DEVICE)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    mask = torch.ones(2, 1, 97, 130, dtype=torch.bool, device=DEVICE)
    mask[1, 0, :3] = False  # fully masked rows: lse = the sink logit
    _check_against_reference(
        q, k, v, attn_mask=mask, sinks=sinks, enable_gqa=True, check_lse_grad=True, extra_grad_inputs=(sinks,)
    )


def test_transposed_and_unaligned_views():
    # Transformers' [B, S, H, D].transpose(1, 2) views are read in place; a view whose rows are
    # not 16-byte aligned (offset by one element) is copied first. Both must match the reference.
    q, k, v = _qkv(2, 4, 2, 97, 130, 128, torch.bfloat16, DEVICE, transposed=True)
    assert not q.is_contiguous()
    _check_against_reference(q, k, v, enable_gqa=True, is_causal=True)
    _, k2, v2 = _qkv(2, 4, 2, 97, 130, 128, torch.bfloat16, DEVICE, seed=1)
    base = torch.randn(2, 4, 97, 129, device=DEVICE, dtype=torch.bfloat16)
    q2 = base[..., 1:].detach().requires_grad_()  # rows 258 bytes apart, 2 bytes off alignment
    _check_against_reference(q2, k2, v2, enable_gqa=True)
    # Contiguous but 2 bytes off alignment: contiguous() would hand it back unchanged, so the
    # kernels must read it from an aligned copy (forward and backward).
    flat = torch.randn(1 + 2 * 4 * 97 * 128, device=DEVICE, dtype=torch.bfloat16)
    q3 = flat[1:].view(2, 4, 97, 128).detach().requires_grad_()
    assert q3.is_contiguous() and q3.data_ptr() % 16 != 0
    _check_against_reference(q3, k2, v2, enable_gqa=True, is_causal=True)


def test_nan_propagates_to_gradients():
    q, k, v = _qkv(1, 2, 2, 40, 200, 64, torch.bfloat16, DEVICE)
    q = q.detach().clone()
    q[0, 0, 3, 5] = float("nan")
    q.requires_grad_()
    out, _ = safeattn.attention(q, k, v)
    gq, gk = torch.autograd.grad(out.float().sum(), (q, k))
    assert gq[0, 0, 3].isnan().all(), "a NaN query row must give a NaN grad_query row"
    assert not gq[0, 1].isnan().any(), "NaN must stay in its head"
    assert gk[0, 0].isnan().any(), "a NaN query must reach grad_key of its head"
    assert not gk[0, 1].isnan().any(), "NaN must not reach grad_key of another head"


def test_nan_padding_never_leaks():
    # Every input is a view into a NaN-filled buffer; tiles past the sequence ends must not read it.
    batch, hq, hkv, q_len, kv_len, d = 2, 4, 2, 37, 530, 128

    def poisoned(h, s):
        big = torch.full((batch, s + 3, h + 1, d + 16), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        view = big[:, 1 : s + 1, :h, 8 : 8 + d].transpose(1, 2)
        view.copy_(torch.randn(batch, h, s, d))
        return view.detach().requires_grad_()

    q, k, v = poisoned(hq, q_len), poisoned(hkv, kv_len), poisoned(hkv, kv_len)
    big_mask = torch.full((batch, 1, q_len + 2, kv_len + 5), float("nan"), device=DEVICE)
    bias = big_mask[:, :, 1 : q_len + 1, 2 : kv_len + 2]
    bias.copy_(torch.randn(batch, 1, q_len, kv_len))
    bias = bias.detach().requires_grad_()
    out, lse = safeattn.attention(q, k, v, bias, is_causal=True, q_offset=493, enable_gqa=True, softcap=20.0)
    grads = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v, bias))
    for name, g in zip(("query", "key", "value", "bias"), grads, strict=True):
        assert not g.isnan().any(), f"NaN padding leaked into grad_{name}"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_deterministic(dtype):
    q, k, v = _qkv(2, 8, 2, 300, 520, 128, dtype, DEVICE)
    bias = torch.randn(1, 1, 300, 520, device=DEVICE, requires_grad=True)
    sinks = torch.randn(8, device=DEVICE, requires_grad=True)
    results = []
    for _ in range(3):
        out, lse = safeattn.attention(
            q, k, v, bias, enable_gqa=True, is_causal=True, q_offset=220, softcap=30.0, sinks=sinks
        )
        results.append(torch.autograd.grad(out.float().square().sum() + lse.sum(), (q, k, v, bias, sinks)))
    for other in results[1:]:
        for name, a, b in zip(("query", "key", "value", "bias", "sinks"), results[0], other, strict=True):
            assert torch.equal(a, b), f"grad_{name} differs between two identical runs"


# ---- the two dQ modes ----------------------------------------------------------------------


def _backward_kernels(q, k, v, **kwargs):
    """Names of the attention_bwd kernels that one backward launches."""
    out, _ = safeattn.attention(q, k, v, **kwargs)
    mask = kwargs.get("attn_mask")
    inputs = (q, k, v, *([mask] if mask is not None and mask.requires_grad else []))
    names = cuda_kernel_names(lambda: torch.autograd.grad(out.float().sum(), inputs))
    return {n for n in names if "attention_bwd" in n}


@pytest.fixture
def deterministic_algorithms():
    """A setter of torch.use_deterministic_algorithms for the test; the setting is restored after it."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda on: torch.use_deterministic_algorithms(on)
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def test_atomic_dq_mode_selection(deterministic_algorithms):
    # A float mask with a softcap keeps the backward on the mma.sync kernels on every GPU (the
    # sm_90a backward takes no bias with a softcap), here in their atomic mode when the mask needs
    # no gradient.
    q, k, v = _qkv(1, 4, 2, 97, 130, 128, torch.bfloat16, DEVICE)
    keep = torch.zeros(1, 1, 97, 130, device=DEVICE)
    keep[..., :5] = float("-inf")
    names = _backward_kernels(q, k, v, attn_mask=keep, enable_gqa=True, is_causal=True, softcap=30.0)
    if not names:
        pytest.skip("the profiler recorded no CUDA kernel")
    assert any("attention_bwd_dkdv_kernel" in n for n in names), f"no dK/dV kernel among {names}"
    assert not any(
        "attention_bwd_dq_kernel" in n for n in names
    ), f"the dQ kernel ran in the atomic mode: {names}"

    def dq_kernel_ran(**kwargs):
        names = _backward_kernels(q, k, v, enable_gqa=True, is_causal=True, softcap=30.0, **kwargs)
        return any("attention_bwd_dq_kernel" in n for n in names)

    bias = torch.randn(1, 4, 97, 130, device=DEVICE, requires_grad=True)
    assert dq_kernel_ran(attn_mask=bias), "a mask gradient must take the dQ kernel (it writes the gradient)"
    deterministic_algorithms(True)
    assert dq_kernel_ran(attn_mask=keep), "torch.use_deterministic_algorithms(True) must take the dQ kernel"


# The sm_90a forward's D=64 tile shapes (tile_traits.cuh) by consumer warpgroups, as the kernel's
# name spells FwdTileConfig's first arguments, demangled or mangled.
SM90_FWD_D64_SHAPES = {
    3: ("FwdTileConfig<64, 128, 4, 3,", "FwdTileConfigILi64ELi128ELi4ELi3E"),
    2: ("FwdTileConfig<64, 128, 4, 2,", "FwdTileConfigILi64ELi128ELi4ELi2E"),
}


@pytest.mark.parametrize(
    "q_len, kv_len, is_causal, warpgroups",
    [
        (512, 512, True, 2),
        (1024, 1024, True, 2),
        (17, 1024, True, 2),
        (1025, 1025, True, 3),
        (512, 1100, True, 3),
        (512, 512, False, 3),
    ],
)
def test_sm90_d64_forward_shape(q_len, kv_len, is_causal, warpgroups):
    """At D=64 the sm_90a forward runs 192-row tiles on three consumer warpgroups, except is_causal
    without a mask over at most 1024 queries and keys (ShortCausalFwdConfig: 128-row tiles on
    two); each against the float64 reference, causality bottom-right where the lengths differ."""
    q, k, v = _qkv(2, 4, 2, q_len, kv_len, 64, torch.bfloat16, DEVICE, seed=q_len + kv_len)
    kwargs = {"enable_gqa": True, "is_causal": is_causal}
    if is_causal:
        kwargs["q_offset"] = kv_len - q_len
    _check_against_reference(q, k, v, **kwargs)
    if not _hopper_build(q, k, v):
        return  # not an sm_90 device with the sm_90a kernels: the values above are the test
    names = cuda_kernel_names(lambda: safeattn.attention(q, k, v, **kwargs))
    shape = SM90_FWD_D64_SHAPES[warpgroups]
    assert any(
        s in n for n in names for s in shape
    ), f"the {warpgroups}-warpgroup D=64 forward did not run: {names}"


def test_sm90_selection(deterministic_algorithms):
    """On an H100/H200 of a build with the sm_90a kernels (the forward took one), the backward
    takes the sm_90a kernel in the atomic mode, with or without a mask, with a learnable per-head
    bias (its gradient written per element) and with a learnable bias broadcast over the heads
    (its gradient summed over them in the kernel); its dQ pass when deterministic."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a kernels run on sm_90 devices only")
    q, k, v = _qkv(1, 4, 2, 97, 130, 128, torch.bfloat16, DEVICE)
    if not any(
        "hopper::detail::fwd_kernel" in n
        for n in cuda_kernel_names(lambda: safeattn.attention(q, k, v, enable_gqa=True))
    ):
        pytest.skip("a build without the sm_90a kernels (no CUTLASS headers)")

    def kernels(**kwargs):
        out, _ = safeattn.attention(q, k, v, enable_gqa=True, is_causal=True, **kwargs)
        mask = kwargs.get("attn_mask")
        inputs = (q, k, v, *([mask] if mask is not None and mask.requires_grad else []))
        return cuda_kernel_names(lambda: torch.autograd.grad(out.float().sum(), inputs))

    names = kernels()
    assert any("hopper::detail::bwd_kernel" in n for n in names), f"no sm_90a backward kernel among {names}"
    assert not any("attention_bwd_dkdv_kernel" in n for n in names), f"the mma.sync kernel ran too: {names}"
    keep = torch.ones(1, 1, 97, 130, dtype=torch.bool, device=DEVICE)
    keep[..., :5] = False
    names = kernels(attn_mask=keep)
    assert any("hopper::detail::bwd_kernel" in n for n in names), f"a bool mask must take sm_90a: {names}"
    bias = torch.randn(1, 4, 97, 130, device=DEVICE, requires_grad=True)
    names = kernels(attn_mask=bias)
    assert any("hopper::detail::bwd_kernel" in n for n in names), f"a per-head bias must take sm_90a: {names}"
    assert not any("attention_bwd_dkdv_kernel" in n for n in names), f"the mma.sync kernel ran too: {names}"
    bias = torch.randn(1, 1, 97, 130, device=DEVICE, requires_grad=True)
    names = kernels(attn_mask=bias)
    assert any(
        "hopper::detail::bwd_kernel" in n for n in names
    ), f"a broadcast bias must take sm_90a: {names}"
    assert not any("attention_bwd_dkdv_kernel" in n for n in names), f"the mma.sync kernel ran too: {names}"
    assert not any("dq_pass_kernel" in n for n in kernels()), "the dQ pass ran while atomics are allowed"
    deterministic_algorithms(True)
    names = kernels()
    assert any("hopper::detail::bwd_kernel" in n for n in names), f"deterministic must keep sm_90a: {names}"
    assert any(
        "hopper::detail::dq_pass_kernel" in n for n in names
    ), f"deterministic must take the dQ pass: {names}"
    assert not any(
        "dq_convert_kernel" in n for n in names
    ), f"dq_accum converted while deterministic: {names}"


def _sm90_masks(batch, heads, q_len, kv_len):
    """Bool masks of the shapes and structures the sm_90a kernels meet, by name: most of their
    (64-query, 128-key) tiles fully masked or fully visible, some mixed."""
    gen = torch.Generator().manual_seed(3)
    positions = torch.arange(kv_len)
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    causal = positions[None, :] <= rows  # bottom-right
    left_pad = torch.tensor([0, 200, 130, 7][:batch])
    keep_keys = positions[None, :] >= left_pad[:, None]  # [B, KV]
    window = causal & (positions[None, :] > rows - 150)
    per_head = torch.rand(1, heads, q_len, kv_len, generator=gen) > 0.2
    per_head[:, :, :, 256:384] = True  # a fully visible key tile
    per_head[:, 1:3, :, :128] = False  # fully masked tiles in two heads
    staircase = positions[None, :] < 2 * torch.arange(q_len)[:, None] - 50
    shifts = torch.tensor([-kv_len, -37, -1, 0, 1, 75, 130, kv_len])[torch.arange(heads) % 8]
    diagonals = (
        positions[None, None, :] <= torch.arange(q_len)[None, :, None] + shifts[:, None, None]
    )  # [H, Q, KV]
    everything_masked_in_batch_0 = torch.stack([torch.zeros_like(causal)] + [causal] * (batch - 1))
    return {
        "causal_left_padding": (causal & keep_keys[:, None, :])[:, None],  # [B, 1, Q, KV], as Transformers
        "key_padding": keep_keys[:, None, None, :],  # [B, 1, 1, KV]
        "sliding_window": window,  # [Q, KV]
        "per_head_random": per_head,  # [1, H, Q, KV]
        "everything_masked_in_batch_0": everything_masked_in_batch_0[:, None],
        # Rows on 16-byte boundaries (the summary's 16-keys-per-load path), the last tile's keys
        # not a multiple of 16: a mask built for a longer cache and sliced, as Transformers does.
        "sliced_from_wider": torch.nn.functional.pad(causal & keep_keys[:, None, :], (0, 8))[
            :, None, :, :kv_len
        ],
        # Aligned rows again: a causal mask (its diagonal tiles are tested by a compare, not read)
        # and a staircase whose rows see prefixes that grow by two keys a row (not one diagonal).
        "causal_sliced": torch.nn.functional.pad(causal, (0, 8))[:, :kv_len],
        "staircase_sliced": torch.nn.functional.pad(staircase, (0, 8))[:, :kv_len],
        # Aligned rows, one diagonal a head at offsets on both sides of the main one (the first
        # head's rows see no key, the last head's every key): diagonal tiles whose diagonals
        # differ from is_causal's, tested by a compare on every path that reads the class.
        "diagonals_per_head_sliced": torch.nn.functional.pad(diagonals, (0, 8))[None, :, :, :kv_len],
    }


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize(
    "name",
    [
        "causal_left_padding",
        "key_padding",
        "sliding_window",
        "per_head_random",
        "everything_masked_in_batch_0",
        "sliced_from_wider",
        "causal_sliced",
        "staircase_sliced",
        "diagonals_per_head_sliced",
    ],
)
def test_bool_masks_sm90(name, head_dim, dtype):
    """Bool masks through the sm_90a kernels (on an H100/H200; the mma.sync kernels elsewhere):
    skipped, visible and mixed tiles, every broadcast shape, fully masked rows and batches, GQA,
    a partial last tile on both sides, with and without is_causal on top."""
    batch, heads, q_len, kv_len = 4, 8, 300, 520
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim)
    mask = _sm90_masks(batch, heads, q_len, kv_len)[name].to(DEVICE)
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True, check_lse_grad=True)
    _check_against_reference(
        q, k, v, attn_mask=mask, enable_gqa=True, is_causal=True, q_offset=kv_len - q_len
    )
    _assert_sm90_took_mask(q, k, v, mask)


@pytest.mark.parametrize("head_dim", TENSOR_CORE_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_key_masks_every_path(dq_mode, head_dim, causal):
    """A [B, 1, 1, KV] key mask (what a causal + padding MaskDescription runs as) on every
    kernel of the build (head dims it has no tensor-core kernels for take the generic ones; the
    default build has 64, 96 and 128): its tile summary is one row of key tiles read for every query tile, so a partial
    last query tile, fully masked and fully visible key tiles, a row that keeps nothing and
    both dQ modes are checked against the reference, forward and backward."""
    batch, q_len, kv_len = 4, 300, 520
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, head_dim, torch.bfloat16, DEVICE, seed=head_dim + causal)
    positions = torch.arange(kv_len)
    keep = torch.stack(
        [
            positions >= 200,  # left padding over a whole key tile and part of the next
            positions < 390,  # right padding
            torch.zeros(kv_len, dtype=torch.bool),  # nothing: every row 0
            (positions // 7) % 3 != 0,  # mixed tiles only
        ]
    )
    mask = keep[:, None, None, :].to(DEVICE)
    _check_against_reference(
        q,
        k,
        v,
        attn_mask=mask,
        enable_gqa=True,
        **_causal_kwargs("bottom_right" if causal else None, q_len, kv_len),
    )


def _hopper_build(q, k, v):
    """An sm_90 device and a build with the sm_90a kernels: a plain call of q, k, v took them."""
    return torch.cuda.get_device_capability() == (9, 0) and any(
        "hopper::detail::fwd_kernel" in n
        for n in cuda_kernel_names(lambda: safeattn.attention(q, k, v, enable_gqa=True))
    )


def _assert_sm90_took_mask(q, k, v, mask, **kwargs):
    """On an sm_90 device with the sm_90a kernels built, the mask (and kwargs: key ranges)
    ran through them."""
    if _hopper_build(q, k, v):  # the kernels under test must be the ones that ran
        out, _ = safeattn.attention(q, k, v, attn_mask=mask, enable_gqa=True, **kwargs)
        fwd = cuda_kernel_names(
            lambda: safeattn.attention(q, k, v, attn_mask=mask, enable_gqa=True, **kwargs)
        )
        bwd = cuda_kernel_names(lambda: torch.autograd.grad(out.float().sum(), (q, k, v)))
        assert any("hopper::detail::fwd_kernel" in n for n in fwd), f"the mask must take sm_90a: {fwd}"
        assert any("hopper::detail::bwd_kernel" in n for n in bwd), f"the mask must take sm_90a: {bwd}"


def _key_range_cases(batch, q_len, kv_len):
    """Key ranges as descriptions make them (a causal window; a window with chunks, per-batch
    chunk padding; a bidirectional window), at the queries' bottom-right positions, and random
    ones (empty rows, ranges past both ends)."""
    place = (batch, q_len, kv_len, kv_len - q_len, 0)
    pads = torch.tensor([0, 37, 5, 200])[:batch]
    return {
        "window": safeattn.MaskDescription(sliding_window=200).key_ranges(*place),
        "window_chunks": safeattn.MaskDescription(
            sliding_window=150, chunk_size=96, chunk_left_padding=pads
        ).key_ranges(*place),
        "bidirectional_window": safeattn.MaskDescription(causal=False, sliding_window=130).key_ranges(*place),
        "random": _random_key_ranges(batch, q_len, kv_len, seed=5),
    }


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("kind", ["window", "window_chunks", "bidirectional_window", "random"])
@pytest.mark.parametrize("key_mask", [False, True])
def test_key_ranges_sm90(kind, key_mask, head_dim, dtype):
    """Key ranges through the sm_90a kernels (on an H100/H200; drawn for the mma.sync kernels
    elsewhere): their tile summary (masked, visible, diagonal and mixed tiles from the ranges,
    ANDed with a key mask's), the mixed tiles' per-element test, GQA, partial last tiles, rows
    that see nothing; forward, backward and lse's gradient against the reference."""
    batch, heads, q_len, kv_len = 4, 8, 300, 520
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim)
    ranges = _key_range_cases(batch, q_len, kv_len)[kind].to(DEVICE)
    mask = None
    if key_mask:
        mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
        for b in range(batch):
            mask[b, ..., : 90 * b] = False  # left padding of 0, 90, 180, 270 keys
        mask = mask.to(DEVICE)
    causal = kind in ("window", "window_chunks")
    kwargs = {"key_ranges": ranges, "is_causal": causal, "q_offset": kv_len - q_len}
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True, check_lse_grad=True, **kwargs)
    _assert_sm90_took_mask(q, k, v, mask, **kwargs)


def test_key_ranges_drawn_for_mma_sync():
    # A float mask with a softcap keeps the backward on the mma.sync kernels (every GPU): the
    # ranges drawn into the mask (the sm_90a forward reads them as they are).
    batch, q_len, kv_len = 2, 150, 260
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, 64, torch.bfloat16, DEVICE)
    ranges = _key_range_cases(batch, q_len, kv_len)["window_chunks"].to(DEVICE)
    bias = torch.randn(batch, 1, q_len, kv_len, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    _check_against_reference(
        q, k, v, attn_mask=bias, key_ranges=ranges, is_causal=True, softcap=20.0, enable_gqa=True
    )


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("extra", ["sinks", "softcap", "sinks_softcap"])
def test_sinks_and_softcap_sm90(extra, head_dim, dtype):
    """Sinks (GPT-OSS) and a softcap (Gemma 2) in the sm_90a kernels (on an H100/H200; the
    mma.sync ones elsewhere), with what they meet in those models: a causal sliding window as
    key ranges, left padding as a key mask, GQA, several query and key tiles with partial last
    ones, rows that see nothing (out 0, lse the sink logit), a sink of -inf (no sink) and one far
    above every score (the row's weight goes to it). Forward, backward (sinks: the sm_90a
    backward, the softcap's chain rule from p) and lse's and the sinks' gradients against the
    reference."""
    batch, heads, q_len, kv_len = 3, 4, 300, 520
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim + 11)
    kwargs = {"enable_gqa": True, "is_causal": True, "q_offset": kv_len - q_len}
    extra_grad_inputs = ()
    if "softcap" in extra:
        with torch.no_grad():
            q.mul_(4)  # large scores, so that the cap matters
        kwargs["softcap"] = 7.0
    if "sinks" in extra:
        sinks = torch.tensor([-float("inf"), 40.0, 0.5, -1.0], device=DEVICE, requires_grad=True)
        kwargs["sinks"] = sinks
        extra_grad_inputs = (sinks,)
    place = (batch, q_len, kv_len, kv_len - q_len, 0)
    kwargs["key_ranges"] = safeattn.MaskDescription(sliding_window=200).key_ranges(*place).to(DEVICE)
    mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
    mask[1, ..., :300] = False  # left padding: row 1's first queries see no key
    mask[2] = False  # nothing visible
    mask = mask.to(DEVICE)
    out, lse = _check_against_reference(
        q, k, v, attn_mask=mask, check_lse_grad=True, extra_grad_inputs=extra_grad_inputs, **kwargs
    )
    assert torch.all(out[2] == 0), "rows that see nothing must be 0"
    if "sinks" in extra:
        want = kwargs["sinks"].detach()[:, None].expand(heads, q_len)
        torch.testing.assert_close(lse[2], want, msg="an empty row's lse is its head's sink logit")
    else:
        assert torch.all(lse[2].isneginf()), "an empty row's lse is -inf"
    _assert_sm90_took_mask(q, k, v, mask, **{name: x for name, x in kwargs.items() if name != "enable_gqa"})


def _float_mask_cases(batch, heads, q_len, kv_len):
    """Float masks (additive biases) of the shapes models give, by name: a learnable per-head
    bias (ALiBi / T5-like, [1, H, Q, KV]), a [B, 1, Q, KV] mask of -inf and bias values (causal,
    left padding, a batch row that sees nothing), and a learnable [B, H, Q, KV] bias with -inf
    tiles, zero (fully visible) tiles and a query tile of empty rows. The test takes a name
    ending in "16bit" in the inputs' 16-bit dtype, the others in float32 (a mask is bool,
    float32 or the query's dtype). Each: (mask, whether it takes a gradient)."""
    gen = torch.Generator().manual_seed(9)
    positions = torch.arange(kv_len)
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    causal = positions[None, :] <= rows
    alibi = (
        -(rows - positions[None, :]).abs().float()
        * torch.tensor([0.5, 0.25, 0.125, 0.0625])[:heads, None, None]
    )
    padded = torch.randn(batch, 1, q_len, kv_len, generator=gen) * 2
    padded = padded.masked_fill(~causal, float("-inf"))
    padded[1, ..., :300] = float("-inf")  # left padding: row 1's first queries see no key
    padded[2] = float("-inf")  # nothing visible
    tiles = torch.randn(batch, heads, q_len, kv_len, generator=gen)
    tiles[0, :, :, 256:384] = 0.0  # fully visible tiles (no bias read)
    tiles[1, 1:3, :, :128] = float("-inf")  # fully masked tiles, skipped
    tiles[2, 0, :64] = float("-inf")  # a whole query tile of empty rows
    # Transformers' eager masks: finfo.min (of the model's dtype) instead of -inf, so a row that
    # sees nothing attends uniformly over its keys (PyTorch's rule) rather than being empty.
    hf_min = torch.zeros(batch, 1, q_len, kv_len).masked_fill(~causal, float("-inf"))
    hf_min[1, ..., :300] = float("-inf")
    hf_min[2] = float("-inf")
    return {
        "learnable_per_head": (alibi[None], True),
        "learnable_per_head_16bit": (alibi[None], True),
        "padding_causal_16bit": (padded, False),
        "finfo_min_16bit": (hf_min, False),
        "per_batch_head_16bit": (tiles, True),
    }


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize(
    "kind",
    [
        "learnable_per_head",
        "learnable_per_head_16bit",
        "padding_causal_16bit",
        "per_batch_head_16bit",
        "finfo_min_16bit",
        "with_ranges",
        "with_ranges_16bit",
        "row_stride_unaligned_16bit",
    ],
)
def test_float_mask_sm90(kind, head_dim, dtype):
    """Float masks (biases) read in place by the sm_90a kernels (on an H100/H200; the mma.sync
    ones elsewhere): the bias added in mixed tiles, zero tiles read as visible, -inf tiles skipped,
    rows that see nothing (out 0, lse -inf), rows of finfo.min (uniform in bf16), GQA, partial
    last tiles; forward, backward, lse's gradient and the mask's own gradient (written per element
    by the sm_90a backward when the mask has a head dim) against the reference. A 16-bit mask
    with 16-byte aligned rows comes to the forward as TMA tiles, a float32 one or one whose row
    stride (523 elements here) is not a multiple of 16 bytes is gathered: both are here."""
    batch, heads, q_len, kv_len = 3, 4, 300, 520
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim + 23)
    cases = _float_mask_cases(batch, heads, q_len, kv_len)
    kwargs = {"enable_gqa": True}
    if kind.startswith("with_ranges"):  # a described window ANDed with a learnable bias
        mask, grad = cases["per_batch_head_16bit" if kind.endswith("16bit") else "learnable_per_head"]
        place = (batch, q_len, kv_len, kv_len - q_len, 0)
        kwargs["key_ranges"] = safeattn.MaskDescription(sliding_window=200).key_ranges(*place).to(DEVICE)
        kwargs.update(is_causal=True, q_offset=kv_len - q_len)
    elif kind == "row_stride_unaligned_16bit":
        mask, grad = cases["padding_causal_16bit"]
        wide = torch.zeros(*mask.shape[:3], kv_len + 3, device=DEVICE, dtype=dtype)
        wide[..., :kv_len] = mask.to(DEVICE, dtype)
        mask = wide[..., :kv_len]  # rows 523 elements apart
    else:
        mask, grad = cases[kind]
    mask = mask.to(DEVICE, dtype if kind.endswith("16bit") else mask.dtype)
    if kind == "finfo_min_16bit":
        mask = mask.clamp(min=torch.finfo(dtype).min)
    mask.requires_grad_(grad)
    out, lse = _check_against_reference(
        q, k, v, attn_mask=mask, check_lse_grad=True, extra_grad_inputs=(mask,) if grad else (), **kwargs
    )
    if kind in ("padding_causal_16bit", "row_stride_unaligned_16bit"):
        assert torch.all(out[2] == 0) and torch.all(lse[2].isneginf()), "rows that see nothing: 0 and -inf"
    if kind == "finfo_min_16bit" and dtype == torch.bfloat16:
        # Batch row 2: every bias bf16's finfo.min (-3.4e38), which swallows the scores in float32,
        # so the row is a uniform softmax as in Transformers' eager path. fp16's finfo.min (-65504)
        # does not: such a row is the plain softmax, as the reference above says.
        uniform = v.detach()[2].double().mean(dim=1, keepdim=True).repeat_interleave(2, dim=0)
        assert (out[2].double() - uniform).abs().max().item() < 3e-2, "a row of finfo.min is not uniform"
    _assert_sm90_took_mask(q, k, v, mask, **{name: x for name, x in kwargs.items() if name != "enable_gqa"})


@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("kind", ["causal_left_padding", "packed_documents"])
def test_bool_mask_long_walks_sm90(kind, head_dim):
    """Long runs of fully masked tiles before and between the visited ones, so that the sm_90a
    kernels' producers walk the mask summary over many tiles (the backward's walk reads several
    tiles per round trip and crosses from one query head of a GQA group to the next): 17 key
    tiles, 33 query tiles of the backward, left padding up to 1300 of 2100 keys, and packed
    documents whose masked tiles lie between visible ones."""
    batch, heads, length = 3, 4, 2100
    q, k, v = _qkv(batch, heads, 2, length, length, head_dim, torch.bfloat16, DEVICE, seed=7)
    positions = torch.arange(length)
    causal = positions[None, :] <= positions[:, None]
    if kind == "causal_left_padding":
        keep_keys = positions[None, :] >= torch.tensor([0, 1300, 700])[:, None]
        mask = causal & keep_keys[:, None, :]
    else:
        # Document ids change at different places per batch row; a key is seen only by the
        # queries of its own document at or after it.
        starts = [[0, 300, 1400], [0, 900, 1000, 2000], [0, 129, 1700]]
        ids = torch.stack([(positions[:, None] >= torch.tensor(row)[None, :]).sum(1) for row in starts])
        mask = causal & (ids[:, :, None] == ids[:, None, :])
    mask = mask[:, None].to(DEVICE)
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True, check_lse_grad=True)
    _assert_sm90_took_mask(q, k, v, mask)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", ["per_batch_head", "shared_by_batch", "shared_by_heads", "key_mask"])
def test_column_ends_sm90(shape, head_dim):
    """Bands of different widths per query head (and per batch row), so that a key tile's last
    visible query tile differs between the query heads of one GQA group: the dK/dV kernel's walk
    up a column stops at that head's end (the summary's query_end), and must not stop at another
    head's or batch row's. A key mask ([B, 1, 1, KV]: a summary of one row of tiles) has no end
    but where a key tile is fully masked. Also narrow bands described by key ranges."""
    batch, heads, length = 2, 4, 900
    q, k, v = _qkv(batch, heads, 2, length, length, head_dim, torch.bfloat16, DEVICE, seed=head_dim + 3)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    widths = torch.tensor([[40, 700, 130, 900], [300, 64, 900, 7]])  # [batch, query head]
    band = (j <= i) & (i - j < widths[:, :, None, None])  # [B, H, S, S]
    if shape == "per_batch_head":
        mask = band
    elif shape == "shared_by_batch":
        mask = band[:1]
    elif shape == "shared_by_heads":
        mask = band[:, :1]
    else:
        mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
        mask[0, ..., 130:390] = False  # whole key tiles of no query, and a partial one
        mask[1, ..., 600:] = False
    mask = mask.to(DEVICE)
    _check_against_reference(q, k, v, attn_mask=mask, enable_gqa=True, check_lse_grad=True)
    _assert_sm90_took_mask(q, k, v, mask)
    if shape == "per_batch_head":
        # A 96-key window described by ranges: every key tile's band ends a few query tiles on.
        ranges = torch.stack([(i[:, 0] - 95).clamp(min=0), i[:, 0] + 1], dim=-1).int()
        ranges = ranges[None].expand(batch, -1, -1).contiguous().to(DEVICE)
        _check_against_reference(
            q, k, v, key_ranges=ranges, is_causal=True, enable_gqa=True, check_lse_grad=True
        )
        _assert_sm90_took_mask(q, k, v, None, key_ranges=ranges, is_causal=True)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize(
    "kind",
    [
        "plain",
        "causal",
        "causal_left_padding",
        "per_head_random",
        "everything_masked_in_batch_0",
        "sliced_from_wider",
        "staircase_sliced",
        "padding_causal_16bit",
        "learnable_per_head",
        "per_batch_head_16bit",
        "window_chunks_key_mask",
        "softcap_sinks",
    ],
)
def test_head_dim_256_forward_sm90(kind, dtype):
    """Head dim 256 (Gemma) in the sm_90a forward (on an H100/H200 of a build with it:
    SAFEATTN_ATTN_HEAD_DIMS naming 256), whose key tile is 64 keys, not 128: so are its mask
    summary's tiles. Every kind of mask it reads (bool ones with skipped, visible, diagonal and
    mixed tiles; float ones as TMA tiles or gathered; key ranges with a key mask), a softcap and
    sinks, GQA, partial last tiles, rows that see nothing; the output and lse against the
    reference, and the gradients (the sm_90a backward's, also 64-key tiles) for the plain and
    causal calls."""
    batch, heads, q_len, kv_len = 4, 4, 300, 520
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, 256, dtype, DEVICE, seed=256)
    kwargs, mask = {"enable_gqa": True}, None
    bool_masks = _sm90_masks(batch, heads, q_len, kv_len)
    float_masks = _float_mask_cases(batch, heads, q_len, kv_len)
    if kind == "causal":
        kwargs.update(is_causal=True, q_offset=kv_len - q_len)
    elif kind in bool_masks:
        mask = bool_masks[kind].to(DEVICE)
    elif kind in float_masks:
        mask = float_masks[kind][0].to(DEVICE, dtype if kind.endswith("16bit") else torch.float32)
    elif kind == "window_chunks_key_mask":
        kwargs.update(is_causal=True, q_offset=kv_len - q_len)
        kwargs["key_ranges"] = _key_range_cases(batch, q_len, kv_len)["window_chunks"].to(DEVICE)
        mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
        mask[3, ..., :270] = False
        mask = mask.to(DEVICE)
    elif kind == "softcap_sinks":
        with torch.no_grad():
            q.mul_(4)
        kwargs.update(is_causal=True, q_offset=kv_len - q_len, softcap=7.0)
        kwargs["sinks"] = torch.tensor([-float("inf"), 40.0, 0.5, -1.0], device=DEVICE)
    _check_against_reference(q, k, v, attn_mask=mask, grads=kind in ("plain", "causal"), **kwargs)
    if _hopper_build(q, k, v):
        names = cuda_kernel_names(lambda: safeattn.attention(q, k, v, attn_mask=mask, **kwargs))
        assert any("hopper::detail::fwd_kernel" in n for n in names), f"D=256 must take sm_90a: {names}"
        if kind in ("plain", "causal"):
            out, _ = safeattn.attention(q, k, v, attn_mask=mask, **kwargs)
            bwd = cuda_kernel_names(lambda: torch.autograd.grad(out.float().sum(), (q, k, v)))
            assert any("hopper::detail::bwd_kernel" in n for n in bwd), f"D=256 must take sm_90a: {bwd}"
            assert any("hopper::detail::dq_pass_kernel" in n for n in bwd), f"D=256 has a dQ pass: {bwd}"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize(
    "kind",
    [
        "causal",
        "causal_left_padding",
        "diagonals_per_head_sliced",
        "learnable_per_head",
        "softcap_key_ranges",
    ],
)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
def test_deterministic_sm90(deterministic_algorithms, head_dim, kind, dtype):
    """Under torch.use_deterministic_algorithms(True) the sm_90a backward runs its dQ pass (dQ
    written once, no atomics) at every head dim; on other GPUs the mma.sync kernels or the
    generic path run instead: the gradients match the reference, are bitwise the same from run to
    run, and (on an H100/H200 build with it) come from the dK/dV kernel and the dQ pass."""
    deterministic_algorithms(True)
    batch, heads, q_len, kv_len = 4, 4, 300, 520
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim + 1)
    kwargs = {"enable_gqa": True, "is_causal": True, "q_offset": kv_len - q_len}
    extra = ()
    if kind in ("causal_left_padding", "diagonals_per_head_sliced"):
        kwargs = {"enable_gqa": True, "attn_mask": _sm90_masks(batch, heads, q_len, kv_len)[kind].to(DEVICE)}
    elif kind == "learnable_per_head":
        bias = _float_mask_cases(batch, heads, q_len, kv_len)[kind][0].to(DEVICE).requires_grad_(True)
        kwargs = {"enable_gqa": True, "attn_mask": bias}
        extra = (bias,)
    elif kind == "softcap_key_ranges":
        kwargs.update(
            softcap=20.0, key_ranges=_key_range_cases(batch, q_len, kv_len)["window_chunks"].to(DEVICE)
        )
    _check_against_reference(q, k, v, extra_grad_inputs=extra, **kwargs)
    grad_out = torch.randn(batch, heads, q_len, head_dim, device=DEVICE, dtype=dtype)
    runs = []
    for _ in range(2):
        out, _ = safeattn.attention(q, k, v, **kwargs)
        runs.append(torch.autograd.grad(out, (q, k, v, *extra), grad_out))
    for name, a, b in zip(("query", "key", "value", "bias"), runs[0], runs[1], strict=False):
        assert torch.equal(a, b), f"grad_{name} differs between two identical deterministic runs"
    if _hopper_build(q, k, v):
        out, _ = safeattn.attention(q, k, v, **kwargs)
        names = cuda_kernel_names(lambda: torch.autograd.grad(out, (q, k, v, *extra), grad_out))
        assert any(
            "hopper::detail::bwd_kernel" in n for n in names
        ), f"D={head_dim} must keep sm_90a: {names}"
        assert any("hopper::detail::dq_pass_kernel" in n for n in names), f"no dQ pass among {names}"


@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("grad_layout", ["contiguous", "strided"])
@pytest.mark.parametrize("upstream", ["finite", "nan_on_empty_rows"])
def test_grad_out_as_given(upstream, grad_layout, head_dim):
    """The Hopper backward reads grad_out as the caller gave it (the rows pre-pass, not a cleaned
    copy): NaN and inf on the rows with no visible key (left padding) change no gradient, in a
    call of several query and key tiles with a partial last one; a grad_out with a non-unit inner
    stride takes the pre-pass's element-wise loads. Against the float64 reference with those rows'
    upstream zeroed (what the rule says they are). Also a check of dS's stmatrix stores: every
    gradient against the reference, in every tile."""
    batch, heads, q_len, kv_len, dtype = 4, 8, 300, 520, torch.bfloat16
    q, k, v = _qkv(batch, heads, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim + 5)
    mask = _sm90_masks(batch, heads, q_len, kv_len)["causal_left_padding"].clone()
    mask[1, :, [0, 63, 64, 200, q_len - 1]] = False  # empty rows at tile edges and the last one
    mask[3, :, 128:192] = False  # a whole query tile of empty rows (its steps are skipped)
    kwargs = {"attn_mask": mask.to(DEVICE), "enable_gqa": True}
    out, lse = safeattn.attention(q, k, v, **kwargs)
    empty = lse.isneginf()[..., None]  # [B, H, Q, 1]
    assert empty.any() and not empty.all()
    gen = torch.Generator().manual_seed(11)
    clean = torch.randn(out.shape, generator=gen).to(DEVICE, dtype).masked_fill(empty, 0)
    given = clean
    if upstream == "nan_on_empty_rows":
        odd = torch.arange(head_dim, device=DEVICE) % 2 == 1
        given = clean.masked_fill(empty, float("nan")).masked_fill(empty & odd, float("-inf"))
    if grad_layout == "strided":
        wide = torch.full((*out.shape[:3], 2 * head_dim), 7.0, device=DEVICE, dtype=dtype)
        wide[..., ::2] = given
        given = wide[..., ::2]
    got = torch.autograd.grad(out, (q, k, v), given, retain_graph=True)
    ref_out, _ = reference.attention(q, k, v, **kwargs)
    want = torch.autograd.grad(ref_out, (q, k, v), clean.double())
    low_out, _ = reference.attention(q, k, v, compute_dtype=dtype, **kwargs)
    low = torch.autograd.grad(low_out, (q, k, v), clean)
    for name, g, w, lo in zip(("grad_query", "grad_key", "grad_value"), got, want, low, strict=True):
        assert g.isfinite().all(), f"{name}: the upstream of an empty row leaked"
        _compare(name, g, w, lo, 3, FLOOR[dtype] * max(1.0, w.abs().max().item()) * 4)
    assert (got[0].masked_select(empty) == 0).all(), "an empty row's grad_query must be 0"
    if torch.cuda.get_device_capability() == (9, 0):
        names = cuda_kernel_names(lambda: torch.autograd.grad(out, (q, k, v), given, retain_graph=True))
        if any(
            "hopper::detail::fwd_kernel" in n
            for n in cuda_kernel_names(lambda: safeattn.attention(q, k, v, **kwargs))
        ):
            assert any("hopper::detail::bwd_kernel" in n for n in names), f"sm_90a did not run: {names}"


def _padding_mask(batch, q_len, kv_len):
    """[batch, 1, Q, KV] bool: random holes, batch 1 left-padded by 70 keys, and fully masked
    rows on a first, a tile-boundary, an odd and the last query."""
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(batch, 1, q_len, kv_len, generator=gen) > 0.3
    mask[1, :, :, :70] = False
    rows = [(0, 0), (0, 32), (0, 64), (1, 17), (1, q_len - 1)]
    for b, i in rows:
        mask[b, :, i] = False
    return mask.to(DEVICE), rows


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", SM90_HEAD_DIMS)
@pytest.mark.parametrize("masking", ["causal", "padding"])
def test_atomic_dq_matches_reference(masking, head_dim, dtype):
    # GQA 4:1 (four query heads add into the same key tiles' work), Q = 97: a partial last
    # 64-query step (scored in 32-query halves at D=128). Causal with kv_offset 30: queries
    # 0..29 see no key. Padding: see _padding_mask.
    q_len, kv_len = 97, 300
    q, k, v = _qkv(2, 8, 2, q_len, kv_len, head_dim, dtype, DEVICE, seed=head_dim + 1)
    if masking == "causal":
        kwargs = {"is_causal": True, "kv_offset": 30}
        rows = [(b, i) for b in range(2) for i in (0, 29)]
    else:
        mask, rows = _padding_mask(2, q_len, kv_len)
        kwargs = {"attn_mask": mask}
    _check_against_reference(q, k, v, enable_gqa=True, check_lse_grad=True, **kwargs)
    out, lse = safeattn.attention(q, k, v, enable_gqa=True, **kwargs)
    loss = out.float().sum() + torch.where(lse.isfinite(), lse, 0).sum()
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v))
    for b, i in rows:
        assert torch.all(gq[b, :, i] == 0), f"grad_query of the row ({b}, {i}) with no visible key must be 0"
    assert all(g.isfinite().all() for g in (gq, gk, gv)), "the atomic dQ mode made a non-finite gradient"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_deterministic_mode_reproducible_and_atomic_close(deterministic_algorithms, dtype):
    q, k, v = _qkv(2, 8, 2, 300, 520, 128, dtype, DEVICE)
    grad_out = torch.randn(2, 8, 300, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)

    # A float mask with a softcap (no gradient) keeps both modes on the mma.sync kernels on every GPU.
    bias = torch.randn(1, 1, 300, 520, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def grads():
        out, _ = safeattn.attention(
            q, k, v, bias, enable_gqa=True, is_causal=True, q_offset=220, softcap=30.0
        )
        return torch.autograd.grad(out, (q, k, v), grad_out)

    def runs(count):
        first = grads()
        for _ in range(count - 1):
            for name, a, b in zip(("query", "key", "value"), first, grads(), strict=True):
                assert torch.equal(a, b), f"grad_{name} differs between two identical deterministic runs"
        return first

    deterministic_algorithms(True)
    by_flag = runs(3)
    deterministic_algorithms(False)
    atomic = grads()
    # dQ sums the same bf16 / fp16 dS' K products in another order (float32), then rounds once;
    # dK and dV are the same products in both modes.
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for name, a, b in zip(("query", "key", "value"), atomic, by_flag, strict=True):
        want = b.float()
        torch.testing.assert_close(
            a.float(),
            want,
            rtol=tol,
            atol=tol * want.abs().max().item(),
            msg=lambda m, name=name: (
                f"grad_{name} of the atomic mode is not close to the deterministic one: {m}"
            ),
        )


# ---- the generic path ----------------------------------------------------------------------
# attention_backward_chunked (csrc/ops/attention_composite.cpp): ATen ops over chunks of queries.


@pytest.mark.parametrize(
    ("dtype", "head_dim", "dv"),
    [
        (torch.float32, 64, 64),  # float32 has no tensor-core kernel
        (torch.float32, 40, 40),
        (torch.bfloat16, 40, 40),  # no instantiation for 40
        (torch.float16, 64, 40),  # D != Dv
        (torch.bfloat16, 256, 256),
    ],
)
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_generic_path(dtype, head_dim, dv, causal):
    q, k, v = _qkv(2, 4, 2, 97, 130, head_dim, dtype, DEVICE, dv=dv)
    bias = torch.randn(1, 4, 97, 130, device=DEVICE, requires_grad=True)
    _check_against_reference(
        q, k, v, attn_mask=bias, enable_gqa=True, extra_grad_inputs=(bias,), **_causal_kwargs(causal, 97, 130)
    )


def test_generic_path_gradcheck():
    q, k, v = _qkv(2, 4, 2, 6, 9, 8, torch.float64, DEVICE)
    bias = torch.randn(2, 1, 6, 1, dtype=torch.float64, device=DEVICE, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def fn(q, k, v, bias, sinks):
        return safeattn.attention(
            q, k, v, bias, is_causal=True, enable_gqa=True, q_offset=2, softcap=3.0, sinks=sinks
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, bias, sinks), eps=1e-6, atol=1e-5), "gradcheck failed"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90_forward_cuda_graph_replays(head_dim):
    """The sm_90a forward under CUDA graph capture: its causal and masked calls take tiles from a
    counter zeroed by the kernel just before them, and start while that zeroing finishes (a
    programmatic dependency). Two calls captured back to back, replayed with new inputs each time,
    must give eager's outputs bitwise (a tile's result does not depend on which CTA took it; a
    counter left unzeroed would skip tiles and leave stale or poisoned rows)."""
    batch, heads, q_len, kv_len = 2, 4, 700, 900
    dtype = torch.bfloat16
    pad = torch.ones(batch, kv_len, dtype=torch.bool)
    pad[1, :333] = False
    mask = safeattn.sdpa_mask(batch, q_len, kv_len, kv_len - q_len, padding_mask=pad).to(DEVICE)

    def calls(q, k, v):
        causal, _ = safeattn.attention(q, k, v, is_causal=True, q_offset=kv_len - q_len)
        masked, lse = safeattn.attention(q, k, v, attn_mask=mask)
        return causal, masked, lse

    static = [t.detach() for t in _qkv(batch, heads, heads, q_len, kv_len, head_dim, dtype, DEVICE, seed=1)]
    if not _hopper_build(*static):
        pytest.skip("needs an sm_90 device and a build with the sm_90a kernels")
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls(*static)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = calls(*static)
        for replay in range(4):
            fresh = _qkv(batch, heads, heads, q_len, kv_len, head_dim, dtype, DEVICE, seed=10 + replay)
            for buffer, value in zip(static, fresh, strict=False):
                buffer.copy_(value.detach())
            for output in outputs:
                output.fill_(float("nan"))
            graph.replay()
            want = calls(*static)
            for name, got, expected in zip(("causal", "masked", "lse"), outputs, want, strict=False):
                assert torch.equal(got, expected), f"replay {replay}: {name} differs from eager"
