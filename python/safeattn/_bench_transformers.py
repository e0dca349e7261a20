"""attn_implementation="safeattn" against "sdpa" and "eager" in a small Llama-shaped model.

Prefill (B=8, 2048 tokens, left padding averaging 10% of each row) and decode (64 new tokens,
DynamicCache) forwards, each implementation timed in the same run on fresh random tokens:
median time per forward, and the time spent building the attention mask (the mask interface
function, timed around each call) with its share of the forward, and each implementation's
time divided by safeattn's ("vs safeattn" > 1: safeattn is faster).

    python -m safeattn bench transformers [--device cpu] [--threads 2] [--batch 8] [--seq 2048] [--markdown]

The model has random weights (no download): hidden 256, 2 layers, 8 query heads over 2
key/value heads of dim 32, vocabulary 1000. ``--markdown`` also prints the README's table.

The sweep over sequence length (``python -m safeattn bench --op transformers``: the demo's tiny
Llama, prefill only) takes its case from ``sweep_case`` below.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import safeattn

from ._bench import Case, Settings, left_padded_batch, markdown_table, tiny_llama, tiny_llama_config

IMPLEMENTATIONS = ("safeattn", "sdpa", "eager")


# ---- the sweep over sequence length (python -m safeattn bench --op transformers) ----------


def sweep_case(seq: int, mode: str, s: Settings) -> Case:
    config = tiny_llama_config(quick=s.quick)
    batch = 2 if s.quick or s.device.type == "cpu" else 8
    input_ids, attention_mask = left_padded_batch(batch, seq, config.vocab_size, s.device, seed=seq)
    dtype = s.dtype if s.device.type == "cuda" else torch.float32

    def prefill(model):
        def forward():
            with torch.no_grad():
                return model(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1
                )

        return forward

    impls = {
        impl: prefill(tiny_llama(config, impl, s.device, dtype)) for impl in ("safeattn", "sdpa", "eager")
    }
    return Case("transformers", seq, mode, impls, work=batch * seq)


# ---- the fixed shapes of the README's table (python -m safeattn bench transformers) -------


class MaskTimer:
    """Wraps the mask interface functions so that each call's wall time is accumulated."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self.saved = {}

    def __enter__(self):
        from transformers.masking_utils import AttentionMaskInterface

        mapping = AttentionMaskInterface._global_mapping
        for name in IMPLEMENTATIONS:
            self.saved[name] = fn = mapping[name]
            mapping[name] = self._timed(fn)
        return self

    def __exit__(self, *exc):
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface._global_mapping.update(self.saved)

    def _timed(self, fn):
        def timed(**kwargs):
            sync(self.device)
            start = time.perf_counter()
            out = fn(**kwargs)
            sync(self.device)
            self.seconds += time.perf_counter() - start
            return out

        return timed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_model(impl: str, device, dtype):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    return tiny_llama(config, impl, device, dtype)


def batch(batch_size: int, seq: int, device, seed: int):
    """Random tokens with left padding of 0-20% of each row (10% on average)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 1000, (batch_size, seq), generator=g)
    attention_mask = torch.ones(batch_size, seq, dtype=torch.long)
    for row in range(batch_size):
        pads = int(seq * 0.2 * row / max(batch_size - 1, 1))
        attention_mask[row, :pads] = 0
    return input_ids.to(device), attention_mask.to(device)


def time_forward(model, kwargs, device, timer: MaskTimer):
    """(seconds, seconds spent in the mask function, output) of one forward."""
    timer.seconds = 0.0
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model(**kwargs)
    sync(device)
    return time.perf_counter() - start, timer.seconds, out


def measure(models: dict, args, device, timer: MaskTimer) -> dict:
    """Median (forward, mask) seconds per implementation and phase.

    Implementations take turns on every repeat and every decode step, so that a change in the
    machine's load during the run weighs on all of them alike.
    """
    samples = {impl: {"prefill": [], "decode": []} for impl in models}
    for repeat in range(args.warmup + args.repeats):
        input_ids, attention_mask = batch(args.batch, args.seq, device, seed=repeat)
        for impl, model in models.items():
            kwargs = dict(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1
            )
            total, mask, _ = time_forward(model, kwargs, device, timer)
            if repeat >= args.warmup:
                samples[impl]["prefill"].append((total, mask))

    input_ids, attention_mask = batch(args.batch, args.seq, device, seed=100)
    caches = {}
    for impl, model in models.items():
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
        caches[impl] = time_forward(model, kwargs, device, timer)[2].past_key_values
    g = torch.Generator().manual_seed(1)
    for step in range(args.new_tokens):
        token = torch.randint(3, 1000, (args.batch, 1), generator=g).to(device)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(args.batch, 1)], dim=1)
        for impl, model in models.items():
            kwargs = dict(
                input_ids=token, attention_mask=attention_mask, past_key_values=caches[impl], use_cache=True
            )
            total, mask, _ = time_forward(model, kwargs, device, timer)
            if step >= 2:  # the first steps warm up
                samples[impl]["decode"].append((total, mask))

    return {
        impl: {
            phase: (statistics.median(t for t, _ in values), statistics.median(m for _, m in values))
            for phase, values in phases.items()
        }
        for impl, phases in samples.items()
    }


def readme_table(rows: dict) -> str:
    """The README's table, from the medians printed above (same numbers)."""
    table = []
    for phase in ("prefill", "decode"):
        ours = rows["safeattn"][phase][0]
        for impl in IMPLEMENTATIONS:
            total, mask = rows[impl][phase]
            forward_ms = f"{total * 1e3:.0f}" if total >= 0.1 else f"{total * 1e3:.2f}"
            table.append(
                [
                    phase,
                    impl,
                    forward_ms,
                    f"{mask * 1e3:.3g}",
                    f"{100 * mask / total:.1f}%",
                    f"{total / ours:.2f}x",
                ]
            )
    header = ["phase", "attn_implementation", "ms / forward", "mask ms", "mask share", "vs safeattn"]
    lines = markdown_table(header, table).splitlines()
    lines[1] = "|---|---|---:|---:|---:|---:|"  # numbers right-aligned
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--markdown", action="store_true", help="also print the README's table")


def run(args: argparse.Namespace) -> int:
    import transformers

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    models = {impl: make_model(impl, device, dtype) for impl in IMPLEMENTATIONS}
    with MaskTimer(device) as timer:
        rows = measure(models, args, device, timer)

    print(
        f"# transformers {transformers.__version__}, torch {torch.__version__}, safeattn {safeattn.__version__}, "
        f"{args.device} ({torch.get_num_threads()} threads), {args.dtype}"
    )
    print(
        f"# Llama-shaped: hidden 256, 2 layers, 8 q heads / 2 kv heads, head dim 32; batch {args.batch}, "
        f"prefill {args.seq} tokens (left padding 0-20%), decode {args.new_tokens} tokens"
    )
    print(
        f"{'phase':8} {'attn_implementation':20} {'ms/forward':>11} {'mask ms':>9} {'mask share':>10} "
        f"{'vs safeattn':>12}"
    )
    for phase in ("prefill", "decode"):
        ours = rows["safeattn"][phase][0]
        for impl in IMPLEMENTATIONS:
            total, mask = rows[impl][phase]
            print(
                f"{phase:8} {impl:20} {total * 1e3:11.2f} {mask * 1e3:9.3f} {100 * mask / total:9.1f}% "
                f"{total / ours:11.2f}x"
            )

    if args.markdown:
        print(f"\nREADME table (transformers, {args.device}):\n")
        print(readme_table(rows))
    return 0
