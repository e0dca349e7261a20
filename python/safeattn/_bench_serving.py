"""Continuous batching: Transformers' ``generate_batch`` with ``paged|safeattn`` against ``paged|sdpa``.

A Llama-shaped model with random weights (``bench model``'s shape options; default 8 layers,
hidden 2048, 16 query heads over 4 kv heads of 128, bf16 on CUDA) serves ``--requests`` requests
of mixed prompt lengths (uniform in ``[--min-prompt, --max-prompt]``, seeded) through
``model.generate_batch``: greedy, ``--new-tokens`` tokens each, no early stop, the paged cache
sized by ``--num-blocks`` pages of ``--block-size`` tokens and ``--max-batch-tokens`` tokens a
step. Each implementation runs the same requests in the same process, in turns, after a warm-up
round; reported: the wall time of ``generate_batch`` (median of ``--repeats``), generated tokens a
second, the ratio to the fastest implementation, and whether its greedy tokens equal the first
implementation's. On the CPU Transformers sizes the cache from the free memory, which it reads with
psutil; the bench reports 1 GiB free when psutil is missing.

    python -m safeattn bench serving --device cuda [--markdown]
    python -m safeattn bench serving --tiny            # a small model, seconds on a CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ._bench import machine_name, markdown_table

IMPLEMENTATIONS = ("paged|sdpa", "paged|safeattn")


def _prompts(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g)
    return [torch.randint(3, args.vocab, (int(n),), generator=g).tolist() for n in lengths]


def _serve(model, prompts, args):
    import transformers

    generation = transformers.GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    batching = transformers.ContinuousBatchingConfig(
        block_size=args.block_size, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens
    )
    out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    return {request: list(result.generated_tokens) for request, result in out.items()}


def _cpu_memory_for_the_cache():
    """Without psutil Transformers counts the CPU's free memory as 0 and sizes no cache."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        from transformers.generation.continuous_batching import cache

        cache.get_device_and_memory_breakdown = lambda: (torch.device("cpu"), 2**30, 0, 0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impl", nargs="+", default=list(IMPLEMENTATIONS))
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="2 layers, hidden 128, 4/2 heads of 32, 8 requests of 4-40 tokens + 8 new (a CPU check)",
    )
    parser.add_argument("--markdown", action="store_true", help="also print the README's table")


def run(args: argparse.Namespace) -> int:
    import transformers

    from . import _bench_model

    if not hasattr(transformers, "ContinuousBatchingConfig"):
        print(f"bench serving: transformers {transformers.__version__} has no continuous batching config")
        return 2
    if args.tiny:
        args.layers, args.hidden, args.mlp, args.heads, args.kv_heads, args.head_dim = 2, 128, 256, 4, 2, 32
        args.vocab, args.requests, args.min_prompt, args.max_prompt, args.new_tokens = 512, 8, 4, 40, 8
        args.block_size, args.num_blocks, args.max_batch_tokens, args.repeats = 16, 64, 64, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench serving: --device cuda but no CUDA device is visible")
        return 2
    if device.type == "cpu":
        _cpu_memory_for_the_cache()
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    args.seq = args.max_prompt + args.new_tokens
    config = _bench_model.model_config(args)
    prompts = _prompts(args)
    where = torch.cuda.get_device_name() if device.type == "cuda" else machine_name()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {where}, {dtype}; "
        f"{args.requests} requests of {args.min_prompt}-{args.max_prompt} prompt tokens + {args.new_tokens} new"
    )
    results = {}
    for impl in args.impl:
        model = _bench_model.make_model(config, impl, device, dtype)
        _serve(model, prompts[: max(1, len(prompts) // 4)], args)  # warm-up
        times, tokens = [], None
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = _serve(model, prompts, args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        results[impl] = (statistics.median(times), tokens)
        del model
    first = next(iter(results.values()))[1]
    best = min(t for t, _ in results.values())
    rows = []
    for impl, (seconds, tokens) in results.items():
        generated = sum(len(t) for t in tokens.values())
        same = tokens == first
        rows.append(
            [
                impl.replace("|", "\\|"),
                f"{seconds:.3f}",
                f"{generated / seconds:.0f}",
                f"{best / seconds:.2f}x",
                "yes" if same else "NO",
            ]
        )
        print(
            f"{impl:<16} {seconds:8.3f} s  {generated / seconds:8.0f} tokens/s  vs best {best / seconds:.2f}x  same tokens: {same}"
        )
    if args.markdown:
        print(f"\nREADME table (serving, {where}):\n")
        print(
            markdown_table(
                ["implementation", "seconds", "tokens/s", "vs best", "same tokens as the first"], rows
            )
        )
    return 0
