"""attn_implementation="safeattn" in tiny random-weight Transformers models (no download).

Llama, Mistral (sliding), Qwen3 (mixed layer_types), Gemma2 (softcap), Gemma3 (sliding
pattern), Llama4 text (chunked) and GPT-OSS (sinks). The reference is "sdpa", or "eager" where
"sdpa" ignores a feature (Gemma2's softcap, GPT-OSS's sinks: GPT-OSS has no sdpa at all).
Models that do not exist in the installed Transformers are skipped with the reason.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import safeattn.transformers as st  # noqa: E402  registers "safeattn"
from _transformers_models import (  # noqa: E402
    IS_TF4,
    MODELS,
    make_config,
    make_model,
    packed_batch,
    padded_batch,
    reference_impl,
)
from transformers import AttentionInterface, masking_utils  # noqa: E402

NAMES = list(MODELS)


def model_inputs(layout: str):
    """(forward kwargs, [B, S] bool of real tokens) for "left", "right" padding or "packed"."""
    if layout == "packed":
        input_ids, position_ids = packed_batch()
        return dict(input_ids=input_ids, position_ids=position_ids, use_cache=False), torch.ones_like(
            input_ids, dtype=torch.bool
        )
    input_ids, attention_mask = padded_batch(layout)
    return dict(input_ids=input_ids, attention_mask=attention_mask), attention_mask.bool()


def logits(model, kwargs):
    with torch.no_grad():
        return model(**kwargs).logits.float()


@pytest.mark.parametrize("layout", ["left", "right", "packed"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_reference_fp32(name, layout):
    config = make_config(name)
    kwargs, real = model_inputs(layout)
    ours = logits(make_model(config, "safeattn"), kwargs)
    theirs = logits(make_model(config, reference_impl(name)), kwargs)
    assert not ours.isnan().any(), "no NaN anywhere, padded positions included"
    torch.testing.assert_close(
        ours[real], theirs[real], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} {layout}: {m}"
    )


@pytest.mark.parametrize("layout", ["left", "packed"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_reference_bf16(name, layout):
    # Tolerance rule (as flash-attention's): against the fp32 reference, our bf16 error is at
    # most twice the reference implementation's own bf16 error (plus a small floor).
    config = make_config(name)
    kwargs, real = model_inputs(layout)
    exact = logits(make_model(config, reference_impl(name)), kwargs)[real]
    ours = logits(make_model(config, "safeattn", torch.bfloat16), kwargs)
    theirs = logits(make_model(config, reference_impl(name), torch.bfloat16), kwargs)[real]
    assert not ours.isnan().any(), "no NaN anywhere, padded positions included"
    our_error = (ours[real] - exact).abs().max().item()
    their_error = (theirs - exact).abs().max().item()
    assert (
        our_error <= 2 * their_error + 1e-2
    ), f"{name} {layout}: bf16 error {our_error} vs reference's {their_error}"


@pytest.mark.parametrize("name", NAMES)
def test_padded_query_rows_give_zero_attention(name, monkeypatch):
    records = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        out, weights = st.attention_forward(module, query, key, value, attention_mask, **kwargs)
        records.append((attention_mask, out))
        return out, weights

    monkeypatch.setitem(AttentionInterface._global_mapping, st.NAME, recording)
    config = make_config(name)
    kwargs, real = model_inputs("left")
    out = logits(make_model(config, "safeattn"), kwargs)
    assert not out.isnan().any(), "no NaN in the logits"
    assert len(records) == config.num_hidden_layers, "every layer ran the safeattn attention"
    pad_rows = ~real  # left padding: a padded query sees no key at all
    for layer, (mask, attn) in enumerate(records):
        assert (
            mask is not None and mask.dtype == torch.bool
        ), f"layer {layer}: a native bool mask with padding"
        assert not attn.isnan().any(), f"layer {layer}: no NaN in the attention output"
        padded = attn[pad_rows]  # attn: [B, Q, H, D]
        assert padded.numel() > 0 and torch.all(padded == 0), f"layer {layer}: fully padded query rows are 0"
        assert attn[real].abs().sum() > 0, f"layer {layer}: real rows are not 0"
        assert attn.is_contiguous(), f"layer {layer}: the output [B, Q, H, D] is contiguous"


def test_features_are_honoured(monkeypatch):
    # Gemma2's softcap and GPT-OSS's sinks change the logits well above the tolerances used
    # above, so matching eager proves they are applied. (Eager without the softcap, rather than
    # "sdpa", which ignores it: Transformers from 5.2x refuses "sdpa" for Gemma2.)
    kwargs, real = model_inputs("left")
    config = make_config("gemma2")
    eager = logits(make_model(config, "eager"), kwargs)[real]
    uncapped = copy.deepcopy(config)
    uncapped.attn_logit_softcapping = None
    eager_uncapped = logits(make_model(uncapped, "eager"), kwargs)[real]
    assert (eager - eager_uncapped).abs().max() > 1e-2, "the softcap matters in this model"

    if "GptOssConfig" not in dir(transformers):
        return
    config = make_config("gpt_oss")
    with_sinks = logits(make_model(config, "safeattn"), kwargs)[real]

    def no_sinks(*args, **kw):
        kw.pop("s_aux", None)
        return st.attention_forward(*args, **kw)

    monkeypatch.setitem(AttentionInterface._global_mapping, st.NAME, no_sinks)
    without = logits(make_model(config, "safeattn"), kwargs)[real]
    assert (with_sinks - without).abs().max() > 1e-2, "the sinks matter in this model"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", NAMES)
def test_generate_same_greedy_tokens(name, cache):
    config = make_config(name)
    chunked_mask_params = inspect.signature(masking_utils.create_chunked_causal_mask).parameters
    if (
        name == "llama4"
        and cache == "static"
        and not IS_TF4
        and "block_sequence_ids" not in chunked_mask_params
    ):
        # Transformers' own bug, "sdpa" included: create_masks_for_generate passes
        # block_sequence_ids to create_chunked_causal_mask, which does not take it.
        pytest.skip("Transformers 5.x cannot generate with a static cache for chunked attention")
    input_ids, attention_mask = padded_batch("left")
    generate = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    if cache == "static":
        generate["cache_implementation"] = "static"
    outputs = {}
    for impl in ("safeattn", reference_impl(name)):
        model = make_model(config, impl)
        with torch.no_grad():
            outputs[impl] = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate)
    ours, theirs = outputs.values()
    assert torch.equal(ours, theirs), f"{name} {cache} cache: greedy tokens differ\n{ours}\n{theirs}"


@pytest.mark.parametrize("layout", ["left", "packed"])
@pytest.mark.parametrize("name", NAMES)
def test_training_step_same_gradients(name, layout):
    config = make_config(name)
    kwargs, real = model_inputs(layout)
    labels = kwargs["input_ids"].masked_fill(~real, -100)
    # A left-padded row's first real token is predicted from a padding position, whose output
    # is 0 here and uniform attention in "eager": leave it out of the loss.
    labels = labels.masked_fill(~F.pad(real[:, :-1], (1, 0), value=True), -100)
    grads = {}
    for impl in ("safeattn", reference_impl(name)):
        model = make_model(config, impl).train()
        model(**kwargs, labels=labels).loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ours, theirs = grads.values()
    assert ours.keys() == theirs.keys(), "the same parameters get gradients"
    for key in ours:
        torch.testing.assert_close(
            ours[key], theirs[key], atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{name} {k}: {m}"
        )


def test_dropout_in_training_is_rejected_or_applied():
    config = make_config("llama")
    config.attention_dropout = 0.5
    model = make_model(config, "safeattn").train()
    kwargs, _ = model_inputs("left")
    try:
        a = model(**kwargs).logits
    except (NotImplementedError, RuntimeError, ValueError) as error:
        assert "dropout" in str(error), f"the error names dropout: {error}"
        return
    b = model(**kwargs).logits
    assert not torch.equal(a, b), "dropout, when supported, is applied in training"


# Compiling costs 20-60 s per model on 2 cores: Llama, and the two whose attention differs
# most (sliding + softcap, sliding + sinks). Left padding, then right padding at another batch
# size (dynamic shapes: the same graph).
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.slow
def test_compile_fullgraph_dynamic(name):
    if name == "gpt_oss" and IS_TF4:
        # modeling_gpt_oss.py's experts loop `for expert_idx in expert_hit[:]` is data-dependent
        # in 4.57: no attention implementation compiles it with fullgraph=True.
        pytest.skip("GPT-OSS's MoE in transformers 4.57 cannot be compiled with fullgraph=True")
    config = make_config(name)
    model = make_model(config, "safeattn")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)  # a graph break raises
    for layout in ("left", "right"):
        kwargs, _ = model_inputs(layout)
        if layout == "right":
            kwargs = {k: v[1:, 1:] for k, v in kwargs.items()}
        with torch.no_grad():
            got = compiled(**kwargs).logits
            want = model(**kwargs).logits
        assert not got.isnan().any(), f"{name} {layout}: no NaN compiled"
        torch.testing.assert_close(
            got, want, atol=2e-5, rtol=1e-4, msg=lambda m, lay=layout: f"{name} {lay}: {m}"
        )


def test_compile_where_dynamo_cannot_read_closures(monkeypatch):
    """Before torch 2.14 dynamo cannot read the cells of a mask closure made inside the compiled
    region (seen with torch 2.11): safeattn then leaves such masks to Transformers' own code, and a
    sliding-window model still compiles with fullgraph=True and matches eager."""
    monkeypatch.setattr(st._mask_reader, "DYNAMO_READS_CLOSURES", False)
    config = make_config("gemma2")
    model = make_model(config, "safeattn")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    kwargs, _ = model_inputs("left")
    with torch.no_grad():
        got = compiled(**kwargs).logits
        want = model(**kwargs).logits
    assert not got.isnan().any(), "no NaN compiled"
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(IS_TF4, reason="5.x keywords (q_length, q_offset); 4.57 passes cache_position")
@pytest.mark.slow
def test_fallback_masks_under_compile_apply_padding_by_broadcast(monkeypatch):
    """Before torch 2.14 every mask reaches Transformers' construction under compile, with the
    padding applied by broadcasting (Transformers' gather is what inductor miscompiles on CPU in
    torch 2.11, pytorch #178244): the bool and the float mask equal Transformers' own, for left and
    right padding and a sliding window at a decode offset."""
    monkeypatch.setattr(st._mask_reader, "DYNAMO_READS_CLOSURES", False)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, :3] = False  # left padding
    pad[1, 7:] = False  # right padding
    for q_length, q_offset in ((9, 0), (2, 7)):
        kwargs = dict(
            batch_size=2,
            q_length=q_length,
            kv_length=9,
            q_offset=q_offset,
            kv_offset=0,
            mask_function=masking_utils.sliding_window_causal_mask_function(4),
            attention_mask=pad,
            local_size=4,
            device="cpu",
        )
        for ours, theirs, dtype in (
            (st.sdpa_mask, st._TF_SDPA_MASK, None),
            (st.eager_mask, st._TF_EAGER_MASK, torch.float32),
        ):
            torch._dynamo.reset()
            got = torch.compile(
                lambda ours=ours, kw=kwargs, dtype=dtype: ours(**kw, dtype=dtype), fullgraph=True
            )()
            want = theirs(**kwargs, dtype=dtype)
            assert got.dtype == want.dtype, f"{ours.__name__} Q={q_length}: dtype"
            assert torch.equal(got.expand_as(want), want), f"{ours.__name__} Q={q_length}: mask differs"


def test_patch_masks_keeps_sdpa_and_eager_models_equal():
    config = make_config("mistral")
    kwargs, real = model_inputs("left")
    before = {impl: logits(make_model(config, impl), kwargs) for impl in ("sdpa", "eager")}
    try:
        st.patch_masks()
        after = {impl: logits(make_model(config, impl), kwargs) for impl in ("sdpa", "eager")}
    finally:
        st.unpatch_masks()
    for impl in before:
        # Same masks, so the same logits everywhere (padded rows included).
        torch.testing.assert_close(
            after[impl], before[impl], atol=0, rtol=0, msg=lambda m, i=impl: f"{i}: {m}"
        )


def _op_spy(monkeypatch, calls, record=None):
    """Routes the drop-in's op calls through a recorder: ``record(query, key, attn_mask,
    is_causal, enable_gqa, kwargs)`` appended to ``calls`` (default: kv_length, is_causal, mask
    shape, q_offset, kv_offset). Returns the real op."""
    op = st._attention_op(torch.device("cpu"))
    if op is None:
        pytest.skip("this build has no attention op")

    def default(query, key, attn_mask, is_causal, enable_gqa, kwargs):
        mask_shape = None if attn_mask is None else tuple(attn_mask.shape)
        return (key.shape[2], is_causal, mask_shape, kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0))

    record = record or default

    def spy(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kwargs):
        calls.append(record(query, key, attn_mask, is_causal, enable_gqa, kwargs))
        return op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kwargs)

    monkeypatch.setattr(st, "_attention_op", lambda device: spy)
    return op


def test_attention_runs_the_op_with_native_gqa(monkeypatch):
    calls = []

    def record(query, key, attn_mask, is_causal, enable_gqa, kwargs):
        mask_shape = None if attn_mask is None else tuple(attn_mask.shape)
        return (query.shape, key.shape, enable_gqa, is_causal, mask_shape, kwargs)

    def no_composite(*args, **kwargs):
        raise AssertionError("the composite fallback ran although the op exists")

    _op_spy(monkeypatch, calls, record)
    monkeypatch.setattr(st, "_composite_attention", no_composite)
    config = make_config("gemma2")
    kwargs, _ = model_inputs("left")
    logits(make_model(config, "safeattn"), kwargs)
    assert len(calls) == config.num_hidden_layers, "one op call per layer"
    for layer_type, (q_shape, k_shape, enable_gqa, is_causal, mask_shape, extra) in zip(
        config.layer_types, calls, strict=True
    ):
        assert k_shape[1] == config.num_key_value_heads < q_shape[1], "K/V reach the op at the KV-head count"
        assert enable_gqa, "grouped-query attention is native (enable_gqa)"
        batch, _, q_length, _ = q_shape
        kv_length = k_shape[2]
        ranges = extra.get("key_ranges")
        if not IS_TF4:  # causal + left padding (and a window): is_causal, key mask (and key ranges)
            # (4.57 gives the query positions as a tensor: its masks stay dense.)
            assert is_causal and mask_shape == (batch, 1, 1, kv_length), (layer_type, is_causal, mask_shape)
            sliding = layer_type != "full_attention"
            assert (ranges is not None) == sliding, (layer_type, ranges)
            if sliding:  # query i keeps the keys i - window < j (is_causal bounds the other end)
                lo = (torch.arange(q_length) - config.sliding_window + 1).clamp(0, kv_length)
                assert torch.equal(ranges[:, :, 0].cpu(), lo.to(torch.int32).expand(batch, -1)), layer_type
        else:
            assert not is_causal and mask_shape == (batch, 1, q_length, kv_length), (layer_type, mask_shape)
        assert extra["softcap"] == config.attn_logit_softcapping, "Gemma2's softcap reaches the op"


@pytest.mark.skipif(IS_TF4, reason="4.57 gives the query positions as a tensor: its masks stay dense")
def test_packed_sequences_run_as_key_ranges(monkeypatch):
    # Transformers' packed ids (one run per sequence) reach the op as is_causal and key ranges,
    # no [B, 1, Q, KV] mask; the logits are the sdpa model's (the model tests above).
    calls = []
    _op_spy(
        monkeypatch,
        calls,
        lambda query, key, attn_mask, is_causal, enable_gqa, kwargs: (
            is_causal,
            None if attn_mask is None else tuple(attn_mask.shape),
            kwargs.get("key_ranges"),
        ),
    )
    config = make_config("llama")
    kwargs, _ = model_inputs("packed")
    logits(make_model(config, "safeattn"), kwargs)
    assert calls, "the op ran"
    for is_causal, mask_shape, ranges in calls:
        assert is_causal and mask_shape is None and ranges is not None, (is_causal, mask_shape)
        for b, positions in enumerate(kwargs["position_ids"]):
            starts = torch.nonzero(positions == 0).flatten().tolist() + [positions.numel()]
            for begin, end in zip(starts[:-1], starts[1:], strict=True):  # each sequence sees itself
                rows = ranges[b, begin:end]
                assert torch.all(rows[:, 0] == begin) and torch.all(rows[:, 1] == end), (b, begin, end, rows)


def test_causal_without_mask_and_static_prefill_slicing(monkeypatch):
    # No padding: the mask is None, so the op runs is_causal (prefill) or not (decode), and a
    # static-cache prefill drops the unused cache slots as sdpa does.
    calls = []
    _op_spy(
        monkeypatch,
        calls,
        lambda query, key, attn_mask, is_causal, enable_gqa, kwargs: (
            query.shape[2],
            key.shape[2],
            is_causal,
            attn_mask is None,
        ),
    )
    config = make_config("llama")
    input_ids = torch.randint(3, 100, (2, 6))
    model = make_model(config, "safeattn")
    with torch.no_grad():
        model.generate(
            input_ids=input_ids,
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            cache_implementation="static",
        )
    prefill = calls[0]
    if IS_TF4:
        # 4.57 never skips the mask with a static cache: no causal flag, the full cache length.
        assert (
            not prefill[2] and not prefill[3] and prefill[1] > 6
        ), f"4.57 static prefill has a mask: {prefill}"
    else:
        assert prefill == (
            6,
            6,
            True,
            True,
        ), f"static prefill: causal, no mask, keys sliced to the queries: {prefill}"
    for q_length, _, is_causal, _ in calls[config.num_hidden_layers :]:
        assert q_length == 1 and not is_causal, "decode steps are never causal"


@pytest.mark.parametrize("side", ["left", "right"])
def test_causal_padding_masks_run_as_is_causal_and_a_key_mask(monkeypatch, side):
    # A causal mask with padding and nothing else reaches the op as is_causal at the mask's
    # positions plus a [B, 1, 1, KV] key mask (the kernels skip the tiles past the diagonal),
    # prefill and every decode step; the tokens and logits are those of the dense mask.
    if IS_TF4:
        pytest.skip("Transformers 4.57 passes the query positions as a tensor: its masks stay dense")
    calls = []
    _op_spy(monkeypatch, calls)
    config = make_config("llama")
    model = make_model(config, "safeattn")
    input_ids, attention_mask = padded_batch(side)
    batch, length = input_ids.shape
    layers = config.num_hidden_layers

    def run():
        with torch.no_grad():
            tokens = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
            )
        return tokens, logits(model, dict(input_ids=input_ids, attention_mask=attention_mask))

    tokens, out = run()
    assert calls[:layers] == [(length, True, (batch, 1, 1, length), 0, 0)] * layers, calls[:layers]
    for step in (1, 2):  # one query at position length + step - 1, over every cached key
        kv = length + step
        want = [(kv, True, (batch, 1, 1, kv), kv - 1, 0)] * layers
        assert calls[step * layers : (step + 1) * layers] == want, calls[step * layers : (step + 1) * layers]
    assert (
        calls[3 * layers :] == [(length, True, (batch, 1, 1, length), 0, 0)] * layers
    ), "the logits' forward"

    calls.clear()
    monkeypatch.setattr(st, "_noted", lambda *args: None)  # the dense masks instead
    dense_tokens, dense_out = run()
    assert calls and all(not causal and mask is not None for _, causal, mask, _, _ in calls), "dense masks"
    assert torch.equal(tokens, dense_tokens), "the same greedy tokens"
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)


def test_inference_mode_masks_run_dense(monkeypatch):
    # A mask made under torch.inference_mode has no version counter, so it is never noted: the
    # model runs, with the dense mask, and gives the logits of no_grad's run.
    calls = []
    _op_spy(monkeypatch, calls)
    config = make_config("llama")
    model = make_model(config, "safeattn")
    kwargs, _ = model_inputs("left")
    with torch.inference_mode():
        out = model(**kwargs).logits.float()
    assert calls and all(
        mask is not None and mask[2] > 1 and not causal for _, causal, mask, _, _ in calls
    ), calls
    torch.testing.assert_close(out, logits(model, kwargs), rtol=1e-5, atol=1e-5)


def test_a_noted_mask_changed_or_copied_runs_as_the_dense_mask(monkeypatch):
    # The note holds only for the mask as built: changed in place (here: the last query of row 0
    # loses every key) or copied, it runs as the dense mask it is.
    outputs = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        copy = attention_mask.clone()
        copy[0, 0, -1, :] = False
        attention_mask[0, 0, -1, :] = False  # in place
        out, weights = st.attention_forward(module, query, key, value, attention_mask, **kwargs)
        from_copy, _ = st.attention_forward(module, query, key, value, copy, **kwargs)
        outputs.append((out, from_copy))
        return out, weights

    calls = []
    _op_spy(monkeypatch, calls)
    monkeypatch.setitem(AttentionInterface._global_mapping, st.NAME, recording)
    config = make_config("llama")
    kwargs, _ = model_inputs("left")
    logits(make_model(config, "safeattn"), kwargs)
    assert len(outputs) == config.num_hidden_layers
    for out, from_copy in outputs:  # out: [B, Q, H, D]
        assert torch.all(out[0, -1] == 0), "the changed mask hides every key from that query"
        torch.testing.assert_close(out, from_copy, rtol=0, atol=0)
    assert all(mask is not None and mask[2] > 1 and not causal for _, causal, mask, _, _ in calls), calls


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_position_bias_is_added_on_top_of_the_mask(mask_kind):
    # T5-style decoders pass an additive position_bias; blocked keys stay blocked (-inf), so a
    # fully masked query row is still 0. query [B, H, Q, D], key/value [B, H, KV, D].
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 4, 5, 5, generator=g)
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    allowed[0, :, 1] = False  # a fully masked query row
    module = torch.nn.Module()
    module.is_causal = True
    if mask_kind == "none":
        mask, allowed = None, torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    elif mask_kind == "bool":
        mask = allowed
    else:
        mask = torch.zeros(2, 1, 5, 5).masked_fill(~allowed, float("-inf"))
    out, _ = st.attention_forward(module, query, key, value, mask, scaling=0.3, position_bias=bias)
    scores = (query.double() @ key.double().transpose(-1, -2)) * 0.3 + bias.double()
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows: 0
    expected = (weights @ value.double()).transpose(1, 2).float()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{mask_kind}: {m}")
    if mask_kind != "none":
        assert torch.all(out[0, 1] == 0), "the fully masked query row is 0"


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_composite_fallback_where_the_op_has_no_kernel(name, monkeypatch):
    """On a device without attention kernels (a build without CUDA, another accelerator) the composite
    runs, with the same logits as the reference and no NaN (softcap / sinks included)."""
    monkeypatch.setattr(st, "_ATTENTION_KERNEL_DEVICES", frozenset())
    assert st._attention_op(torch.device("cpu")) is None, "the op must be reported missing"
    config = make_config(name)
    kwargs, real = model_inputs("left")
    ours = logits(make_model(config, "safeattn"), kwargs)
    theirs = logits(make_model(config, reference_impl(name)), kwargs)
    assert not ours.isnan().any(), "no NaN anywhere, padded positions included"
    torch.testing.assert_close(ours[real], theirs[real], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
