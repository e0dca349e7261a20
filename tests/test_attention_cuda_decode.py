"""The split-KV decode path of the CUDA forward (csrc/ops/cuda/attention_decode_kernel.cu), taken
for at most 16 query rows per kv head (group x Q): the kernels must actually run, and match the
float64 reference with every feature of the op (GQA, both causal alignments, padding and fully
masked rows, learnable bias, softcap, sinks, NaN rules), the backward included (it reads the
decode path's out and lse).

Tolerance: the rule of tests/test_attention.py, through its helper.
"""

from __future__ import annotations

import pytest
import safeattn
import torch
from conftest import cuda_kernel_names
from test_attention import _check_against_reference, _qkv

_HAS_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key("safeattn::attention", "CUDA")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _HAS_KERNEL),
    reason="needs a CUDA GPU and the CUDA attention kernel registered",
)

DEVICE = "cuda"
LOW_DTYPES = [torch.bfloat16, torch.float16]

# (batch, query heads, kv heads, Q, KV): GQA 8:1 at one token, multi-head with many splits,
# two tokens of GQA 4:1 (8 rows), a single key, a partial key tile, GQA 16:1 and four tokens of
# GQA 4:1 (16 rows: the most one CTA holds), a long cache split unevenly.
SHAPES = [
    (2, 8, 1, 1, 1000),
    (3, 4, 4, 1, 5000),
    (2, 8, 2, 2, 777),
    (1, 2, 2, 1, 1),
    (2, 4, 1, 1, 63),
    (2, 16, 1, 1, 1201),
    (1, 8, 2, 4, 300),
    (1, 4, 1, 1, 40001),
]


def test_decode_kernels_run_for_at_most_16_rows_per_kv_head():
    def call(hq, q_len):
        q, k, v = _qkv(2, hq, 1, q_len, 1000, 128, torch.bfloat16, DEVICE)
        with torch.no_grad():
            safeattn.attention(q, k, v, enable_gqa=True)

    names = cuda_kernel_names(lambda: call(16, 1))
    assert any("attention_decode_split" in n for n in names), f"no decode split kernel among {names}"
    names = cuda_kernel_names(lambda: call(16, 2))  # 32 rows per kv head: the prefill kernel
    assert not any("attention_decode" in n for n in names), f"decode kernels ran for 32 rows: {names}"


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("batch", "hq", "hkv", "q_len", "kv_len"), SHAPES)
def test_matches_reference(batch, hq, hkv, q_len, kv_len, head_dim, dtype):
    q, k, v = _qkv(batch, hq, hkv, q_len, kv_len, head_dim, dtype, DEVICE, seed=kv_len + head_dim)
    # The decode alignment: the new tokens are the last of the cache (bottom-right causal).
    _check_against_reference(q, k, v, enable_gqa=hq != hkv, is_causal=True, q_offset=kv_len - q_len)


@pytest.mark.parametrize("offsets", [(0, 0), (0, 40), (3000, 0)])
def test_causal_hides_keys(offsets):
    # Top-left alignment hides all but the first keys; kv_offset > q_offset hides every key of the
    # first query (an empty row); a large q_offset shows them all.
    q_offset, kv_offset = offsets
    q, k, v = _qkv(2, 8, 2, 2, 3000, 128, torch.bfloat16, DEVICE)
    _check_against_reference(
        q, k, v, enable_gqa=True, is_causal=True, q_offset=q_offset, kv_offset=kv_offset, check_lse_grad=True
    )


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_padding_mask_and_empty_rows(dtype):
    batch, kv_len = 3, 2000
    keep = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
    keep[1, ..., :700] = False  # left padding
    keep[2] = False  # nothing to attend: out 0, lse -inf, gradients 0
    keep = keep.to(DEVICE)
    q, k, v = _qkv(batch, 8, 1, 1, kv_len, 128, dtype, DEVICE)
    _check_against_reference(q, k, v, attn_mask=keep, enable_gqa=True, check_lse_grad=True)
    out, lse = safeattn.attention(q, k, v, attn_mask=keep, enable_gqa=True)
    assert torch.all(out[2] == 0), "a fully masked row must be exactly 0"
    assert torch.all(lse[2].isneginf()), "a fully masked row must have lse -inf"


@pytest.mark.parametrize("q_len", [1, 2])
def test_learnable_bias(q_len):
    # Q=2: each of a kv head's 8 rows (4 heads x 2 queries) reads its own mask row.
    q, k, v = _qkv(2, 8, 2, q_len, 1500, 64, torch.bfloat16, DEVICE)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(2, 8, q_len, 1500, generator=gen)
    bias[..., 100:300] = float("-inf")
    bias[..., -1, 1000:1400] = float("-inf")  # the last query hides more than the others
    bias = bias.to(DEVICE).requires_grad_()
    _check_against_reference(q, k, v, attn_mask=bias, enable_gqa=True, extra_grad_inputs=(bias,))


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_softcap_and_sinks(dtype):
    q, k, v = _qkv(2, 8, 1, 1, 2500, 128, dtype, DEVICE)
    with torch.no_grad():
        q.mul_(4)  # large scores, so that the cap matters
    sinks = torch.randn(8, device=DEVICE, requires_grad=True)
    keep = torch.ones(2, 1, 1, 2500, dtype=torch.bool, device=DEVICE)
    keep[1] = False  # an empty row with sinks: out 0, lse = the sink logit
    _check_against_reference(
        q,
        k,
        v,
        attn_mask=keep,
        enable_gqa=True,
        softcap=3.0,
        sinks=sinks,
        check_lse_grad=True,
        extra_grad_inputs=(sinks,),
    )


def test_transposed_cache_views():
    # Transformers' [B, S, H, D].transpose(1, 2) views, read in place.
    q, k, v = _qkv(2, 8, 2, 1, 900, 128, torch.bfloat16, DEVICE, transposed=True)
    assert not k.is_contiguous()
    _check_against_reference(q, k, v, enable_gqa=True)


def test_nan_poisoned_padding_never_leaks():
    # Every input is a view into a NaN-filled buffer, and the mask hides NaN behind -inf.
    batch, hq, hkv, kv_len, d = 2, 8, 2, 1100, 128

    def poisoned(h, s):
        big = torch.full((batch, s + 3, h + 1, d + 16), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        view = big[:, 1 : s + 1, :h, 8 : 8 + d].transpose(1, 2)
        view.copy_(torch.randn(batch, h, s, d))
        return view

    q, k, v = poisoned(hq, 1), poisoned(hkv, kv_len), poisoned(hkv, kv_len)
    bias = torch.randn(batch, 1, 1, kv_len, device=DEVICE)
    bias[0, ..., :50] = float("-inf")
    k[0, :, :50] = float("nan")  # hidden by the mask: must not reach the row
    out, lse = safeattn.attention(q, k, v, bias, enable_gqa=True)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN leaked into the output"


def test_nan_score_reaches_its_row_only():
    q, k, v = _qkv(1, 8, 1, 1, 700, 64, torch.float16, DEVICE)
    q = q.detach().clone()
    q[0, 3, 0, 5] = float("nan")
    out, lse = safeattn.attention(q, k, v, enable_gqa=True)
    assert out[0, 3].isnan().all() and lse[0, 3].isnan().all(), "a NaN query must make its row NaN"
    others = [h for h in range(8) if h != 3]
    assert not out[0, others].isnan().any(), "NaN must stay in its row"


# The decode wave shapes (DecodeWaveShape in attention_decode.cuh): (head dim, CTAs an SM) -> the
# DecodeTiles arguments as the kernel's name spells them, demangled or mangled.
WAVE_SHAPES = {
    (128, 1): ("DecodeTiles<4, 1, 128", "DecodeTilesILi4ELi1ELi128"),
    (64, 1): ("DecodeTiles<10, 1, 128", "DecodeTilesILi10ELi1ELi128"),
    (64, 2): ("DecodeTiles<6, 1, 128", "DecodeTilesILi6ELi1ELi128"),
}


@pytest.mark.parametrize("shape", sorted(WAVE_SHAPES))
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_one_wave_of_kv_heads(dtype, shape):
    """(batch, kv head) pairs filling three quarters of a wave (SMs x the shape's CTAs an SM) over a
    short cache take the head dim's wave shape (wave_config_ctas in attention_decode.cuh), one split
    a pair, on GPUs where it fits (H100/H200; elsewhere the test checks the values alone). Left
    padding of every length, a batch with no key, two query tokens, bottom-right causal."""
    from safeattn import _testing

    head_dim, ctas = shape
    props = torch.cuda.get_device_properties(DEVICE)
    sms = props.multi_processor_count
    hkv, q_len, kv_len = 4, 2, 1500
    batch = max(2, 3 * sms * ctas // 4 // hkv)
    keep = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
    for b in range(batch):
        keep[b, ..., : b * kv_len // batch] = False
    keep[-1] = False
    keep = keep.to(DEVICE)
    q, k, v = _qkv(batch, 4 * hkv, hkv, q_len, kv_len, head_dim, dtype, DEVICE, seed=batch)
    kwargs = {"attn_mask": keep, "enable_gqa": True, "is_causal": True, "q_offset": kv_len - q_len}
    _check_against_reference(q, k, v, **kwargs)

    per_block = getattr(props, "shared_memory_per_block_optin", 0)
    if _testing.decode_wave_ctas(head_dim, kv_len, batch, hkv, sms, per_block) != ctas:
        return  # a GPU without room for the shape: the values above are the test

    def call():
        with torch.no_grad():
            safeattn.attention(q, k, v, **kwargs)

    names = cuda_kernel_names(call)
    wave = WAVE_SHAPES[shape]
    assert any(w in n for n in names for w in wave), f"the wave decode shape did not run: {names}"
