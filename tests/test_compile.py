"""Guarantees under torch.compile (inductor, dynamic shapes, CUDA graphs), for every safeattn op.

For each op (and its private backward op):

- ``torch.compile(fullgraph=True, dynamic=True)`` traces it with no graph break (counted with
  ``torch._dynamo.explain``) and compiles one frame for 5 sequence lengths (no recompilation);
- inductor on CPU (and CUDA where a GPU is visible) gives eager's results and gradients, and
  every output's ``requires_grad`` equals eager's, including the pattern of pytorch #169179 (a
  tensor built by sliced assignment inside the compiled region, then fed to the op);
- ``mode="reduce-overhead"`` (CUDA graphs, GPU only): replays with new inputs copied into the
  static buffers give eager's results and gradients.

Then the scenario of pytorch #178244 / transformers #44458 (a closure-composed padding mask, a
prefill then a decode step that recompiles, inductor's C++ backend) through the Transformers
integration. torch.export / AOTInductor live in test_export.py, threads in test_concurrency.py.
"""

from __future__ import annotations

import inspect

import pytest
import safeattn
import torch
from _op_cases import (
    CASE_PARAMS,
    HAS_ATTENTION,
    assert_same,
    clone_inputs,
    make_inputs,
    run,
)
from conftest import DEVICES, NEEDS_CUDA
from torch._dynamo.testing import CompileCounterWithBackend

# Five sequence lengths (none is 0 or 1, which dynamo specialises on), odd and even.
LENGTHS = (5, 7, 11, 16, 23)


# ---- torch.compile(fullgraph=True, dynamic=True) -----------------------------------------------


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_no_graph_break(case):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(case.fn)(*make_inputs(case, 7, "cpu"))
    assert explanation.graph_break_count == 0, f"{case.name}: graph breaks: {explanation.break_reasons}"
    assert explanation.graph_count == 1, f"{case.name}: {explanation.graph_count} graphs, expected 1"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.slow
def test_inductor_matches_eager_without_recompiling(case, device):
    """One inductor frame for 5 lengths; outputs, gradients and requires_grad equal eager's."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(case.fn, backend=counter, fullgraph=True, dynamic=True)
    frames = []  # backend compiles so far, after each length
    for n in LENGTHS:
        args = make_inputs(case, n, device)
        want_out, want_grad = run(case.fn, clone_inputs(args))
        got_out, got_grad = run(compiled, clone_inputs(args))
        frames.append(counter.frame_count)
        assert_same(got_out, want_out, f"{case.name} n={n} output")
        if want_grad is not None or got_grad is not None:
            assert (
                want_grad is not None and got_grad is not None
            ), f"{case.name} n={n}: gradients in one run only"
            assert_same(got_grad, want_grad, f"{case.name} n={n} gradient")
    assert (
        frames[-1] == frames[0]
    ), f"{case.name}: recompiled: backend compiles {frames} after lengths {LENGTHS}"
    assert frames[0] == 1, f"{case.name}: the first compile traced {frames[0]} times (a restarted trace)"


def _default_argument_calls():
    calls = [
        ("sdpa_mask", lambda x: safeattn.sdpa_mask(x.shape[0], x.shape[2], x.shape[2])),
        ("safe_softmax", lambda x: safeattn.safe_softmax(x, -1)),
        ("masked_softmax", lambda x: safeattn.masked_softmax(x)),
    ]
    params = [pytest.param(fn, id=name) for name, fn in calls]
    if HAS_ATTENTION:
        float_defaults = [
            name
            for name, p in inspect.signature(safeattn.attention).parameters.items()
            if isinstance(p.default, float)
        ]
        reason = (
            f"safeattn.attention's float defaults {float_defaults} make dynamo restart the trace under "
            "dynamic=True (the op's `float` arguments force the dynamic scalar back to a constant); fix: "
            "int defaults (dropout_p: float = 0, softcap: float = 0), as masked_softmax's scale = 1"
        )
        mark = pytest.mark.xfail(bool(float_defaults), reason=reason, strict=True)
        params.append(pytest.param(lambda x: safeattn.attention(x, x, x), id="attention", marks=mark))
    return params


@pytest.mark.parametrize("fn", _default_argument_calls())
def test_default_arguments_trace_once(fn):
    """Each public function called with its defaults compiles in one pass. A float default (such
    as masked_softmax's scale=1.0) is wrapped by dynamo as a dynamic scalar under dynamic=True,
    which the op's `float` argument then forces back to a constant by restarting the whole
    compile: every compiled caller would trace twice."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for n in (5, 9):
        x = torch.randn(2, 3, n, 8)  # [B, H, S, D]: the sequence length varies
        got, want = compiled(x), fn(x)
        if isinstance(want, torch.Tensor):
            got, want = (got,), (want,)
        assert_same(got, want, f"n={n}")
    assert counter.frame_count == 1, f"{counter.frame_count} backend compiles (a restarted trace), expected 1"


@pytest.mark.skipif(not HAS_ATTENTION, reason="safeattn.attention is not built")
def test_attention_with_grad_does_not_guard_on_head_dim():
    """The default scale 1/sqrt(head_dim) is resolved inside the ops, so a compiled training step
    traces once for several head dims (the autograd wrapper once computed it in Python, which
    guarded on the head dim: one recompile per head dim)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def step(q, k, v):
        return (safeattn.attention(q, k, v, is_causal=True)[0],)

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for head_dim in (8, 16, 24):
        gen = torch.Generator().manual_seed(head_dim)
        inputs = [torch.randn(2, 3, 9, head_dim, generator=gen).requires_grad_() for _ in range(3)]
        want_out, want_grad = run(step, clone_inputs(inputs))
        got_out, got_grad = run(compiled, clone_inputs(inputs))
        assert_same(got_out, want_out, f"head_dim={head_dim} output")
        assert_same(got_grad, want_grad, f"head_dim={head_dim} gradient")
    assert counter.frame_count == 1, f"{counter.frame_count} backend compiles for 3 head dims, expected 1"


# ---- CUDA graphs -----------------------------------------------------------------------------------


@NEEDS_CUDA
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_cuda_graphs_replay_matches_eager(case):
    """mode="reduce-overhead": each call after the warm-up replays a CUDA graph whose static input
    buffers receive the new inputs; the results and gradients must be eager's for those inputs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(case.fn, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # warm-up, record, then replays; fresh data every step
        args = make_inputs(case, 8, "cuda", seed=step)
        want_out, want_grad = run(case.fn, clone_inputs(args))
        torch.compiler.cudagraph_mark_step_begin()
        got_out, got_grad = run(compiled, clone_inputs(args))
        # Outputs of a replay live in the graph's pool until the next replay: compare now.
        assert_same(got_out, want_out, f"{case.name} step {step} output")
        if want_grad is not None:
            assert got_grad is not None, f"{case.name} step {step}: no gradient under CUDA graphs"
            assert_same(got_grad, want_grad, f"{case.name} step {step} gradient")
    assert (
        counters["inductor"]["cudagraph_skips"] == 0
    ), f"{case.name}: inductor skipped CUDA graphs (see the 'skipping cudagraphs' log)"


# ---- pytorch #178244 / transformers #44458 -----------------------------------------------------


def _closure_mask(attention_mask):
    """The padding mask captured in a closure, as Transformers' padding_mask_function does."""

    def mask(batch_size, q_length, kv_length, q_offset):
        return safeattn.sdpa_mask(batch_size, q_length, kv_length, q_offset, padding_mask=attention_mask)

    return mask


class _TinyDecoder(torch.nn.Module):
    """x: [B, S, 16], attention_mask: [B, P + S], past k/v: [B, 2, P, 8] -> (out, k, v)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, attention_mask, past_k, past_v):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        kv = k.shape[2]
        mask = _closure_mask(attention_mask)(b, s, kv, kv - s)  # [B, 1, S, P + S]
        out = safeattn.masked_softmax(q @ k.transpose(-1, -2), mask, 8**-0.5) @ v
        if HAS_ATTENTION:
            out = out + safeattn.attention(q, k, v, mask)[0]
        return out, k, v


def test_closure_padding_mask_prefill_then_decode_inductor_cpu():
    """pytorch #178244 without Transformers: the padding mask captured in a closure builds the
    mask through sdpa_mask; prefill (S = 6), then a decode step (S = 1 over the cache) that
    recompiles; inductor's C++ backend, no assert_indirect_indexing workaround."""
    assert torch._inductor.config.assert_indirect_indexing, "the test must run without the workaround"
    torch.manual_seed(0)
    model = _TinyDecoder().eval()
    x = torch.randn(2, 6, 16)
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    attention_mask[0, :3] = 0
    step = torch.randn(2, 1, 16)
    grown = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], 1)
    empty = torch.zeros(2, 2, 0, 8)

    def prefill_then_decode(forward):
        out, k, v = forward(x, attention_mask, empty, empty)
        decoded, _, _ = forward(step, grown, k, v)
        return out, decoded

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    with torch.no_grad():
        want = prefill_then_decode(model)
        got = prefill_then_decode(torch.compile(model, backend=counter))
    assert counter.frame_count == 2, f"{counter.frame_count} frames: the decode step should recompile once"
    assert torch.equal(got[0][0, :, :3], torch.zeros_like(got[0][0, :, :3])), "padded queries give 0"
    for what, g, w in zip(("prefill", "decode"), got, want, strict=True):
        assert not g.isnan().any(), f"{what}: NaN in the compiled output"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers, config


def test_transformers_closure_padding_mask_prefill_then_decode_inductor_cpu():
    """A left-padded batch through a tiny Llama with attn_implementation="safeattn": Transformers
    composes the mask as closures (and_masks(causal, padding_mask_function(attention_mask))), the
    safeattn mask interface builds it natively. Prefill, then a decode step with the cache (new
    shapes: a recompile), with inductor's C++ backend and without the
    assert_indirect_indexing=False workaround. Logits equal eager's, and no NaN."""
    pytest.importorskip("safeattn.transformers", reason="the Transformers integration is not in this build")
    transformers, config = _tiny_llama()
    assert torch._inductor.config.assert_indirect_indexing, "the test must run without the workaround"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="safeattn").eval()
    input_ids = torch.randint(1, 64, (2, 6))
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    attention_mask[0, :3] = 0  # left padding: row 0's first 3 queries see no key
    next_ids = torch.randint(1, 64, (2, 1))

    def generate_one(forward):
        cache = transformers.DynamicCache(config=config)
        prefill = forward(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits
        decode = forward(
            input_ids=next_ids,
            attention_mask=torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], 1),
            past_key_values=cache,
        ).logits
        return prefill, decode

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        want = generate_one(model)
        got = generate_one(compiled)
    assert counter.frame_count >= 2, "the decode step was expected to recompile (that is the scenario)"
    for what, g, w in zip(("prefill", "decode"), got, want, strict=True):
        assert not g.isnan().any(), f"{what}: NaN in compiled logits"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5, msg=lambda m, what=what: f"{what}: {m}")
