"""safeattn.attention_with_kvcache (and flash_attn_interface's flash_attn_with_kvcache): the
in-place append, contiguous and paged caches, against reference.attention_with_kvcache (float64),
plus NaN poisoning of unused slots, gradients, gradcheck, torch.compile and argument checks.

Tolerance: FlashAttention's rule (tests/_serving_cases.py, as tests/test_attention.py).
"""

from __future__ import annotations

import re

import pytest
import safeattn
import torch
from _serving_cases import DTYPES, compare_grads, compare_outputs, low_dtype
from conftest import ATTENTION_DEVICES as DEVICES
from conftest import cuda_kernel_names
from safeattn import reference
from safeattn.flash_attn_interface import flash_attn_with_kvcache


def _rand(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _case(
    seqlens,
    q_length,
    new_tokens,
    hq,
    hkv,
    head_dim,
    dtype,
    device,
    *,
    paged,
    page_size=16,
    capacity=48,
    dv=None,
    poison=0.0,
    seed=0,
):
    """q [B, Sq, Hq, D]; a cache holding `seqlens` tokens per sequence (the unused slots filled
    with `poison`); new k, v [B, Sn, Hkv, D] or None. Paged: pages handed out in a shuffled order,
    the block table padded with -1 past what each sequence needs (as Transformers pads it)."""
    gen = torch.Generator().manual_seed(seed)
    dv = head_dim if dv is None else dv
    batch = len(seqlens)
    q = _rand(gen, batch, q_length, hq, head_dim, dtype=dtype, device=device)
    k = v = None
    if new_tokens:
        k = _rand(gen, batch, new_tokens, hkv, head_dim, dtype=dtype, device=device)
        v = _rand(gen, batch, new_tokens, hkv, dv, dtype=dtype, device=device)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    if not paged:
        k_cache = torch.full((batch, capacity, hkv, head_dim), poison, dtype=dtype, device=device)
        v_cache = torch.full((batch, capacity, hkv, dv), poison, dtype=dtype, device=device)
        for b, n in enumerate(seqlens):
            k_cache[b, :n] = _rand(gen, n, hkv, head_dim, dtype=dtype, device=device)
            v_cache[b, :n] = _rand(gen, n, hkv, dv, dtype=dtype, device=device)
        return q, k_cache, v_cache, cache_seqlens, k, v, None
    max_blocks = capacity // page_size
    num_blocks = batch * max_blocks + 2
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks, page_size, hkv, head_dim), poison, dtype=dtype, device=device)
    v_cache = torch.full((num_blocks, page_size, hkv, dv), poison, dtype=dtype, device=device)
    block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(seqlens):
        needed = -(-(n + new_tokens) // page_size)
        block_table[b, :needed] = order[b * max_blocks : b * max_blocks + needed].to(torch.int32)
        for p in range(n):
            page, slot = int(block_table[b, p // page_size]), p % page_size
            k_cache[page, slot] = _rand(gen, hkv, head_dim, dtype=dtype, device=device)
            v_cache[page, slot] = _rand(gen, hkv, dv, dtype=dtype, device=device)
    return q, k_cache, v_cache, cache_seqlens, k, v, block_table.to(device)


def _slot(block_table, page_size, b, position):
    if block_table is None:
        return b, position
    return int(block_table[b, position // page_size]), position % page_size


def _check(q, k_cache, v_cache, cache_seqlens, k, v, block_table, *, grads=False, sinks=None, **kwargs):
    """Runs the function on copies of the cache; compares out, lse against the references (on the
    untouched cache) and the written cache against the expected append."""
    dtype = q.dtype
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k_run, v_run = k_cache.clone(), v_cache.clone()
    got = safeattn.attention_with_kvcache(
        q, k_run, v_run, cache_seqlens, k, v, block_table=block_table, sinks=sinks, return_lse=True, **kwargs
    )
    assert got[0].is_contiguous() and got[0].shape == (*q.shape[:3], v_cache.shape[-1]), "out [B, Sq, Hq, Dv]"
    ref_kwargs = dict(block_table=block_table, sinks=sinks, **kwargs)
    ref = reference.attention_with_kvcache(q, before_k, before_v, cache_seqlens, k, v, **ref_kwargs)
    low = reference.attention_with_kvcache(
        q, before_k, before_v, cache_seqlens, k, v, compute_dtype=low_dtype(dtype), **ref_kwargs
    )
    compare_outputs(dtype, got, ref, low)
    # The append: exactly the new tokens' slots changed, to k and v.
    want_k, want_v = before_k.clone(), before_v.clone()
    if k is not None:
        page_size = k_cache.shape[1]
        for b in range(q.shape[0]):
            for t in range(k.shape[1]):
                slot = _slot(block_table, page_size, b, int(cache_seqlens[b]) + t)
                want_k[slot] = k[b, t]
                want_v[slot] = v[b, t]
    assert torch.equal(k_run.nan_to_num(7.0), want_k.nan_to_num(7.0)), "k_cache after the append is wrong"
    assert torch.equal(v_run.nan_to_num(7.0), want_v.nan_to_num(7.0)), "v_cache after the append is wrong"
    if grads:
        inputs = [t for t in (q, k, v, sinks) if t is not None]
        names = [
            n
            for n, t in zip(("grad_q", "grad_k", "grad_v", "grad_sinks"), (q, k, v, sinks), strict=True)
            if t is not None
        ]
        compare_grads(dtype, names, inputs, got[0], ref[0], low[0])
    return got


# (cache_seqlens, Sq, Sn): decode (1 query, 1 new token), a few tokens, prefill into an empty
# cache, queries over the cache alone (no new tokens), queries longer than the new tokens.
SHAPES = [
    ([0, 5, 17], 1, 1),
    ([3, 0, 30], 4, 4),
    ([0, 0], 17, 17),
    ([1, 20], 1, 0),
    ([7, 12], 3, 1),
]
MASKS = [((-1, -1), True), ((-1, -1), False), ((3, 0), True), ((2, 1), False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(("seqlens", "q_length", "new_tokens"), SHAPES)
@pytest.mark.parametrize(("window_size", "causal"), MASKS)
def test_matches_reference(device, paged, seqlens, q_length, new_tokens, window_size, causal):
    case = _case(seqlens, q_length, new_tokens, 4, 2, 40, torch.float32, device, paged=paged)
    _check(*case, causal=causal, window_size=window_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_gqa_softcap_sinks_gradients(device, paged, dtype):
    q, k_cache, v_cache, seqlens, k, v, table = _case(
        [5, 0, 20], 3, 3, 8, 2, 64, dtype, device, paged=paged, dv=32
    )
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    sinks = torch.randn(8, device=device, requires_grad=True)
    _check(q, k_cache, v_cache, seqlens, k, v, table, causal=True, softcap=5.0, sinks=sinks, grads=True)
    _check(q, k_cache, v_cache, seqlens, k, v, table, window_size=(4, 0), softmax_scale=0.2, grads=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_page_sizes(device, page_size):
    case = _case(
        [0, 40, page_size],
        2,
        2,
        4,
        4,
        32,
        torch.float32,
        device,
        paged=True,
        page_size=page_size,
        capacity=page_size * 3,
    )
    _check(*case, causal=True)


# The gradient through a contiguous cache with NaN in unused slots: the op's backward (the CPU
# kernel at least) multiplies the zero score gradients of masked keys by their NaN K / V rows when
# they share a key tile with visible keys, so grad_q turns NaN. The forward is clean, and the
# paged cache is clean (its gathered copy zeroes the unused slots). An op-level issue.
_CONTIGUOUS_GRAD = pytest.mark.xfail(
    reason="the attention backward leaks NaN from masked keys that share a key tile with visible ones",
    strict=False,
)


# The contiguous cache is read in place: its unused slots past a sequence's length share key
# tiles with visible keys, where the CUDA kernels multiply P = 0 by V (test_attention.py's
# test_cuda_mask_tile_summary: a NaN V behind a masked key of a mixed tile leaks). Expected to
# fail until a kernel bounds its key loop by each sequence's length; the paged copy is zeroed.
_CUDA_CONTIGUOUS_NAN = pytest.mark.xfail(
    reason="CUDA kernels multiply the zero probabilities of masked keys by their V inside mixed tiles",
    strict=False,
)


def _poisoned_call(device, paged):
    # Every slot past each sequence's length (and every page not in the table) holds NaN.
    q, k_cache, v_cache, seqlens, k, v, table = _case(
        [0, 5, 33], 2, 2, 4, 2, 64, torch.float32, device, paged=paged, poison=float("nan")
    )
    q.requires_grad_()
    sinks = torch.randn(4, device=device, requires_grad=True)
    out, lse = safeattn.attention_with_kvcache(
        q, k_cache, v_cache, seqlens, k, v, block_table=table, causal=True, sinks=sinks, return_lse=True
    )
    return out, lse, (q, sinks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_nan_in_unused_slots_never_leaks(request, device, paged):
    if device == "cuda" and not paged:
        request.applymarker(_CUDA_CONTIGUOUS_NAN)  # runs, and says XPASS once a kernel bounds its keys
    out, lse, _ = _poisoned_call(device, paged)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in unused cache slots leaked"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [pytest.param(False, marks=_CONTIGUOUS_GRAD), True])
def test_nan_in_unused_slots_never_leaks_into_gradients(device, paged):
    out, lse, inputs = _poisoned_call(device, paged)
    grads = torch.autograd.grad(out.sum() + lse.sum(), inputs)
    assert not any(g.isnan().any() for g in grads), "NaN in unused cache slots leaked into a gradient"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_empty_cache_rows_are_zero(device, paged):
    # No cached tokens and no new ones: every row sees nothing.
    q, k_cache, v_cache, seqlens, _, _, table = _case(
        [0, 0], 2, 0, 2, 2, 16, torch.float32, device, paged=paged
    )
    out, lse = safeattn.attention_with_kvcache(
        q, k_cache, v_cache, seqlens, block_table=table, return_lse=True
    )
    assert torch.all(out == 0) and torch.all(lse.isneginf()), "an empty cache gives out 0, lse -inf"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_cache_seqlens_beyond_capacity_is_clamped(device, paged):
    # Not checked (a host sync). Documented: clamped into [0, capacity - Sn], so the new tokens
    # overwrite the last slots and the attention covers the whole cache; nothing outside is touched.
    q, k_cache, v_cache, _, k, v, table = _case(
        [10, 10], 1, 2, 2, 2, 16, torch.float32, device, paged=paged, capacity=32
    )
    if paged:
        table = torch.arange(4, device=device, dtype=torch.int32).reshape(2, 2)  # both pages filled
    spare = k_cache.clone()
    beyond = torch.tensor([31, 1000], dtype=torch.int32, device=device)
    out = safeattn.attention_with_kvcache(q, k_cache, v_cache, beyond, k, v, block_table=table)
    clamped = torch.tensor([30, 30], dtype=torch.int32, device=device)
    want = safeattn.attention_with_kvcache(q, spare, v_cache.clone(), clamped, k, v, block_table=table)
    torch.testing.assert_close(out, want, msg="cache_seqlens past capacity must act as capacity - Sn")
    torch.testing.assert_close(k_cache, spare, msg="the clamped write differs")
    negative = torch.tensor([-4, 0], dtype=torch.int32, device=device)
    out = safeattn.attention_with_kvcache(q, k_cache, v_cache, negative, k, v, block_table=table)
    assert not out.isnan().any(), "negative cache_seqlens must act as 0"


@pytest.mark.parametrize("device", DEVICES)
def test_block_table_entries_outside_are_clamped(device):
    # Entries outside [0, num_blocks) read and write a clamped page: wrong data, never out of bounds.
    q, k_cache, v_cache, seqlens, k, v, table = _case(
        [5, 9], 1, 1, 2, 2, 16, torch.float32, device, paged=True
    )
    table = table.clone()
    table[0, 0] = 10_000
    table[1, 0] = -7
    out = safeattn.attention_with_kvcache(q, k_cache, v_cache, seqlens, k, v, block_table=table)
    assert out.shape == (2, 1, 2, 16) and not out.isnan().any()


@pytest.mark.parametrize("device", DEVICES)
def test_int_cache_seqlens_and_flash_interface(device):
    q, k_cache, v_cache, _, k, v, _ = _case([6, 6], 2, 2, 4, 2, 32, torch.float32, device, paged=False)
    as_tensor = torch.tensor([6, 6], dtype=torch.int32, device=device)
    want, want_lse = safeattn.attention_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), as_tensor, k, v, causal=True, return_lse=True
    )
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=6, causal=True, return_softmax_lse=True
    )
    torch.testing.assert_close(out, want, msg="an int cache_seqlens differs from the tensor")
    assert lse.shape == (2, 4, 2)
    torch.testing.assert_close(lse, want_lse)
    # cache_seqlens None: the whole cache is filled.
    full = flash_attn_with_kvcache(q, k_cache[:, :8], v_cache[:, :8])
    want = safeattn.attention_with_kvcache(q, k_cache[:, :8], v_cache[:, :8], 8)
    torch.testing.assert_close(full, want)
    with pytest.raises(NotImplementedError, match="rotary_cos is not implemented"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1, rotary_cos=torch.ones(1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_gradcheck(device):
    for paged in (False, True):
        q, k_cache, v_cache, seqlens, k, v, table = _case(
            [2, 0], 2, 2, 4, 2, 8, torch.float64, device, paged=paged, capacity=32
        )
        sinks = torch.randn(4, dtype=torch.float64, device=device)
        for t in (q, k, v, sinks):
            t.requires_grad_()

        def fn(q, k, v, sinks, table=table, k_cache=k_cache, v_cache=v_cache, seqlens=seqlens):
            out, lse = safeattn.attention_with_kvcache(
                q,
                k_cache.clone(),
                v_cache.clone(),
                seqlens,
                k,
                v,
                block_table=table,
                causal=True,
                window_size=(2, 0),
                softcap=3.0,
                sinks=sinks,
                return_lse=True,
            )
            return out, lse

        assert torch.autograd.gradcheck(fn, (q, k, v, sinks), eps=1e-6, atol=1e-5), f"paged={paged}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.slow
def test_compile_fullgraph_dynamic(device, paged):
    # The in-place append inside a compiled function: the caches are mutated as eagerly.
    def fn(q, k_cache, v_cache, seqlens, k, v, table):
        return safeattn.attention_with_kvcache(
            q, k_cache, v_cache, seqlens, k, v, block_table=table, causal=True, window_size=(5, 0)
        )

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for seqlens, q_length in (([3, 0, 7], 1), ([9, 2], 3)):
        case = _case(seqlens, q_length, q_length, 4, 2, 32, torch.float32, device, paged=paged)
        q, k_cache, v_cache, lengths, k, v, table = case
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want = fn(q, want_k, want_v, lengths, k, v, table)
        got = compiled(q, k_cache, v_cache, lengths, k, v, table)
        torch.testing.assert_close(got, want, msg="compiled output differs from eager")
        torch.testing.assert_close(k_cache, want_k, msg="compiled append differs from eager")
        torch.testing.assert_close(v_cache, want_v, msg="compiled append differs from eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (host sync is a device matter)")
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_no_host_sync(paged):
    case = _case([5, 0, 40], 1, 1, 8, 2, 128, torch.bfloat16, "cuda", paged=paged, capacity=256)
    safeattn.attention_with_kvcache(*case[:6], block_table=case[6], causal=True)  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        safeattn.attention_with_kvcache(*case[:6], block_table=case[6], causal=True, window_size=(64, 0))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _long_cache(paged, dtype, poison=0.0):
    # A cache over many key tiles, lengths ending inside a tile.
    return _case(
        [1000, 3, 511],
        1,
        1,
        8,
        1,
        128,
        dtype,
        "cuda",
        paged=paged,
        page_size=64,
        capacity=1024,
        poison=poison,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_decode_long_cache(paged, dtype):
    _check(*_long_cache(paged, dtype), causal=True)


def _one_token_cache(seqlens, hq, hkv, page_size, capacity):
    """A bf16 D=128 decode step on the GPU: one query and one new token a sequence, a contiguous
    cache (page_size 0) or pages of page_size, NaN in the unused slots."""
    return _case(
        seqlens,
        1,
        1,
        hq,
        hkv,
        128,
        torch.bfloat16,
        "cuda",
        paged=page_size > 0,
        page_size=page_size or 16,
        capacity=capacity,
        poison=float("nan"),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [0, 32, 256])
def test_cuda_decode_long_splits(page_size):
    """Caches past 512 key tiles, where a split takes at least 16 tiles: contiguous, pages of 256
    (each tile in one page: the same splits) and pages of 32 (tiles across pages: 8 tiles a
    split); GQA 8:1 at batch 1-2, lengths ending inside a tile and a page."""
    case = _one_token_cache([32768 + 77, 40000], 8, 1, page_size, 40960)
    _check(*case, causal=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_decode_nan_in_unused_slots(paged, dtype):
    case = _long_cache(paged, dtype, poison=float("nan"))
    out, lse = safeattn.attention_with_kvcache(*case[:6], block_table=case[6], causal=True, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN in unused cache slots leaked"


# The decode kernel's own cases (bf16 / fp16, D 64 / 128, at most 16 query rows per kv head):
# pages smaller and larger than its 64-key tile, GQA groups, a few query tokens, the window and
# softcap and sinks, lengths that end inside a tile, and an empty sequence.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("paged", "page_size"), [(False, 16), (True, 16), (True, 64), (True, 256)])
@pytest.mark.parametrize(("hq", "hkv", "q_length"), [(8, 8, 1), (32, 8, 1), (16, 2, 2), (8, 2, 4)])
def test_cuda_decode_kernel_cases(dtype, head_dim, paged, page_size, hq, hkv, q_length):
    case = _case(
        [700, 0, 65, 300][: 4 if q_length == 1 else 2],
        q_length,
        q_length,
        hq,
        hkv,
        head_dim,
        dtype,
        "cuda",
        paged=paged,
        page_size=page_size,
        capacity=768,
        poison=float("nan"),
    )
    _check(*case, causal=True)
    sinks = torch.randn(hq, device="cuda")
    _check(*case, window_size=(100, 0), softcap=20.0, sinks=sinks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(
    ("seqlens", "capacity", "cluster"), [([500, 3, 77], 4608, False), ([500, 70], 1024, True)]
)
def test_cuda_decode_step_kernels(paged, seqlens, capacity, cluster):
    """A decode step with int32 lengths and table: the append, the split kernel reading the
    cache in place (no gather of the pages, no range arithmetic), then the combine kernel, except
    where the splits merge in a thread block cluster: on sm_90, a short cache with few (batch,
    kv head) pairs."""
    case = _case(seqlens, 1, 1, 32, 8, 128, torch.bfloat16, "cuda", paged=paged, capacity=capacity)
    q, k_cache, v_cache, cache_seqlens, k, v, table = case
    names = cuda_kernel_names(
        lambda: safeattn.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table=table, causal=True
        ),
        warmup=True,
    )
    kinds = ["kvcache_append", "kvcache_append", "attention_decode_split", "attention_decode_combine"]
    if cluster and torch.cuda.get_device_capability()[0] >= 9:
        kinds = kinds[:3]
    assert len(names) == len(kinds) and all(k in n for k, n in zip(kinds, names, strict=True)), names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [0, 16, 256])
@pytest.mark.parametrize("length", [4000, 8000])
def test_cuda_decode_sixteen_split_clusters(page_size, length):
    """Batch 1 over 4 kv heads (GQA 8:1), a cache of 8192 slots (128 key tiles) holding 4001 or
    8001 keys after the append: on sm_90 its 16 splits merge in one thread block cluster
    (step_max_cluster), no combine kernel; elsewhere the combine kernel merges them. Contiguous,
    pages holding whole tiles and pages of 16 (tiles across pages); NaN in the unused slots."""
    case = _one_token_cache([length], 32, 4, page_size, 8192)
    _check(*case, causal=True)
    q, k_cache, v_cache, cache_seqlens, k, v, table = case
    names = cuda_kernel_names(
        lambda: safeattn.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table=table, causal=True
        ),
        warmup=True,
    )
    assert any("attention_decode_split" in n for n in names), names
    if torch.cuda.get_device_capability()[0] == 9:  # H100 / H200 place clusters of 16
        assert not any("attention_decode_combine" in n for n in names), names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [0, 16, 256])
def test_cuda_decode_d64_wave_shape_and_pages(page_size):
    """D=64 with (batch, kv head) pairs filling three quarters of the SMs over a short cache: a
    contiguous cache and pages holding whole key tiles take the one-CTA wave shape (ten tiles in
    flight, DecodeWaveShape<64, 1>) on the GPUs it fits (H100/H200); pages of 16, whose keys are
    looked up one by one, keep the default shape. The values against the reference either way,
    NaN in the unused slots, lengths ending inside a tile and a page, an empty sequence."""
    from safeattn import _testing

    props = torch.cuda.get_device_properties("cuda")
    sms, hkv = props.multi_processor_count, 4
    batch = max(2, 3 * sms // 4 // hkv)
    seqlens = [(977 * b + 300) % 1500 for b in range(batch - 1)] + [0]
    case = _case(
        seqlens,
        1,
        1,
        8 * hkv,
        hkv,
        64,
        torch.bfloat16,
        "cuda",
        paged=page_size > 0,
        page_size=page_size or 16,
        capacity=1536,
        poison=float("nan"),
    )
    _check(*case, causal=True)
    per_block = getattr(props, "shared_memory_per_block_optin", 0)
    if _testing.decode_wave_ctas(64, 1536, batch, hkv, sms, per_block) != 1:
        return  # no room for the shape on this GPU: the values above are the test
    q, k_cache, v_cache, cache_seqlens, k, v, table = case
    names = cuda_kernel_names(
        lambda: safeattn.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table=table, causal=True
        ),
        warmup=True,
    )
    wave = ("DecodeTiles<10, 1, 128", "DecodeTilesILi10ELi1ELi128")
    took = any(w in n for n in names for w in wave)
    assert took == (page_size != 16), names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_decode_one_split_writes_out_itself(paged):
    """Enough (batch, kv head) pairs to fill the GPU: one split each, and the split kernel writes
    out and lse itself (no combine kernel), sinks and empty caches included."""
    seqlens = [(7 * b) % 61 for b in range(256)]
    case = _case(
        seqlens, 1, 1, 8, 8, 64, torch.bfloat16, "cuda", paged=paged, capacity=64, poison=float("nan")
    )
    sinks = torch.randn(8, device="cuda")
    _check(*case, causal=True, sinks=sinks)
    _check(*case, window_size=(5, 0))
    q, k_cache, v_cache, cache_seqlens, k, v, table = case
    names = cuda_kernel_names(
        lambda: safeattn.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table=table, causal=True, sinks=sinks
        ),
        warmup=True,
    )
    assert any("attention_decode_split" in n for n in names), names
    assert not any("attention_decode_combine" in n for n in names), names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("batch", [3, 8])
def test_cuda_decode_step_replays_in_a_cuda_graph(paged, batch):
    """Captured once, replayed with new lengths, queries and tokens written into the same
    tensors (as a serving loop does): each replay matches the eager call on the same inputs.
    On an H100 / H200, batch 3 over 4 kv heads merges its splits in a thread block cluster, and
    batch 8 over 8 kv heads (a 1024-slot cache) leaves each pair too few splits for one: the
    combine kernel, launched with its programmatic dependency (a graph edge of its own)."""
    if batch == 3:
        first, hkv, capacity = [40, 0, 90], 4, 256
        lengths = lambda step: [41 + step, 1 + step, 120 - step]  # noqa: E731
    else:
        first, hkv, capacity = [40, 0, 900, 513, 7, 1000, 64, 300], 8, 1024
        lengths = lambda step: [n + 1 + step for n in first]  # noqa: E731
    case = _case(first, 1, 1, 16, hkv, 64, torch.float16, "cuda", paged=paged, capacity=capacity)
    q, k_cache, v_cache, seqlens, k, v, table = case
    kwargs = dict(block_table=table, causal=True, return_lse=True)
    safeattn.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), seqlens, k, v, **kwargs)  # warm-up
    graph_k, graph_v = k_cache.clone(), v_cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = safeattn.attention_with_kvcache(q, graph_k, graph_v, seqlens, k, v, **kwargs)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        seqlens.copy_(torch.tensor(lengths(step), dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen))
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        want_k, want_v = graph_k.clone(), graph_v.clone()
        want = safeattn.attention_with_kvcache(q, want_k, want_v, seqlens, k, v, **kwargs)
        graph.replay()
        torch.testing.assert_close(got, want, msg=f"replay {step}")
        assert torch.equal(graph_k, want_k) and torch.equal(graph_v, want_v), f"replay {step}: the append"


def test_private_op_rejects_what_would_leave_the_cache():
    """_attention_kvcache is reached through attention_with_kvcache, but a direct call with bad
    indices still gets an error naming the argument, not a read outside a tensor."""
    q, kc, vc = torch.randn(2, 1, 4, 8), torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    seq = torch.tensor([1, 2], dtype=torch.int32)
    op = torch.ops.safeattn._attention_kvcache
    args = (None, None, None, None, False, -1, -1, 0.0, None)
    with pytest.raises(ValueError, match="cache_seqlens must be a contiguous 1-D int32"):
        op(q, kc, vc, seq.long(), *args)
    with pytest.raises(ValueError, match="cache_seqlens must have 2 entries"):
        op(q, kc, vc, seq[:1], *args)
    with pytest.raises(ValueError, match="block_table must be a contiguous 2-D int32"):
        op(q, kc, vc, seq, None, None, torch.zeros(2, 3), *args[3:])
    with pytest.raises(ValueError, match="do not fit the cache"):
        op(q, kc, vc, seq, torch.randn(2, 11, 2, 8), torch.randn(2, 11, 2, 8), *args[2:])


def _bad_inputs():
    q = torch.randn(2, 1, 4, 8)
    kc, vc = torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    pages = torch.randn(6, 16, 2, 8)
    table = torch.zeros(2, 3, dtype=torch.int32)
    seq = torch.tensor([1, 2], dtype=torch.int32)
    k1, v1 = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    return [
        ((q[0], kc, vc, seq), {}, "attention_with_kvcache: q must be 4-D"),
        ((q, kc[0], vc, seq), {}, "attention_with_kvcache: k_cache must be 4-D"),
        ((q, kc.half(), vc, seq), {}, "k_cache has dtype torch.float16 but q has torch.float32"),
        ((q, kc, vc[:, :5], seq), {}, "v_cache must match k_cache"),
        (
            (q, torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16), seq),
            {},
            "k_cache has head_dim 16 but q has 8",
        ),
        (
            (q, torch.randn(2, 10, 3, 8), torch.randn(2, 10, 3, 8), seq),
            {},
            re.escape("q's heads (4) must be a multiple"),
        ),
        ((q, torch.randn(3, 10, 2, 8), torch.randn(3, 10, 2, 8), seq), {}, "k_cache has batch 3 but q has 2"),
        ((q, kc, vc, seq.float()), {}, "cache_seqlens must have dtype int32"),
        ((q, kc, vc, seq[:1]), {}, "cache_seqlens has 1 entries but q has batch 2"),
        ((q, kc, vc, seq, k1), {}, "k and v must be given together"),
        ((q, kc, vc, seq, k1[:, :, :1], v1), {}, re.escape("k must be [2, new_tokens, 2, 8]")),
        ((q, kc, vc, seq, k1, v1[:, :, :, :4]), {}, re.escape("v must be [2, 1, 2, 8]")),
        (
            (q, kc, vc, seq, torch.randn(2, 11, 2, 8), torch.randn(2, 11, 2, 8)),
            {},
            "k holds 11 new tokens but the cache holds at most 10",
        ),
        ((q, pages, pages, seq), {"block_table": table.float()}, "block_table must have dtype int32"),
        ((q, pages, pages, seq), {"block_table": table[:1]}, "block_table has batch 1 but q has 2"),
        (
            (q, torch.randn(6, 8, 2, 8), torch.randn(6, 8, 2, 8), seq),
            {"block_table": table},
            re.escape("page_size (k_cache.shape[1]) must be 16 to 256, got 8"),
        ),
        (
            (q, torch.randn(2, 512, 2, 8), torch.randn(2, 512, 2, 8), seq),
            {"block_table": table},
            "must be 16 to 256, got 512",
        ),
        ((q, kc, vc, seq), {"window_size": (0, -3)}, "window_size entries must be >= 0"),
    ]


@pytest.mark.parametrize(("args", "kwargs", "message"), _bad_inputs())
def test_bad_inputs(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        safeattn.attention_with_kvcache(*args, **kwargs)


def _direct(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None, window=(-1, -1), **kwargs):
    """safeattn._C._attention_kvcache: attention_with_kvcache's C++ route, (out, lse) or NotImplemented."""
    return safeattn._C._attention_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k,
        v,
        block_table,
        kwargs.get("softmax_scale"),
        kwargs.get("causal", False),
        window,
        kwargs.get("softcap", 0.0),
        kwargs.get("sinks"),
    )


class _PythonRoute(torch.overrides.TorchFunctionMode):
    """Under a __torch_function__ mode the C++ route declines: attention_with_kvcache's Python
    checks and torch.ops call take every step."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_direct_route_matches_the_python_route(device, paged):
    """A step without gradients runs in C++ from attention_with_kvcache on (safeattn._C.
    _attention_kvcache) with int32, int64 or int lengths and int32 or int64 tables: the same out,
    lse and appended cache as the Python route's checks and torch.ops call, and both the float64
    reference's (_check)."""
    # NaN in the unused slots where the kernels never meet it there (_CUDA_CONTIGUOUS_NAN: a CUDA
    # kernel reading a contiguous cache in place multiplies masked keys' zero weights by their V).
    poison = 1e4 if device == "cuda" and not paged else float("nan")
    q, k_cache, v_cache, seqlens, k, v, table = _case(
        [5, 0, 17], 2, 1, 4, 2, 32, torch.float32, device, paged=paged, poison=poison
    )
    kwargs = dict(causal=True, window_size=(6, 0), softcap=5.0)
    _check(q, k_cache, v_cache, seqlens, k, v, table, **kwargs)
    with _PythonRoute():
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want = safeattn.attention_with_kvcache(
            q, want_k, want_v, seqlens, k, v, block_table=table, return_lse=True, **kwargs
        )
    tables = (table, table.long()) if paged else (None,)
    for lengths in (seqlens, seqlens.long()):
        for tab in tables:
            got_k, got_v = k_cache.clone(), v_cache.clone()
            got = _direct(q, got_k, got_v, lengths, k, v, tab, causal=True, window=[6, 0], softcap=5.0)
            assert got is not NotImplemented, (lengths.dtype, None if tab is None else tab.dtype)
            for name, a, b in (
                ("out", got[0], want[0]),
                ("lse", got[1], want[1]),
                ("k_cache", got_k, want_k),
            ):
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), name
            assert torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0)), "v_cache"
    # One int length for every sequence: as the tensor of it.
    q1, k1, v1 = (
        q[:, :1],
        k_cache[:, :20] if not paged else k_cache,
        v_cache[:, :20] if not paged else v_cache,
    )
    got = _direct(q1, k1.clone(), v1.clone(), 9, None, None, table)
    want = safeattn.attention_with_kvcache(
        q1, k1, v1, torch.full_like(seqlens, 9), block_table=table, return_lse=True
    )
    assert got is not NotImplemented
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_direct_route_declines_to_the_python_route():
    """What the C++ route does not take it returns NotImplemented for, having written nothing:
    a gradient asked for, a window entry below -1, a page size out of 16..256, arguments its
    checks refuse (the Python route then raises the API's message), a tensor subclass."""
    q, k_cache, v_cache, seqlens, k, v, _ = _case([3, 4], 1, 1, 4, 2, 8, torch.float32, "cpu", paged=False)
    before = k_cache.clone()
    assert _direct(q.requires_grad_(), k_cache, v_cache, seqlens, k, v) is NotImplemented
    with torch.no_grad():
        assert _direct(q, k_cache.clone(), v_cache.clone(), seqlens, k, v) is not NotImplemented
    q = q.detach()
    assert _direct(q, k_cache, v_cache, seqlens, k, v, window=(0, -3)) is NotImplemented
    assert _direct(q, k_cache, v_cache, seqlens[:1], k, v) is NotImplemented
    assert _direct(q, k_cache, v_cache, seqlens, k[:, :, :1], v) is NotImplemented
    assert _direct(q, k_cache, v_cache, seqlens.float(), k, v) is NotImplemented
    assert _direct(q, k_cache, v_cache, 2**40, k, v) is NotImplemented
    assert _direct(q, k_cache, v_cache, seqlens, k, v, window=(0, 1.0)) is NotImplemented
    pages = torch.zeros(4, 8, 2, 8)
    table = torch.zeros(2, 3, dtype=torch.int32)
    assert _direct(q, pages, pages.clone(), seqlens, k, v, table) is NotImplemented
    assert torch.equal(pages, torch.zeros_like(pages)), "a declined call wrote into the pages"
    assert torch.equal(k_cache, before), "a declined call wrote into the cache"

    class Sub(torch.Tensor):
        pass

    assert _direct(q.as_subclass(Sub), k_cache, v_cache, seqlens, k, v) is NotImplemented
