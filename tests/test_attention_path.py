"""Which kernel attention takes (safeattn._testing.attention_path), forward and backward.

Every other test checks what a call computes, which a fallback to a slower kernel computes too;
these check the kernel itself, by name, so such a fallback fails here. The CUDA cases need a GPU
(the sm_90a ones an H100/H200 and a build with those kernels) and skip elsewhere.
"""

from __future__ import annotations

import contextlib

import pytest
import safeattn
import torch
from conftest import HAS_CUDA_ATTENTION
from safeattn import _testing
from safeattn._testing import attention_path

_INFO = safeattn.build_info()
_FWD_DIMS = list(_INFO.get("attention_fwd_head_dims", []))
_BWD_DIMS = list(_INFO.get("attention_bwd_head_dims", []))
_SM90_FWD_DIMS = list(_INFO.get("attention_sm90_fwd_head_dims", []))
_SM90_BWD_DIMS = list(_INFO.get("attention_sm90_bwd_head_dims", []))

_HAS_GPU = torch.cuda.is_available() and HAS_CUDA_ATTENTION
NEEDS_GPU = pytest.mark.skipif(not _HAS_GPU, reason="needs a CUDA GPU and the CUDA attention kernels")
_IS_HOPPER = _HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
NEEDS_SM90A = pytest.mark.skipif(
    not (_IS_HOPPER and _INFO.get("hopper_kernels")),
    reason="needs an H100/H200 and a build with the sm_90a kernels",
)


@pytest.fixture
def not_generic(request):
    if request.config.getoption("--generic-kernels"):
        pytest.skip("the generic kernels are forced (--generic-kernels)")


def _qkv(batch, hq, hkv, q_len, kv_len, head_dim, dtype, device, requires_grad=False):
    def make(heads, length):
        return torch.randn(
            batch, heads, length, head_dim, dtype=dtype, device=device, requires_grad=requires_grad
        )

    return make(hq, q_len), make(hkv, kv_len), make(hkv, kv_len)


def _window(batch, device, width=64):
    """A described sliding window with key padding: it runs as is_causal, a key mask and key
    ranges."""
    padding = torch.ones(batch, 256, dtype=torch.bool, device=device)
    padding[0, :7] = False
    return safeattn.MaskDescription(sliding_window=width, padding_mask=padding)


def _names(path):
    return [name for name, _ in path.rejected]


# ---- CPU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float", "key_ranges", "described"])
def test_cpu_takes_the_cpu_kernels(dtype, backward, mask):
    q, k, v = _qkv(2, 4, 2, 256, 256, 64, dtype, "cpu")
    kwargs = {"enable_gqa": True}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "bool":
        kwargs["attn_mask"] = torch.rand(256, 256) > 0.5
    elif mask == "float":
        kwargs["attn_mask"] = torch.randn(2, 4, 256, 256, dtype=dtype, requires_grad=True)
    elif mask == "key_ranges":
        kwargs["key_ranges"] = torch.tensor([0, 100], dtype=torch.int32).expand(2, 256, 2)
    elif mask == "described":
        kwargs["attn_mask"] = _window(2, "cpu")
    path = attention_path(q, k, v, backward=backward, **kwargs)
    assert path.kernel == "cpu", f"{mask}, {dtype}, backward={backward}: took {path}"
    assert path.rejected == [], f"the CPU backend has one kernel, yet {path.rejected} declined"
    assert not path.key_ranges_drawn, f"the CPU kernels read key ranges, yet they were drawn: {path}"


def test_empty_output_runs_nothing():
    q, k, v = _qkv(2, 4, 4, 0, 16, 64, torch.float32, "cpu")
    assert attention_path(q, k, v).kernel == "none", "an empty output has no kernel to run"
    q, k, v = _qkv(2, 4, 4, 16, 0, 64, torch.float32, "cpu")
    assert attention_path(q, k, v, backward=True).kernel == "none", "no key: the backward runs nothing"


def test_bad_arguments_raise_the_ops_error():
    q, k, v = _qkv(1, 4, 2, 8, 8, 64, torch.float32, "cpu")
    with pytest.raises(RuntimeError) as from_op:
        safeattn.attention(q, k, v)  # Hq != Hkv without enable_gqa
    with pytest.raises(RuntimeError) as from_path:
        attention_path(q, k, v)
    assert str(from_path.value) == str(from_op.value), "attention_path must run the op's own checks"


def test_asking_leaves_no_graph_and_no_state():
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32, "cpu", requires_grad=True)
    attention_path(q, k, v, backward=True)
    assert q.grad is None and k.grad is None, "asking computed gradients"
    out, _ = safeattn.attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all(), "the op after attention_path is broken"


# ---- CUDA ------------------------------------------------------------------------------------


@NEEDS_SM90A
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", _SM90_FWD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float", "described", "key_ranges", "gqa"])
def test_hopper_forward_takes_sm90a(not_generic, dtype, head_dim, mask):
    hkv = 2 if mask == "gqa" else 8
    q, k, v = _qkv(2, 8, hkv, 256, 256, head_dim, dtype, "cuda")
    kwargs = {"enable_gqa": True, **_cuda_mask_kwargs(mask, dtype)}
    path = attention_path(q, k, v, **kwargs)
    assert path.kernel == "sm90a", f"D={head_dim} {dtype} {mask}: took {path}"
    assert not path.key_ranges_drawn, f"{mask}: sm90a reads key ranges, yet they were drawn: {path}"
    # decode is asked first, key ranges or not, and declines 8 x 256 query rows.
    assert _names(path) == ["decode"], f"{mask}: asked before sm90a: {path.rejected}"


@NEEDS_SM90A
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", _SM90_BWD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float", "described", "key_ranges", "gqa"])
def test_hopper_backward_takes_sm90a(not_generic, dtype, head_dim, mask):
    hkv = 2 if mask == "gqa" else 8
    q, k, v = _qkv(2, 8, hkv, 256, 256, head_dim, dtype, "cuda", requires_grad=True)
    kwargs = {"enable_gqa": True, **_cuda_mask_kwargs(mask, dtype)}
    path = attention_path(q, k, v, backward=True, **kwargs)
    assert path.kernel == "sm90a", f"backward D={head_dim} {dtype} {mask}: took {path}"
    assert path.rejected == [] and not path.key_ranges_drawn, f"{mask}: {path}"


@NEEDS_SM90A
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("bias_batch, bias_heads", [(1, 8), (2, 1), (1, 1)], ids=["1HQK", "B1QK", "11QK"])
def test_hopper_backward_with_a_learnable_bias_takes_sm90a(not_generic, kv_heads, bias_batch, bias_heads):
    """A full-size learnable bias broadcast over the batch, the heads or both has its gradient
    summed in the sm_90a kernel (GQA included: the heads are summed over all query heads)."""
    q, k, v = _qkv(2, 8, kv_heads, 256, 256, 128, torch.bfloat16, "cuda", requires_grad=True)
    bias = torch.randn(
        bias_batch, bias_heads, 256, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True
    )
    path = attention_path(q, k, v, bias, backward=True, enable_gqa=kv_heads != 8)
    shape = f"[{bias_batch}, {bias_heads}, Q, KV]"
    assert (
        path.kernel == "sm90a"
    ), f"a {shape} bias's gradient, {kv_heads} kv heads (summed in the kernel): {path}"


@NEEDS_SM90A
@pytest.mark.parametrize("head_dim", _SM90_BWD_DIMS)
def test_hopper_backward_under_deterministic_algorithms(not_generic, head_dim):
    """Deterministic algorithms keep the sm_90a backward at every head dim (dQ from its dQ pass,
    no atomics), a learnable bias shared by the batch included (its gradient then written per
    batch row and summed in order, not added with atomics)."""
    q, k, v = _qkv(2, 8, 8, 256, 256, head_dim, torch.bfloat16, "cuda", requires_grad=True)
    shared = torch.randn(1, 8, 256, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        path = attention_path(q, k, v, backward=True)
        shared_path = attention_path(q, k, v, shared, backward=True)
    finally:
        torch.use_deterministic_algorithms(was)
    assert path.kernel == "sm90a", f"D={head_dim} deterministic: {path}"
    assert shared_path.kernel == "sm90a", f"D={head_dim} deterministic, batch-shared bias: {shared_path}"


def _cuda_mask_kwargs(mask, dtype):
    if mask == "causal":
        return {"is_causal": True}
    if mask == "bool":
        return {"attn_mask": torch.rand(2, 1, 256, 256, device="cuda") > 0.3}
    if mask == "float":
        return {"attn_mask": torch.randn(2, 1, 256, 256, device="cuda", dtype=dtype)}
    if mask == "described":
        return {"attn_mask": _window(2, "cuda")}
    if mask == "key_ranges":
        lo = torch.arange(256, device="cuda") - 64  # a causal window of 65 keys
        ranges = torch.stack((lo, lo + 65), -1).to(torch.int32)
        return {"key_ranges": ranges.expand(2, 256, 2).contiguous()}
    return {}


@NEEDS_GPU
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("mask", ["none", "causal", "described"])
def test_generic_kernels_take_mma_sync(request, backward, mask):
    dims = _BWD_DIMS if backward else _FWD_DIMS
    if 128 not in dims:
        pytest.skip(f"this build has no mma.sync {'backward' if backward else 'forward'} for D=128")
    q, k, v = _qkv(2, 8, 8, 256, 256, 128, torch.bfloat16, "cuda", requires_grad=backward)
    # Under --generic-kernels the switch is on for the whole run: leaving the context would turn it off.
    forced = request.config.getoption("--generic-kernels")
    with contextlib.nullcontext() if forced else _testing.generic_kernels():
        path = attention_path(q, k, v, backward=backward, **_cuda_mask_kwargs(mask, torch.bfloat16))
    assert path.kernel == "mma_sync", f"generic kernels, {mask}, backward={backward}: took {path}"
    assert not path.key_ranges_drawn, f"{mask}: mma.sync reads key ranges, yet they were drawn: {path}"
    assert "sm90a" in _names(path), f"sm90a was not asked first: {path.rejected}"


@NEEDS_GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 8), (32, 4)])
def test_one_query_row_over_a_long_cache_takes_decode(dtype, head_dim, hq, hkv):
    q, k, v = _qkv(2, hq, hkv, 1, 8192, head_dim, dtype, "cuda")
    path = attention_path(q, k, v, enable_gqa=True, q_offset=8191, is_causal=True)
    assert path.kernel == "decode", f"1 query row, D={head_dim}, {hq}/{hkv} heads: took {path}"
    assert path.rejected == [], f"decode is asked first without key ranges: {path.rejected}"


@NEEDS_GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_length", [1, 2])
def test_a_kv_cache_with_key_ranges_takes_decode(dtype, head_dim, q_length):
    """attention_with_kvcache's call: a few query rows, each batch row's filled length as key
    ranges. decode reads them: nothing is drawn, and no prefill kernel walks the whole cache."""
    q, k, v = _qkv(3, 32, 8, q_length, 8192, head_dim, dtype, "cuda")
    lengths = torch.tensor([8192, 17, 4000], device="cuda")[:, None]
    hi = lengths - (q_length - 1) + torch.arange(q_length, device="cuda")  # causal, bottom-right
    ranges = torch.stack((torch.zeros_like(hi), hi), -1).to(torch.int32)
    path = attention_path(q, k, v, enable_gqa=True, key_ranges=ranges)
    assert path.kernel == "decode" and not path.key_ranges_drawn, f"D={head_dim} Sq={q_length}: took {path}"
    assert path.rejected == [], f"decode is asked first: {path.rejected}"


@NEEDS_GPU
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("mask", ["none", "causal", "described"])
def test_float32_takes_chunked_aten(backward, mask):
    q, k, v = _qkv(2, 8, 8, 256, 256, 64, torch.float32, "cuda", requires_grad=backward)
    path = attention_path(q, k, v, backward=backward, **_cuda_mask_kwargs(mask, torch.float32))
    assert path.kernel == "chunked_aten", f"float32, {mask}, backward={backward}: took {path}"
    asked = ["sm90a", "mma_sync"] if backward else ["decode", "sm90a", "mma_sync"]
    assert _names(path) == asked, f"float32: asked {path.rejected}"
    assert "float16" in dict(path.rejected)["mma_sync"], f"mma_sync declined float32 for: {path.rejected}"


@NEEDS_GPU
@pytest.mark.parametrize("backward", [False, True])
def test_a_head_dim_without_kernels_takes_chunked_aten(backward):
    if any(48 in dims for dims in (_FWD_DIMS, _BWD_DIMS, _SM90_FWD_DIMS, _SM90_BWD_DIMS)):
        pytest.skip("this build has a kernel for D=48")
    q, k, v = _qkv(2, 8, 8, 256, 256, 48, torch.bfloat16, "cuda", requires_grad=backward)
    path = attention_path(q, k, v, backward=backward)
    assert path.kernel == "chunked_aten", f"D=48 backward={backward}: took {path}"
    assert any("head dim" in reason for _, reason in path.rejected), f"no head-dim reason: {path.rejected}"
