"""sdpa_mask against Transformers' sdpa_mask and the bandwidth floor, in the same run.

The floor is a bool fill_ of the same size, including the fresh allocation both ops pay.

``python -m safeattn bench sdpa_mask [--device cpu|cuda] [--threads 2] [--quick] [--markdown]``:
B = 1, 8 and Q = KV = 1024, 4096 on the CPU (4096, 16384 on CUDA), the causal, sliding,
chunked and packed masks with padding on half the rows; each native mask is checked equal to
Transformers' before it is timed. On the GPU, bandwidth ("GB/s", "of fill") comes from the
GPU's own time for the kernels (the host's queuing hidden behind a spin kernel, for safeattn and
the fill alike); "call ms" and the speed-up over Transformers are end to end, host time included.
"""

from __future__ import annotations

import argparse

import torch

import safeattn

from ._bench import Case, Settings, markdown_table, mask_workload, time_ms

KINDS = ("causal", "sliding", "chunked", "packed")


# ---- the sweep over sequence length (python -m safeattn bench --op sdpa_mask) -------------


def sweep_case(seq: int, mode: str, s: Settings) -> Case:
    import transformers.masking_utils as mu

    batch = 2 if s.quick or s.device.type == "cpu" else 8
    ours, theirs = mask_workload(mode, batch, seq, str(s.device), seed=seq)
    got, expected = safeattn.sdpa_mask(**ours), mu.sdpa_mask(**theirs)
    if not torch.equal(got, expected.expand_as(got)):
        raise AssertionError(
            f"sdpa_mask {mode} B={batch} L={seq}: the native mask differs from Transformers'"
        )
    numel = batch * seq * seq
    return Case(
        "sdpa_mask",
        seq,
        mode,
        {
            "safeattn": lambda: safeattn.sdpa_mask(**ours),
            "transformers": lambda: mu.sdpa_mask(**theirs),
            # The floor: allocating and filling a bool tensor of the same size.
            "bool fill_": lambda: torch.empty(numel, dtype=torch.bool, device=s.device).fill_(True),
        },
        work=numel,  # one byte per mask element
    )


# ---- the fixed shapes of the README's tables (python -m safeattn bench sdpa_mask) ---------


def measure(device: str, batches, lengths, repeats: int) -> list[dict]:
    import transformers.masking_utils as mu

    rows = []
    for batch in batches:
        for length in lengths:
            numel = batch * length * length
            gpu_only = torch.device(device).type == "cuda"

            def fill(numel=numel):
                return torch.empty(numel, dtype=torch.bool, device=device).fill_(True)

            fill_ms = time_ms(fill, device, repeats, gpu_only=gpu_only)
            for kind in KINDS:
                ours, theirs = mask_workload(kind, batch, length, device)
                got = safeattn.sdpa_mask(**ours)
                expected = mu.sdpa_mask(**theirs)
                assert torch.equal(got, expected.expand_as(got)), f"{kind} B={batch} L={length}: masks differ"
                del got, expected
                ours_ms = time_ms(
                    lambda ours=ours: safeattn.sdpa_mask(**ours), device, repeats, gpu_only=gpu_only
                )
                call_ms = (
                    time_ms(lambda ours=ours: safeattn.sdpa_mask(**ours), device, repeats)
                    if gpu_only
                    else ours_ms
                )
                theirs_ms = time_ms(
                    lambda theirs=theirs: mu.sdpa_mask(**theirs), device, max(3, repeats // 2)
                )
                rows.append(
                    dict(
                        batch=batch,
                        length=length,
                        kind=kind,
                        ours_ms=ours_ms,
                        call_ms=call_ms,
                        transformers_ms=theirs_ms,
                        fill_ms=fill_ms,
                        gbps=numel / ours_ms / 1e6,
                    )
                )
    return rows


def print_table(rows: list[dict], device: str) -> None:
    print(
        f"\nsdpa_mask on {device}: padding on half the rows; fill = bool fill_ of the same size (the floor)"
    )
    print("| B | Q=KV | mask | safeattn ms | GB/s | of fill | call ms | transformers ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['length']} | {r['kind']} | {r['ours_ms']:.3f} | {r['gbps']:.1f} | "
            f"{r['fill_ms'] / r['ours_ms']:.0%} | {r['call_ms']:.3f} | {r['transformers_ms']:.3f} | "
            f"{r['transformers_ms'] / r['call_ms']:.1f}x |"
        )


def readme_table(rows: list[dict], device: str) -> str:
    """The README's table: on the CPU, where a call is all host time, without the GPU's columns
    (GB/s, call ms)."""
    gpu = torch.device(device).type == "cuda"
    header = ["B", "Q=KV", "mask", "safeattn ms"] + (["GB/s"] if gpu else []) + ["of fill"]
    header += (["call ms"] if gpu else []) + ["transformers ms", "speed-up"]
    table = []
    for r in rows:
        cells = [r["batch"], r["length"], r["kind"], f"{r['ours_ms']:.3f}"]
        cells += [f"{r['gbps']:.0f}"] if gpu else []
        cells.append(f"{r['fill_ms'] / r['ours_ms']:.0%}")
        cells += [f"{r['call_ms']:.3f}"] if gpu else []
        cells += [f"{r['transformers_ms']:.3f}", f"{r['transformers_ms'] / r['call_ms']:.1f}x"]
        table.append(cells)
    return markdown_table(header, table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: by device)")
    parser.add_argument("--lengths", type=int, nargs="+", help="Q = KV lengths (default: by device)")
    parser.add_argument("--markdown", action="store_true", help="also print the README's table")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.quick:
        batches, lengths, repeats = (1, 2), (256,), 3
    elif args.device == "cuda":
        batches, lengths, repeats = (1, 8), (4096, 16384), 20
    else:
        batches, lengths, repeats = (1, 8), (1024, 4096), 10
    batches, lengths = args.batches or batches, args.lengths or lengths
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
        + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "")
    )
    rows = measure(args.device, batches, lengths, repeats)
    print_table(rows, args.device)
    if args.markdown:
        print(f"\nREADME table (sdpa_mask, {args.device}):\n")
        print(readme_table(rows, args.device))
    return 0
