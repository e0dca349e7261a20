"""sdpa_mask against Transformers' sdpa_mask and the bandwidth floor (a bool fill_ of the same
size, including the fresh allocation both ops pay), measured in the same run.

On the GPU, bandwidth ("GB/s", "of fill") comes from the GPU's own time for the kernels (the
host's queuing hidden behind a spin kernel, for safeattn and the fill alike); "call ms" and the
speed-up over Transformers are end to end, host time included.

    python benchmarks/bench_sdpa_mask.py [--device cpu|cuda] [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse

import safeattn
import torch
import transformers.masking_utils as mu
from safeattn._bench import mask_workload, time_ms

KINDS = ("causal", "sliding", "chunked", "packed")


def run(device: str, batches, lengths, repeats: int) -> list[dict]:
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
                ours_ms = time_ms(lambda ours=ours: safeattn.sdpa_mask(**ours), device, repeats, gpu_only=gpu_only)
                call_ms = time_ms(lambda ours=ours: safeattn.sdpa_mask(**ours), device, repeats) if gpu_only else ours_ms
                theirs_ms = time_ms(lambda theirs=theirs: mu.sdpa_mask(**theirs), device, max(3, repeats // 2))
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
    print(f"\nsdpa_mask on {device}: padding on half the rows; fill = bool fill_ of the same size (the floor)")
    print("| B | Q=KV | mask | safeattn ms | GB/s | of fill | call ms | transformers ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['length']} | {r['kind']} | {r['ours_ms']:.3f} | {r['gbps']:.1f} | "
            f"{r['fill_ms'] / r['ours_ms']:.0%} | {r['call_ms']:.3f} | {r['transformers_ms']:.3f} | "
            f"{r['transformers_ms'] / r['call_ms']:.1f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: by device)")
    parser.add_argument("--lengths", type=int, nargs="+", help="Q = KV lengths (default: by device)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        batches, lengths, repeats = (1, 2), (256,), 3
    elif args.device == "cuda":
        batches, lengths, repeats = (1, 8), (4096, 16384), 20
    else:
        batches, lengths, repeats = (1, 8), (1024, 4096), 10
    batches, lengths = args.batches or batches, args.lengths or lengths
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads" + (
        f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    print_table(run(args.device, batches, lengths, repeats), args.device)


if __name__ == "__main__":
    main()
