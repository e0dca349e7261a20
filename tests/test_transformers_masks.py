"""The "safeattn" mask function against Transformers' own sdpa and eager masks, and the mask
reader (safeattn._mask_reader) against every mask the supported models build.

Runs against Transformers 5.x and 4.57.x (the mask-function keywords differ; `mask_kwargs` and
`create` speak the installed version's). The cases include those of Transformers' own
`tests/utils/test_masking_utils.py` (packed sequences, chunked attention with left padding at
prefill and at decode, the non-packed skip, the bidirectional skip), compared here with what
Transformers' sdpa mask returns for the same call, None included.

The reader tests fail when a Transformers release renames or changes what the reader reads (a
factory, a closure's free variable): every mask that the supported models and Transformers'
create_*_mask functions build must be recognised, not merely fall back correctly.
"""

from __future__ import annotations

import inspect
import itertools
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import safeattn._mask_reader as _mask_reader  # noqa: E402
import safeattn.transformers as st  # noqa: E402  registers "safeattn"
from _transformers_models import (  # noqa: E402
    MODELS,
    make_config,
    make_model,
    packed_batch,
    padded_batch,
)
from safeattn._mask_reader import (  # noqa: E402
    MaskDescription,
    NotRecognised,
    read_mask_function,
    recognised_factories,
)
from transformers import masking_utils as mu  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

IS_TF5 = "q_length" in inspect.signature(mu.sdpa_mask).parameters
needs_tf5 = pytest.mark.skipif(
    not IS_TF5,
    reason=f"5.x API (q_offset, bidirectional and block masks), not in transformers {transformers.__version__}",
)


def mask_kwargs(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, **extra):
    """The keywords Transformers passes to a mask interface, in the installed version's form."""
    if IS_TF5:
        kw = dict(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            use_vmap=False,
            device="cpu",
        )
    else:
        start = int(q_offset)
        kw = dict(
            batch_size=batch_size,
            cache_position=torch.arange(start, start + q_length),
            kv_length=kv_length,
            kv_offset=kv_offset,
        )
    kw.update(dtype=torch.float32, config=None)
    kw.update(extra)
    return kw


def assert_same_mask(ours, theirs, what):
    if theirs is None:
        assert ours is None, f"{what}: Transformers returns None, safeattn a mask"
        return
    assert ours is not None, f"{what}: Transformers returns a mask, safeattn None"
    assert ours.dtype == theirs.dtype, f"{what}: dtype {ours.dtype} != {theirs.dtype}"
    theirs = theirs.expand(ours.shape)
    mismatch = (ours != theirs).nonzero()
    assert mismatch.numel() == 0, f"{what}: masks differ at (b, h, q, kv) {mismatch[:5].tolist()}"


# ---- a grid of compositions, offsets and padding against sdpa_mask / eager_mask directly ----
B, L = 2, 16  # ids are L wide: enough for every position below
PACKED = torch.tensor([[0] * 5 + [1] * 4 + [2] * 7, [0] * 9 + [1] * 7])
BLOCKS = torch.tensor([[-1, 0, 0, 0, -1, -1, 1, 1, -1, 2, 2, 2, 2, -1, -1, -1], [3] * 4 + [-1] * 8 + [4] * 4])
LEFT = torch.tensor([3, 0])  # chunk left padding per row


def _mask_functions():
    fns = {
        "causal": mu.causal_mask_function,
        "sliding": mu.sliding_window_causal_mask_function(3),
        "chunked": mu.chunked_causal_mask_function(4, LEFT),
        "chunked_no_pad": mu.chunked_causal_mask_function(3, torch.zeros(B, dtype=torch.long)),
        "packed": mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(PACKED)),
        "sliding_packed": mu.and_masks(
            mu.sliding_window_causal_mask_function(4), mu.packed_sequence_mask_function(PACKED)
        ),
        "nested": mu.and_masks(mu.and_masks(mu.causal_mask_function), mu.sliding_window_overlay(5)),
        "padding_inside": mu.and_masks(
            mu.causal_mask_function, mu.padding_mask_function(torch.arange(L).expand(B, L) % 5 != 1)
        ),
        "chunk_and_sliding": mu.and_masks(
            mu.chunked_causal_mask_function(6, LEFT), mu.sliding_window_overlay(3)
        ),
    }
    if IS_TF5:
        fns.update(
            {
                "bidirectional": mu.bidirectional_mask_function,
                "sliding_bidirectional": mu.sliding_window_bidirectional_mask_function(2),
                "causal_and_bidirectional_window": mu.and_masks(
                    mu.causal_mask_function, mu.sliding_window_bidirectional_overlay(2)
                ),
                "block": mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(BLOCKS)),
                "packed_block": mu.or_masks(
                    mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(PACKED)),
                    mu.blockwise_overlay(BLOCKS),
                ),
                "sliding_block_reversed": mu.or_masks(
                    mu.blockwise_overlay(BLOCKS), mu.sliding_window_causal_mask_function(2)
                ),
            }
        )
    return fns


def _padding_masks():
    left = torch.ones(B, L, dtype=torch.bool)
    left[0, :3] = False
    right = torch.ones(B, L, dtype=torch.bool)
    right[1, 11:] = False
    return {
        "none": None,
        "all_ones": torch.ones(B, L, dtype=torch.bool),
        "left": left,
        "right": right,
        "narrow": torch.ones(B, 6, dtype=torch.bool),
    }


# (q_length, kv_length, q_offset, kv_offset): prefill, decode, chunked prefill after a cache,
# a sliding cache whose first key sits at kv_offset, a static cache prefill (keys past the queries)
SIZES = [(7, 7, 0, 0), (1, 9, 8, 0), (3, 10, 7, 0), (4, 6, 10, 8), (5, 12, 0, 0), (1, 12, 6, 0)]
FUNCTIONS = _mask_functions()
PADDINGS = _padding_masks()


@pytest.mark.parametrize("fn_name", list(FUNCTIONS))
@pytest.mark.parametrize("allow_skip", [True, False])
def test_mask_grid_matches_transformers(fn_name, allow_skip):
    fn = FUNCTIONS[fn_name]
    local_size = {"sliding": 3, "chunked": 4, "chunked_no_pad": 3, "sliding_packed": 4}.get(fn_name)
    for (q_length, kv_length, q_offset, kv_offset), (pad_name, pad) in itertools.product(
        SIZES, PADDINGS.items()
    ):
        kw = mask_kwargs(
            B,
            q_length,
            kv_length,
            q_offset,
            kv_offset,
            mask_function=fn,
            attention_mask=pad,
            allow_is_causal_skip=allow_skip,
            local_size=local_size,
        )
        what = f"{fn_name} sizes={(q_length, kv_length, q_offset, kv_offset)} padding={pad_name}"
        assert_same_mask(st.sdpa_mask(**kw), mu.sdpa_mask(**kw), "sdpa " + what)
        assert_same_mask(st.eager_mask(**kw), mu.eager_mask(**kw), "eager " + what)


@needs_tf5
def test_bidirectional_skip_flag_matches_transformers():
    for fn_name, pad_name in itertools.product(["bidirectional", "sliding_bidirectional"], PADDINGS):
        for allow in (True, False):
            kw = mask_kwargs(
                B,
                7,
                7,
                mask_function=FUNCTIONS[fn_name],
                attention_mask=PADDINGS[pad_name],
                allow_is_causal_skip=False,
                allow_is_bidirectional_skip=allow,
                local_size=2 if fn_name == "sliding_bidirectional" else None,
            )
            what = f"{fn_name} padding={pad_name} allow_is_bidirectional_skip={allow}"
            assert_same_mask(st.sdpa_mask(**kw), mu.sdpa_mask(**kw), "sdpa " + what)
            assert_same_mask(st.eager_mask(**kw), mu.eager_mask(**kw), "eager " + what)


def test_eager_mask_dtypes_use_finfo_min():
    pad = PADDINGS["left"]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        kw = mask_kwargs(B, 7, 7, mask_function=mu.causal_mask_function, attention_mask=pad)
        kw["dtype"] = dtype
        ours, theirs = st.eager_mask(**kw), mu.eager_mask(**kw)
        assert_same_mask(ours, theirs, f"eager {dtype}")
        assert ours.min().item() == torch.finfo(dtype).min, "eager masks block with finfo.min, not -inf"


# ---- what Transformers cannot express natively falls back, and says so once per reason ----
def test_unrecognised_mask_function_falls_back_and_logs_once_per_reason(caplog):
    def user_overlay(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx != 2

    functions = {
        "user overlay": mu.and_masks(mu.causal_mask_function, user_overlay),
        "two windows": mu.and_masks(mu.sliding_window_causal_mask_function(2), mu.sliding_window_overlay(3)),
    }
    st._FALLBACK_LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="safeattn.transformers"):
        for _ in range(2):
            for what, fn in functions.items():
                for q_length, kv_length, q_offset, kv_offset in SIZES[:3]:
                    kw = mask_kwargs(
                        B,
                        q_length,
                        kv_length,
                        q_offset,
                        kv_offset,
                        mask_function=fn,
                        attention_mask=PADDINGS["left"],
                    )
                    assert_same_mask(st.sdpa_mask(**kw), mu.sdpa_mask(**kw), f"fallback sdpa, {what}")
                    assert_same_mask(st.eager_mask(**kw), mu.eager_mask(**kw), f"fallback eager, {what}")
    records = [r for r in caplog.records if r.name == "safeattn.transformers"]
    messages = [r.getMessage() for r in records]
    assert len(records) == 2, f"one log line per fallback reason, got {messages}"
    assert all(r.levelno == logging.INFO for r in records), f"fallbacks are logged at INFO: {messages}"
    assert "user_overlay is not one of Transformers' mask functions" in messages[0], messages[0]
    assert "and_masks of two different sliding rules" in messages[1], messages[1]


def test_recognised_mask_functions_build_natively(monkeypatch):
    def no_fallback(**kwargs):
        raise AssertionError("a recognised mask function went to Transformers' construction")

    monkeypatch.setattr(st, "_TF_SDPA_MASK", no_fallback)
    monkeypatch.setattr(st, "_TF_EAGER_MASK", no_fallback)
    for fn in FUNCTIONS.values():
        kw = mask_kwargs(
            B, 7, 7, mask_function=fn, attention_mask=PADDINGS["left"], allow_is_causal_skip=False
        )
        assert st.sdpa_mask(**kw) is not None, "a padded mask is materialised"
        assert st.eager_mask(**kw) is not None, "a padded eager mask is materialised"


def test_unsupported_compositions_are_not_recognised():
    causal, sliding = mu.causal_mask_function, mu.sliding_window_overlay(3)
    cases = {
        "sliding overlay without causal": sliding,
        "two windows": mu.and_masks(causal, sliding, mu.sliding_window_overlay(4)),
        "or of two causal masks": mu.or_masks(causal, mu.sliding_window_causal_mask_function(2)),
    }
    if IS_TF5:
        blocks = mu.blockwise_overlay(BLOCKS)
        cases["bare block overlay"] = blocks
        cases["block overlay ANDed"] = mu.and_masks(causal, blocks)
        cases["block overlay ANDed with padding"] = mu.and_masks(
            blocks, mu.padding_mask_function(PADDINGS["left"])
        )
        cases["or of a block and something ANDed after"] = mu.and_masks(mu.or_masks(causal, blocks), sliding)
    for what, fn in cases.items():
        description = read_mask_function(fn)
        assert isinstance(description, NotRecognised), f"{what} must fall back, read as {description}"
        assert description.reason, f"{what}: the reason is said"
        kw = mask_kwargs(B, 7, 7, mask_function=fn, attention_mask=PADDINGS["left"])
        assert_same_mask(st.sdpa_mask(**kw), mu.sdpa_mask(**kw), f"fallback {what}")


# ---- the static cache's 0-d tensor query offset ----
@needs_tf5
def test_tensor_q_offset_matches_int_on_cpu():
    for (q_length, kv_length, q_offset, kv_offset), allow in itertools.product(SIZES, (True, False)):
        for pad_name in ("none", "left"):
            fn = FUNCTIONS["sliding"]
            kw_int = mask_kwargs(
                B,
                q_length,
                kv_length,
                q_offset,
                kv_offset,
                mask_function=fn,
                attention_mask=PADDINGS[pad_name],
                allow_is_causal_skip=allow,
                local_size=3,
            )
            kw_tensor = dict(kw_int, q_offset=torch.tensor(q_offset))
            what = f"sizes={(q_length, kv_length, q_offset, kv_offset)} skip={allow} padding={pad_name}"
            assert_same_mask(st.sdpa_mask(**kw_tensor), mu.sdpa_mask(**kw_int), "tensor q_offset " + what)


@needs_tf5
def test_device_tensor_q_offset_is_never_read():
    # A meta tensor has no value: reading it (a host sync on a GPU) raises. Static-cache decode
    # (skip disabled) and prefill (skip allowed) must both build their mask without reading it.
    offset = torch.tensor(6, device="meta")
    for q_length, allow in ((1, False), (4, True), (1, True)):
        kw = mask_kwargs(
            B,
            q_length,
            12,
            offset,
            0,
            mask_function=mu.causal_mask_function,
            attention_mask=None,
            allow_is_causal_skip=allow,
            device="meta",
        )
        mask = st.sdpa_mask(**kw)
        if q_length == 1 and allow:
            assert mask is None, "a decode step with no padding may skip the mask"
        else:
            assert mask is not None and mask.device.type == "meta", "the mask is built on the offset's device"
            assert mask.shape == (B, 1, q_length, 12), f"mask shape {tuple(mask.shape)}"


@pytest.mark.slow
def test_mask_is_never_none_while_tracing():
    kw = mask_kwargs(B, 7, 7, mask_function=mu.causal_mask_function, attention_mask=None)
    assert st.sdpa_mask(**kw) is None, "eager: a plain causal mask is skipped"

    def build(dummy):
        mask = st.sdpa_mask(**kw)
        return mask, dummy + 1

    mask, _ = torch.compile(build, fullgraph=True, dynamic=True)(torch.zeros(1))
    assert mask is not None, "under torch.compile the mask is always materialised"
    expected = torch.ones(7, 7, dtype=torch.bool).tril().expand(B, 1, 7, 7)
    assert torch.equal(mask, expected), "the traced mask is the causal mask"


# ---- the cases of Transformers' tests/utils/test_masking_utils.py, through create_*_mask ----
def create(fn_name, config, inputs_embeds, attention_mask, past_key_values=None, position_ids=None, **extra):
    """Calls masking_utils.<fn_name> with the installed version's keywords."""
    fn = getattr(mu, fn_name)
    if IS_TF5:
        return fn(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
            **extra,
        )
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    cache_position = torch.arange(past, past + inputs_embeds.shape[1])
    return fn(
        config=config,
        input_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache_position=cache_position,
        past_key_values=past_key_values,
        position_ids=position_ids,
        **extra,
    )


def for_each_implementation(build):
    """build(config) for "sdpa" and "safeattn" configs; returns (ours, theirs)."""
    results = {}
    for impl in ("safeattn", "sdpa"):
        results[impl] = build(impl)
    return results["safeattn"], results["sdpa"]


def llama_config(impl, **kw):
    config = transformers.LlamaConfig(**kw)
    config._attn_implementation = impl
    return config


def test_packed_sequence_mask():
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    embeds = torch.empty(2, 10, 8, dtype=torch.float16)
    ours, theirs = for_each_implementation(
        lambda impl: create("create_causal_mask", llama_config(impl), embeds, None, position_ids=position_ids)
    )
    assert_same_mask(ours, theirs, "packed sequences")
    # Block diagonal: row 4 (the first token of the second sequence) sees only itself.
    assert (
        ours[0, 0, 4].tolist() == [False] * 4 + [True] + [False] * 5
    ), "packed sequences do not see each other"


def test_packed_sequence_mask_eager_after_patch():
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    embeds = torch.empty(2, 10, 8, dtype=torch.float16)
    theirs = create("create_causal_mask", llama_config("eager"), embeds, None, position_ids=position_ids)
    try:
        st.patch_masks()
        assert mu.ALL_MASK_ATTENTION_FUNCTIONS["eager"] is st.eager_mask, "patch_masks serves eager"
        ours = create("create_causal_mask", llama_config("eager"), embeds, None, position_ids=position_ids)
    finally:
        st.unpatch_masks()
    assert mu.ALL_MASK_ATTENTION_FUNCTIONS["eager"] is mu.eager_mask, "unpatch_masks restores eager"
    assert_same_mask(ours, theirs, "packed sequences, eager")


@pytest.mark.slow
def test_nonpacked_sequence_mask_skip():
    position_ids = torch.arange(10)[None, :]
    embeds = torch.empty(2, 10, 8, dtype=torch.float16)
    ours, theirs = for_each_implementation(
        lambda impl: create("create_causal_mask", llama_config(impl), embeds, None, position_ids=position_ids)
    )
    assert_same_mask(ours, theirs, "non-packed sequences")
    if IS_TF5:
        assert ours is None, "non-packed sequences skip the mask"

    config = llama_config("safeattn")

    def build(embeds, position_ids):
        return create("create_causal_mask", config, embeds, None, position_ids=position_ids)

    compiled = torch.compile(build, fullgraph=True, dynamic=True)(embeds, position_ids)
    assert compiled is not None, "under torch.compile the mask is materialised"
    expected = torch.ones(10, 10, dtype=torch.bool).tril().expand(2, 1, 10, 10)
    assert torch.equal(compiled, expected), "the compiled mask is causal"


def test_chunked_mask_with_left_padding_prefill():
    attention_mask = torch.tensor([[0] * 4 + [1] * 4, [1] * 8])
    position_ids = torch.tensor([[1, 1, 1, 1, 0, 1, 2, 3], list(range(8))])
    embeds = torch.empty(2, 8, 8, dtype=torch.float16)
    ours, theirs = for_each_implementation(
        lambda impl: create(
            "create_chunked_causal_mask",
            llama_config(impl, attention_chunk_size=3),
            embeds,
            attention_mask,
            position_ids=position_ids,
        )
    )
    assert_same_mask(ours, theirs, "chunked, left padding, prefill")
    # The padded row's chunks start after its 4 pads: token 7 starts a new chunk.
    assert ours[0, 0, 7].tolist() == [False] * 7 + [True], "chunks start after the left padding"


def test_chunked_mask_with_left_padding_decoding():
    config = llama_config("sdpa", attention_chunk_size=4, num_hidden_layers=1)
    prefill, pads = 8, 7
    attention_mask = torch.tensor([[0] * pads + [1] * (prefill + 1 - pads), [1] * (prefill + 1)])
    position_ids = torch.tensor([[prefill - pads], [prefill]])
    embeds = torch.empty(2, 1, 8, dtype=torch.float16)

    def build(impl):
        cache = transformers.DynamicCache(
            config=llama_config(impl, attention_chunk_size=4, num_hidden_layers=1)
        )
        fake_kv = torch.rand(2, 4, prefill, 8)
        if IS_TF5:
            cache.update(fake_kv, fake_kv, 0)
        else:
            cache.update(fake_kv, fake_kv, 0, {"cache_position": torch.arange(prefill)})
        config._attn_implementation = impl
        return create(
            "create_chunked_causal_mask",
            config,
            embeds,
            attention_mask,
            past_key_values=cache,
            position_ids=position_ids,
        )

    ours, theirs = for_each_implementation(build)
    assert_same_mask(ours, theirs, "chunked, left padding, decode")
    assert ours is not None and ours.shape[-1] == 4, "the sliding cache holds the last chunk's keys"


@needs_tf5
@pytest.mark.parametrize("impl_pair", [("safeattn", "sdpa"), ("eager", "eager")])
def test_bidirectional_mask_skip(impl_pair):
    ours_impl, theirs_impl = impl_pair
    embeds = torch.ones(2, 10, 1, dtype=torch.float16)
    encoder_states = torch.ones(2, 5, 1, dtype=torch.float16)
    cases = {
        "full": (torch.ones(2, 10), torch.ones(2, 5)),
        "none": (None, None),
        "padded": (
            torch.ones(2, 10).index_fill(1, torch.tensor([9]), 0),
            torch.ones(2, 5).index_fill(1, torch.tensor([4]), 0),
        ),
    }

    def run(impl, encoder_mask, cross_mask):
        config = llama_config(impl)
        own = mu.create_bidirectional_mask(config=config, inputs_embeds=embeds, attention_mask=encoder_mask)
        cross = mu.create_bidirectional_mask(
            config=config,
            inputs_embeds=embeds,
            attention_mask=cross_mask,
            encoder_hidden_states=encoder_states,
        )
        return own, cross

    for name, (encoder_mask, cross_mask) in cases.items():
        theirs = run(theirs_impl, encoder_mask, cross_mask)
        if ours_impl == "eager":
            try:
                st.patch_masks()
                ours = run("eager", encoder_mask, cross_mask)
            finally:
                st.unpatch_masks()
        else:
            ours = run(ours_impl, encoder_mask, cross_mask)
        for kind, a, b in zip(("encoder", "cross"), ours, theirs, strict=True):
            assert_same_mask(a, b, f"bidirectional {name} {kind} ({ours_impl})")
            assert (a is None) == (
                name != "padded"
            ), f"bidirectional {name} {kind}: None only without padding"


def test_registration():
    from transformers import AttentionInterface

    assert mu.ALL_MASK_ATTENTION_FUNCTIONS[st.NAME] is st.sdpa_mask, "the mask function is registered"
    assert AttentionInterface._global_mapping[st.NAME] is st.attention_forward, "the attention is registered"
    assert mu.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is mu.sdpa_mask, "sdpa is untouched until patch_masks()"


# ---- the mask reader: closure in, description (with a dense twin) or reason out ----
# The factories each supported release has and the reader must read: a release that renames one,
# or the free variables the reader takes from its closures, fails here by name.
EXPECTED_FACTORIES = {
    "causal_mask_function",
    "and_masks",
    "or_masks",
    "sliding_window_overlay",
    "chunked_overlay",
    "padding_mask_function",
    "packed_sequence_mask_function",
}
if IS_TF5:
    EXPECTED_FACTORIES |= {
        "bidirectional_mask_function",
        "sliding_window_bidirectional_overlay",
        "blockwise_overlay",
    }
else:
    EXPECTED_FACTORIES |= {"_legacy_chunked_overlay"}


def test_reader_reads_every_factory_of_this_release():
    missing = EXPECTED_FACTORIES - recognised_factories()
    assert not missing, (
        f"transformers {transformers.__version__} renamed or changed masking_utils factories that "
        f"safeattn._mask_reader reads: {sorted(missing)}; every mask using them falls back"
    )


def _unskipped(kw):
    """The keywords with both of Transformers' skips off, so its sdpa_mask returns a tensor."""
    kw = dict(kw, allow_is_causal_skip=False)
    if IS_TF5:
        kw["allow_is_bidirectional_skip"] = False
    return kw


@pytest.mark.parametrize("fn_name", list(FUNCTIONS))
def test_descriptions_have_dense_twins(fn_name):
    description = read_mask_function(FUNCTIONS[fn_name])
    assert isinstance(description, MaskDescription), f"{fn_name} is read: {description}"
    for (q_length, kv_length, q_offset, kv_offset), pad_name in itertools.product(
        SIZES, ("none", "left", "narrow")
    ):
        kw = _unskipped(
            mask_kwargs(
                B,
                q_length,
                kv_length,
                q_offset,
                kv_offset,
                mask_function=FUNCTIONS[fn_name],
                attention_mask=PADDINGS[pad_name],
            )
        )
        q_positions = kw.get("cache_position")  # 4.57 passes query positions as a tensor
        dense = description.with_padding(PADDINGS[pad_name]).materialise(
            B,
            q_length,
            kv_length,
            q_offset=0 if q_positions is not None else q_offset,
            kv_offset=kv_offset,
            q_positions=q_positions,
        )
        what = f"{fn_name} sizes={(q_length, kv_length, q_offset, kv_offset)} padding={pad_name}"
        assert_same_mask(dense, mu.sdpa_mask(**kw), "materialised description " + what)


def test_description_fields_are_the_native_rules():
    pad = PADDINGS["left"]
    sliding = read_mask_function(
        mu.and_masks(mu.sliding_window_causal_mask_function(3), mu.padding_mask_function(pad))
    )
    assert (sliding.causal, sliding.sliding_window, sliding.chunk_size) == (True, 3, None), sliding
    assert sliding.padding_mask is pad, "one padding mask is kept as given"
    chunked = read_mask_function(mu.chunked_causal_mask_function(4, LEFT))
    assert (chunked.chunk_size, chunked.chunk_left_padding) == (4, LEFT), chunked
    packed = read_mask_function(FUNCTIONS["packed"])
    assert packed.packed_ids is PACKED and packed.block_ids is None, packed
    assert packed.sdpa_mask_kwargs() == dict(
        causal=True,
        sliding_window=None,
        chunk_size=None,
        chunk_left_padding=None,
        padding_mask=None,
        packed_ids=PACKED,
        block_ids=None,
    ), "the description is safeattn.sdpa_mask's keywords"
    if IS_TF5:
        window = read_mask_function(mu.sliding_window_bidirectional_mask_function(2))
        assert (window.causal, window.sliding_window) == (False, 2), window
        causal_window = read_mask_function(FUNCTIONS["causal_and_bidirectional_window"])
        assert (causal_window.causal, causal_window.sliding_window) == (
            True,
            3,
        ), "kv <= q and |q - kv| <= 2 is the causal window of 3 keys"
        block = read_mask_function(FUNCTIONS["block"])
        assert block.block_ids is BLOCKS and block.causal, block


def test_padding_key_bounds():
    keep = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1],  # left padding
            [1, 1, 1, 1, 0, 0],  # right padding
            [1, 1, 1, 1, 1, 1],  # none
            [0, 1, 1, 0, 1, 0],  # a hole: not one interval
            [0, 0, 0, 0, 0, 0],  # nothing kept
        ],
        dtype=torch.bool,
    )
    assert MaskDescription().padding_key_bounds() is None, "no padding, no bounds"
    description = MaskDescription(padding_mask=keep)
    start, end, exact = description.padding_key_bounds()
    assert start.tolist() == [2, 0, 0, 1, 0], start
    assert end.tolist() == [6, 4, 6, 5, 0], end
    assert exact.tolist() == [True, True, True, False, True], exact
    # Where the bounds are exact, the interval alone gives the dense twin's mask.
    dense = description.materialise(5, 6, 6)
    kv = torch.arange(6)
    interval = (kv >= start[:, None]) & (kv < end[:, None])
    causal = kv[None, :] <= kv[:, None]
    for row in exact.nonzero().flatten().tolist():
        assert torch.equal(dense[row, 0], causal & interval[row]), f"row {row}: the interval is the padding"


# From Transformers 5.23 the chunked rule of a packed batch counts chunks from each sequence's own
# position 0 (remap_positions_for_packed_sequence), which the native op's chunking (from the row's
# start, shifted by its left padding) cannot say: that mask, and only that one, goes to
# Transformers' construction.
ALLOWED_FALLBACKS = {_mask_reader._REMAPPED_ONLY} if _mask_reader._REMAP_CODE is not None else set()


def _recording_mask_interface(monkeypatch):
    """Routes the "safeattn" mask interface through a recorder of what the reader makes of each
    mask function, checks each mask it builds against Transformers' own, and makes Transformers'
    construction (the fallback) fail but for ALLOWED_FALLBACKS."""
    seen = []
    transformers_mask = st._TF_SDPA_MASK

    def record(**kwargs):
        fn = kwargs.get("mask_function", mu.causal_mask_function)
        seen.append((getattr(fn, "__qualname__", repr(fn)), read_mask_function(fn)))
        ours = st.sdpa_mask(**kwargs)
        theirs = transformers_mask(**kwargs)
        if isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
            assert torch.equal(
                *torch.broadcast_tensors(ours, theirs)
            ), f"{seen[-1][0]}: not Transformers' mask"
        return ours

    def no_fallback(**kwargs):
        reading = read_mask_function(kwargs.get("mask_function", mu.causal_mask_function))
        if isinstance(reading, NotRecognised) and reading.reason in ALLOWED_FALLBACKS:
            return transformers_mask(**kwargs)
        raise AssertionError("a mask went to Transformers' own construction")

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, st.NAME, record)
    monkeypatch.setattr(st, "_TF_SDPA_MASK", no_fallback)
    return seen


def _assert_all_read(seen, what):
    assert seen, f"{what}: no mask was built (nothing was checked)"
    failed = [
        f"{name}: {result.reason}"
        for name, result in seen
        if isinstance(result, NotRecognised) and result.reason not in ALLOWED_FALLBACKS
    ]
    assert not failed, (
        f"{what}: transformers {transformers.__version__} built masks that safeattn._mask_reader "
        f"does not recognise (renamed or changed factories?): {failed}"
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_every_mask_of_the_supported_models_is_read(name, monkeypatch):
    config = make_config(name)
    model = make_model(config, st.NAME)
    seen = _recording_mask_interface(monkeypatch)
    input_ids, position_ids = packed_batch()
    with torch.no_grad():
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        for side in ("left", "right"):
            input_ids, attention_mask = padded_batch(side)
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        # Prefill into a cache, then decode steps: masks of other shapes (sliding caches too).
        input_ids, attention_mask = padded_batch("left")
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
        for _ in range(6):
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(3, 1)], dim=1)
            out = model(
                input_ids=input_ids[:, -1:],
                attention_mask=attention_mask,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    _assert_all_read(seen, name)


def test_every_mask_of_the_create_functions_is_read(monkeypatch):
    seen = _recording_mask_interface(monkeypatch)
    embeds = torch.empty(2, 8, 8)
    padding = torch.tensor([[0] * 3 + [1] * 5, [1] * 8])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))])
    config = llama_config(st.NAME, sliding_window=3, attention_chunk_size=4)
    for fn_name in ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"):
        create(fn_name, config, embeds, padding)
        create(fn_name, config, embeds, None, position_ids=position_ids)  # packed sequences
        create(fn_name, config, embeds, padding, and_mask_function=mu.padding_mask_function(padding.bool()))
    if IS_TF5:
        blocks = torch.tensor([[-1, -1, -1, 0, 0, 0, -1, -1], [1, 1, -1, -1, 2, 2, 2, -1]])
        create("create_causal_mask", config, embeds, padding, or_mask_function=mu.blockwise_overlay(blocks))
        create("create_causal_mask", config, embeds, padding, block_sequence_ids=blocks)
        create("create_sliding_window_causal_mask", config, embeds, padding, block_sequence_ids=blocks)
        for padded in (padding, None):
            mu.create_bidirectional_mask(config=config, inputs_embeds=embeds, attention_mask=padded)
            mu.create_bidirectional_mask(
                config=config,
                inputs_embeds=embeds,
                attention_mask=None if padded is None else padded[:, 3:],
                encoder_hidden_states=torch.empty(2, 5, 8),
            )
            mu.create_bidirectional_mask(
                config=config,
                inputs_embeds=embeds,
                attention_mask=padded,
                and_mask_function=mu.sliding_window_bidirectional_overlay(2),
            )
    _assert_all_read(seen, "create_*_mask")
