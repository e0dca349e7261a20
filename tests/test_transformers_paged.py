"""Transformers' continuous batching with ``attn_implementation="paged|safeattn"``: greedy
``generate_batch`` gives token for token what ``"paged|sdpa"`` gives, on tiny random models.

On CPU, Transformers sizes the paged cache from the free memory, which it reads with psutil
(without it the memory counts as 0 and no cache fits): the tests give the cache's sizes
explicitly and report 1 GiB free. Continuous batching's decode fast path (block tables,
``flash_attn_with_kvcache``) is only taken by FlashAttention 2/3 on CUDA; for every other
implementation Transformers turns it off (``max_blocks_per_request = 0``), so ``paged|safeattn``
runs every batch through ``cache.update`` and ``varlen_attention``. The block-table branch is
tested below with a cache and table built by hand. Last, Transformers' Hub-kernel route
(``attn_implementation="org/repo"``) with ``safeattn.flash_attn_interface`` as the loaded module.
"""

from __future__ import annotations

import pytest
import safeattn
import safeattn.transformers as safeattn_transformers
import torch
import transformers
from _transformers_models import make_config, make_model
from packaging.version import Version

_cb_cache = pytest.importorskip(
    "transformers.generation.continuous_batching.cache",
    reason=f"transformers {transformers.__version__} has no continuous batching module",
)
if not hasattr(transformers, "ContinuousBatchingConfig") or not hasattr(
    _cb_cache, "get_device_and_memory_breakdown"
):
    pytest.skip(
        f"transformers {transformers.__version__}: its continuous batching has no `paged|<impl>` route "
        "(4.57 runs fixed names, sdpa_paged / paged_attention, with no ContinuousBatchingConfig); "
        "paged|safeattn follows 5.x's API",
        allow_module_level=True,
    )

# Transformers 5.23 dropped the `paged|` prefix: its continuous batching runs paged|eager, sdpa and
# implementations named flash-something only, and refuses paged|safeattn (after stripping the
# prefix, "safeattn") with a ValueError. The Hub-kernel route below is the way there from then on.
TAKES_PAGED_SAFEATTN = Version(transformers.__version__) < Version("5.23")

# Mixed prompt lengths: 1 token, odd lengths, and one longer than a batch's token budget
# (chunked prefill: a later chunk's queries sit after keys already in the cache).
PROMPTS = [[5, 6, 7], [8], list(range(3, 20)), [9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(20, 61))]


@pytest.fixture
def cpu_memory(monkeypatch):
    """1 GiB free for the paged cache (psutil absent: Transformers would read 0)."""
    monkeypatch.setattr(
        _cb_cache, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), 2**30, 0, 0)
    )


_TAKES_USE_CUDA_GRAPH = "use_cuda_graph" in getattr(
    getattr(transformers, "ContinuousBatchingConfig", None), "__dataclass_fields__", {}
)


def _generate(config, implementation, max_new_tokens=12):
    model = make_model(config, implementation)
    generation_config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    # The models are on the CPU: on a host with a GPU, Transformers would otherwise turn CUDA
    # graphs on for the flash-style routes (no attention mask) and capture CPU work.
    no_graphs = {"use_cuda_graph": False} if _TAKES_USE_CUDA_GRAPH else {}
    cb_config = transformers.ContinuousBatchingConfig(
        block_size=16, num_blocks=64, max_batch_tokens=32, **no_graphs
    )
    out = model.generate_batch(
        PROMPTS, generation_config=generation_config, continuous_batching_config=cb_config
    )
    return {request: result.generated_tokens for request, result in out.items()}


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_generate_batch_matches_paged_sdpa(cpu_memory, monkeypatch, name):
    config = make_config(name)
    if not TAKES_PAGED_SAFEATTN:
        with pytest.raises(ValueError, match="not supported for continuous batching"):
            _generate(config, safeattn_transformers.PAGED_NAME)
        return
    calls = []
    forward = safeattn_transformers.paged_attention_forward

    def counted(*args, **kwargs):
        calls.append(kwargs.get("block_table") is not None)
        return forward(*args, **kwargs)

    transformers.AttentionInterface.register(safeattn_transformers.PAGED_NAME, counted)
    try:
        want = _generate(config, "paged|sdpa")
        got = _generate(config, safeattn_transformers.PAGED_NAME)
    finally:
        transformers.AttentionInterface.register(safeattn_transformers.PAGED_NAME, forward)
    assert calls, "paged|safeattn was never called"
    assert len(want) == len(PROMPTS) and all(
        len(t) == 12 for t in want.values()
    ), "paged|sdpa generated too little"
    assert got == want, f"paged|safeattn generated other tokens than paged|sdpa: {got} vs {want}"


class _PagedCache:
    """The parts of Transformers' PagedAttentionCache that the block-table branch reads."""

    def __init__(self, num_blocks, block_size, kv_heads, head_dim):
        self.block_size, self.num_key_value_heads, self.head_dim = block_size, kv_heads, head_dim
        self.key_cache = [torch.randn(num_blocks * block_size, kv_heads, head_dim)]
        self.value_cache = [torch.randn(num_blocks * block_size, kv_heads, head_dim)]
        self.layer_index_to_group_indices = {0: (0, 0)}


class _Layer(torch.nn.Module):
    def __init__(self, sliding_window=None):
        super().__init__()
        self.layer_idx, self.scaling, self.sliding_window = 0, 0.25, sliding_window


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_block_table_branch_matches_varlen(sliding_window):
    # Decode-only batch of 3 sequences (cache lengths 0, 9 and 20 before this step): the
    # block-table branch appends each new token in place and matches varlen attention over the
    # sequences' keys.
    cache = _PagedCache(8, 16, 2, 16)
    lengths = [0, 9, 20]
    block_table = torch.tensor([[[3, -1], [0, -1], [5, 1]]], dtype=torch.int32)  # [groups, B, max_blocks]
    q = torch.randn(1, 4, 3, 16)
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    cu_k = torch.tensor([0, 1, 11, 32], dtype=torch.int32)  # lengths + the new token
    cu_q = torch.arange(4, dtype=torch.int32)
    pages = cache.key_cache[0].view(8, 16, 2, 16)
    values = cache.value_cache[0].view(8, 16, 2, 16)
    # The sequences' keys after the append, for the varlen reference.
    keys_all, values_all = [], []
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        idx = (block_table[0, b, pos // 16].long(), pos % 16)
        keys_all += [pages[idx], k[0, :, b][None]]
        values_all += [values[idx], v[0, :, b][None]]
    want = safeattn.varlen_attention(
        q[0].transpose(0, 1),
        torch.cat(keys_all),
        torch.cat(values_all),
        cu_q,
        cu_k,
        scale=0.25,
        causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
    )
    out, _ = safeattn_transformers.paged_attention_forward(
        _Layer(sliding_window),
        q,
        k,
        v,
        None,
        cache=cache,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_seqlen_q=1,
        max_seqlen_k=21,
        block_table=block_table,
    )
    torch.testing.assert_close(out, want, msg="the block-table branch differs from varlen attention")
    assert torch.equal(
        pages[1, 4], k[0, :, 2]
    ), "the new token of sequence 2 (position 20) must land at page 1, slot 4"


def test_needs_the_paged_cache():
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ValueError, match="without a paged attention cache"):
        safeattn_transformers.paged_attention_forward(_Layer(), q, q[:, :2], q[:, :2], None)


@pytest.fixture
def hub_kernel(monkeypatch):
    """Transformers' Hub-kernel route (``attn_implementation="org/repo"``) loading
    safeattn.flash_attn_interface as the kernel module: the ``kernels`` package's download is
    replaced by the module itself (no network in the tests)."""
    import safeattn.flash_attn_interface as interface
    import transformers.integrations.hub_kernels as hub_kernels

    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda: True)
    monkeypatch.setattr(hub_kernels, "get_kernel", lambda *args, **kwargs: interface)
    return "safeattn-org/flash-interface"


def test_hub_kernel_route_forward(hub_kernel):
    # The flash route unpads the right-padded batch and calls flash_attn_varlen_func.
    from _transformers_models import padded_batch

    config = make_config("llama")
    input_ids, attention_mask = padded_batch("right")
    with torch.no_grad():
        want = make_model(config, "sdpa")(input_ids=input_ids, attention_mask=attention_mask).logits
        got = make_model(config, hub_kernel)(input_ids=input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    torch.testing.assert_close(
        got[keep], want[keep], atol=1e-5, rtol=1e-5, msg="the Hub-kernel route differs from sdpa"
    )


def test_hub_kernel_route_generate_batch(cpu_memory, hub_kernel):
    # Transformers' own paged wrapper (flash_paged.py) calling the module's flash_attn_varlen_func.
    config = make_config("llama")
    assert _generate(config, f"paged|{hub_kernel}") == _generate(config, "paged|sdpa")
