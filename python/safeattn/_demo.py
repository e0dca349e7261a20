"""``python -m safeattn demo``: what safeattn changes, shown on a tiny model and on bare ops.

Three sections, each measured in the same run:

1. A Llama-family model with random weights (built from ``LlamaConfig``, nothing downloaded) on a
   left-padded batch, run with ``attn_implementation`` "eager", "sdpa" and "safeattn": the largest
   logit difference on real tokens against "sdpa", what the attention output holds on padded
   query rows (NaN count, non-zero count; read at the input of each layer's ``o_proj``), and the
   time per forward, eager and under ``torch.compile``.
2. ``safe_softmax``, ``masked_softmax`` and ``attention`` on a batch whose first query rows see
   no key, forward and backward, next to ``torch.softmax`` and ``F.scaled_dot_product_attention``
   given the same masks.
3. Native masks next to Transformers' ``sdpa_mask``: equality and timings.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from . import ops
from ._bench import left_padded_batch, mask_workload, time_ms, tiny_llama, tiny_llama_config

IMPLEMENTATIONS = ("eager", "sdpa", "safeattn")


def _draw(mask: torch.Tensor) -> str:
    return "\n".join("    " + " ".join("■" if v else "⬚" for v in row) for row in mask.tolist())


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> str:
    """Right-aligned columns, the first left-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        first = str(cells[0]).ljust(widths[0])
        return indent + "  ".join(
            [first, *(str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))]
        )

    return "\n".join([line(header), *(line(r) for r in rows)])


# ---- 1. a tiny Llama with left padding ---------------------------------------------------


class _PaddedRowSpy:
    """Counts NaN and non-zero values of the attention output on padded query rows.

    A forward pre-hook on each layer's ``o_proj`` sees the attention output ([B, S, H * D]) before
    it is projected back: what attention made of rows that had nothing to attend to.
    """

    def __init__(self, model, padded: torch.Tensor):
        self.padded = padded  # [B, S] bool: True on padding tokens
        self.nan = self.nonzero = self.total = 0
        self.handles = [
            layer.self_attn.o_proj.register_forward_pre_hook(self._hook) for layer in model.model.layers
        ]

    def _hook(self, module, args):
        rows = args[0][self.padded]  # [padded tokens, H * D]
        self.nan += int(rows.isnan().sum())
        self.nonzero += int((rows.nan_to_num(0.0) != 0).sum())
        self.total += rows.numel()

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _forward_ms(model, input_ids, attention_mask, device, repeats: int) -> float:
    with torch.no_grad():
        return time_ms(
            lambda: model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False),
            device,
            repeats=repeats,
            warmup=2,
        )


def model_section(device: torch.device, quick: bool, compile: bool) -> list[dict]:
    """One row per implementation: logit difference against sdpa, padded-row contents, timings."""
    import transformers

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batch_size, length = (2, 32) if quick else ((4, 256) if device.type == "cpu" else (8, 1024))
    config = tiny_llama_config(quick)
    input_ids, attention_mask = left_padded_batch(batch_size, length, config.vocab_size, device)
    padded, real = attention_mask == 0, attention_mask == 1
    repeats = 3 if quick else 10
    print(
        f"1. Llama-family model, random weights (hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} query / {config.num_key_value_heads} key-value heads), {dtype}, "
        f"B={batch_size}, S={length}, {int(padded.sum())} left-padding tokens "
        f"(transformers {transformers.__version__})"
    )
    results, logits = [], {}
    for impl in IMPLEMENTATIONS:
        model = tiny_llama(config, impl, device, dtype)
        spy = _PaddedRowSpy(model, padded)
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        spy.remove()
        logits[impl] = out.logits.float()
        row = dict(impl=impl, nan=spy.nan, nonzero=spy.nonzero, total=spy.total)
        row["logits_nan"] = int(out.logits[real].isnan().sum())
        row["eager_ms"] = _forward_ms(model, input_ids, attention_mask, device, repeats)
        row["compiled_ms"] = None
        if compile:
            torch._dynamo.reset()  # each implementation compiles from scratch, not into a stale cache
            compiled = torch.compile(model)
            start = time.perf_counter()
            with torch.no_grad():
                compiled(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            row["compile_s"] = time.perf_counter() - start
            row["compiled_ms"] = _forward_ms(compiled, input_ids, attention_mask, device, repeats)
        results.append(row)
        del model
    for row in results:
        row["max_diff"] = float((logits[row["impl"]] - logits["sdpa"])[real].abs().max())

    def ms(value):
        return "-" if value is None else f"{value:.2f}"

    header = [
        "attn_implementation",
        "max |logit - sdpa| (real tokens)",
        "NaN (padded rows)",
        "non-zero (padded rows)",
        "ms/forward",
        "compiled ms/forward",
    ]
    rows = [
        [
            r["impl"],
            f"{r['max_diff']:.1e}",
            f"{r['nan']}/{r['total']}",
            f"{r['nonzero']}/{r['total']}",
            ms(r["eager_ms"]),
            ms(r["compiled_ms"]),
        ]
        for r in results
    ]
    print(_table(header, rows))
    if compile:
        print(
            "  (torch.compile: first call "
            + ", ".join(f"{r['impl']} {r['compile_s']:.0f} s" for r in results)
            + "; padded rows counted over every layer's attention output)"
        )
    # What each implementation made of the padded rows, in words, from the numbers above.
    said = []
    for r in results:
        if r["nan"]:
            said.append(f"{r['impl']} NaN")
        elif r["nonzero"]:
            said.append(f"{r['impl']} non-zero values (a uniform average of the values)")
        else:
            said.append(f"{r['impl']} 0")
    print(f"  Padded query rows attend to no key. Measured there: {'; '.join(said)}.")
    print(
        "  safeattn returns 0 on such rows by contract, on every device; the others by their backend's choice.\n"
    )
    return results


# ---- 2. the ops on fully masked rows -----------------------------------------------------


def _grad_stats(grad: torch.Tensor, dead: torch.Tensor) -> tuple[int, float]:
    """(NaN count anywhere, largest |value| on the fully masked rows) of a gradient."""
    g = grad[dead]
    return int(grad.isnan().sum()), float(g.nan_to_num(float("inf")).abs().max())


def ops_section(device: torch.device) -> list[dict]:
    """safeattn's ops and PyTorch's on a batch whose first two query rows of batch 1 see nothing."""
    torch.manual_seed(0)
    batch, heads, length, head_dim = 2, 2, 6, 8
    # mask: [B, 1, S, S], True attends: causal, batch 1 left-padded by 2 tokens. Its first two
    # query rows (the padding tokens) see no key: key 0 and 1 are padding too.
    pad = torch.tensor([[1] * length, [0, 0] + [1] * (length - 2)], dtype=torch.bool)
    mask = ops.sdpa_mask(batch, length, length, padding_mask=pad).to(device)
    dead = ~mask.any(-1).expand(batch, heads, length)  # [B, H, S]: rows with no visible key
    scores = torch.randn(batch, heads, length, length, device=device)
    q, k, v = (torch.randn(batch, heads, length, head_dim, device=device) for _ in range(3))
    finfo_min = torch.finfo(scores.dtype).min
    print(
        f"2. Ops on a batch with fully masked rows: scores [B={batch}, H={heads}, Q=KV={length}], "
        f"{int(dead.sum())} of {dead.numel()} query rows see no key"
    )
    print(_draw(mask[1, 0].cpu()))
    print("  (batch 1's mask; forward and backward with a random upstream gradient)")

    softmax_cases = {
        "torch.softmax(-inf filled)": lambda s: torch.softmax(s.masked_fill(~mask, float("-inf")), -1),
        "torch.softmax(finfo.min filled)": lambda s: torch.softmax(s.masked_fill(~mask, finfo_min), -1),
        "safeattn.safe_softmax(-inf filled)": lambda s: ops.safe_softmax(
            s.masked_fill(~mask, float("-inf")), -1
        ),
        "safeattn.masked_softmax(scores, mask)": lambda s: ops.masked_softmax(s, mask),
    }
    attention_cases = {
        # Attention written out, as many models' eager paths do it.
        "softmax(q @ k^T * scale, -inf filled) @ v": lambda q, k, v: (
            torch.softmax(
                (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(~mask, float("-inf")), -1
            )
            @ v
        ),
        "F.scaled_dot_product_attention(bool mask)": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask
        ),
        "F.scaled_dot_product_attention(finfo.min bias)": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, finfo_min)
        ),
        "safeattn.attention(bool mask)": lambda q, k, v: ops.attention(q, k, v, attn_mask=mask)[0],
    }
    results = []
    for name, fn in softmax_cases.items():
        x = scores.clone().requires_grad_()
        out = fn(x)
        (grad,) = torch.autograd.grad(out, x, torch.randn_like(out))
        results.append(_op_row(name, out, dead, [("scores", grad, dead)]))
    for name, fn in attention_cases.items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
        results.append(
            _op_row(
                name,
                out,
                dead,
                [("query", grads[0], dead), ("key", grads[1], None), ("value", grads[2], None)],
            )
        )
    header = [
        "call",
        "NaN in output",
        "max |out| on empty rows",
        "NaN in gradients",
        "max |grad scores/q| on empty rows",
    ]
    rows = [
        [r["name"], str(r["out_nan"]), _fmt(r["out_dead"]), str(r["grad_nan"]), _fmt(r["grad_dead"])]
        for r in results
    ]
    print(_table(header, rows))
    print(
        "  An empty row has no softmax. -inf filling makes 0/0 = NaN, which reaches the gradient of what the\n"
        "  probabilities multiply (the values); finfo.min filling makes a uniform average: finite garbage, with\n"
        "  gradients into the padded query. SDPA's result on empty rows depends on the backend PyTorch picks.\n"
        "  safeattn defines the row as 0 with 0 gradient.\n"
    )
    return results


def _fmt(value: float) -> str:
    return "nan" if value != value else f"{value:.3g}"


def _op_row(name, out, dead, grads) -> dict:
    out_dead = out.detach()[dead]
    grad_nan = sum(int(g.isnan().sum()) for _, g, _ in grads)
    first_name, first_grad, first_dead = grads[0]
    g_dead = first_grad[first_dead] if first_dead is not None else first_grad
    return dict(
        name=name,
        out_nan=int(out.detach().isnan().sum()),
        out_dead=float(out_dead.abs().max()),  # NaN when NaN is there (max propagates it)
        grad_nan=grad_nan,
        grad_dead=float(g_dead.abs().max()),
    )


# ---- 3. native masks against Transformers' -----------------------------------------------


def mask_section(device: torch.device, quick: bool) -> bool:
    import transformers.masking_utils as mu

    pad = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    small = ops.sdpa_mask(1, 6, 6, sliding_window=3, padding_mask=pad)
    print("3. Masks built natively. A sliding-window (3) causal mask with two left-padding tokens:")
    print(_draw(small[0, 0]))
    print("  Rows 0 and 1 attend to nothing: safeattn's softmax and attention give 0 there, not NaN.\n")

    batch, length = (2, 256) if quick else (8, 2048)
    print(f"  Prefill masks, B={batch}, Q=KV={length}, half the rows left-padded:")
    print(f"  {'mask':<10}{'transformers ms':>17}{'safeattn ms':>13}{'speed-up':>10}  equal")
    all_equal = True
    for kind in ("causal", "sliding", "chunked", "packed"):
        ours, theirs = mask_workload(kind, batch, length, str(device))
        expected = mu.sdpa_mask(**theirs)
        got = ops.sdpa_mask(**ours)
        equal = torch.equal(got, expected.expand_as(got))
        all_equal &= equal
        repeats = 5 if quick else 10
        t_theirs = time_ms(lambda theirs=theirs: mu.sdpa_mask(**theirs), device, repeats=repeats)
        t_ours = time_ms(lambda ours=ours: ops.sdpa_mask(**ours), device, repeats=repeats)
        print(
            f"  {kind:<10}{t_theirs:>17.3f}{t_ours:>13.3f}{t_theirs / t_ours:>9.1f}x  {'yes' if equal else 'NO'}"
        )
    return all_equal


def run_demo(device: str | None = None, quick: bool = False, compile: bool = True) -> int:
    import transformers

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    where = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    )
    print(
        f"safeattn demo on {device.type} ({where}; torch {torch.__version__}, "
        f"transformers {transformers.__version__})\n"
    )
    models = model_section(device, quick, compile)
    op_rows = ops_section(device)
    masks_equal = mask_section(device, quick)
    # The demo is also a smoke test: it fails if safeattn made a NaN or a wrong mask.
    ours = next(r for r in models if r["impl"] == "safeattn")
    ok = masks_equal and ours["nan"] == 0 and ours["nonzero"] == 0 and ours["logits_nan"] == 0
    ok &= all(r["out_nan"] == 0 and r["grad_nan"] == 0 for r in op_rows if r["name"].startswith("safeattn"))
    if not ok:
        print("\nFAILED: safeattn produced a NaN, a non-zero padded row or a mask unlike Transformers'")
    return 0 if ok else 1
