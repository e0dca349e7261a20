"""safe_softmax / masked_softmax (forward and backward) against PyTorch peers.

``python -m safeattn bench softmax [--device cpu|cuda] [--threads 2] [--elements 16777216]
[--dtypes bf16,fp32] [--shapes 1048576x1024,...] [--profile] [--markdown]``:

CPU (default: 2 threads): rows of 1k, 8k and 64k columns, float32 and bfloat16, about 16M
elements per case. Peers measured in the same run: torch.softmax, torch.ops.aten._safe_softmax,
and softmax followed by a where that zeroes all -inf rows (what users write by hand). Backward
peers: aten._softmax_backward_data (the backward of both torch.softmax and _safe_softmax) and,
for softmax+where, a where then that op.

CUDA (--device cuda): the target shapes [1M x 1024], [131k x 8192], [4096 x 65536],
[4M x 128], float32 and bfloat16; peers: a device-to-device copy (dst.copy_(src), the
bandwidth floor), torch.softmax, aten._safe_softmax; plus masked_softmax with a [B, 1, Q, KV]
bool mask against scale + masked_fill + _safe_softmax. Bandwidth counts the bytes an ideal
kernel moves: forward read + write, backward two reads + one write. ``--profile`` runs the
kernels untimed instead, for Nsight Compute (benchmarks/profile.sh).

Times are medians of repeats over rotating fresh random inputs (never zeros).

The sweep over sequence length (``python -m safeattn bench --op safe_softmax masked_softmax``)
takes its cases from ``sweep_case_safe_softmax`` and ``sweep_case_masked_softmax`` below.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import safeattn

from ._bench import Case, Settings, element_size, markdown_table

NEG_INF = float("-inf")


def softmax_where(x, dim=-1):
    out = torch.softmax(x, dim)
    return torch.where(x.isneginf().all(dim, keepdim=True), 0, out)


def softmax_where_backward(grad, out, x_is_empty_row, dim, dtype):
    grad = torch.where(x_is_empty_row, 0, grad)
    return torch.ops.aten._softmax_backward_data(grad, out, dim, dtype)


# ---- the sweep over sequence length (python -m safeattn bench --op ...) -------------------


def _scores(seq: int, s: Settings, heads: int, batch: int = 1) -> torch.Tensor:
    """Attention-shaped scores [B, H, S, S] with every 7th query row fully -inf."""
    x = torch.randn(batch, heads, seq, seq, device=s.device).mul_(2).to(s.dtype)
    x[:, :, ::7] = NEG_INF
    return x


def sweep_case_safe_softmax(seq: int, mode: str, s: Settings) -> Case:
    x = _scores(seq, s, heads=8)
    size = element_size(s.dtype)
    if mode == "fwd":
        impls = {
            "safeattn": lambda: safeattn.safe_softmax(x, -1),
            "torch.softmax": lambda: torch.softmax(x, -1),
            "aten._safe_softmax": lambda: torch.ops.aten._safe_softmax(x, -1),
            "softmax+where": lambda: softmax_where(x),
        }
        return Case("safe_softmax", seq, mode, impls, work=2 * x.numel() * size)  # read + write
    out = safeattn.safe_softmax(x, -1)
    grad = torch.randn_like(out)
    impls = {
        "safeattn": lambda: torch.ops.safeattn._safe_softmax_backward(grad, out, -1, s.dtype),
        # Also the backward of aten._safe_softmax (and of softmax+where, after its where).
        "torch.softmax": lambda: torch.ops.aten._softmax_backward_data(grad, out, -1, s.dtype),
    }
    return Case("safe_softmax", seq, mode, impls, work=3 * x.numel() * size)  # 2 reads + write


def sweep_case_masked_softmax(seq: int, mode: str, s: Settings) -> Case:
    batch, heads = 2, 4
    x = torch.randn(batch, heads, seq, seq, device=s.device).to(s.dtype)
    pad = torch.ones(batch, seq, dtype=torch.bool)
    pad[1, : seq // 8] = False  # left padding: batch 1's first rows see nothing
    mask = safeattn.sdpa_mask(batch, seq, seq, padding_mask=pad).to(s.device)  # [B, 1, S, S] bool
    scale = 0.125
    finfo_min = torch.finfo(s.dtype).min
    impls = {
        "safeattn": lambda: safeattn.masked_softmax(x, mask, scale),
        "scale+masked_fill+_safe_softmax": lambda: torch.ops.aten._safe_softmax(
            (x * scale).masked_fill(~mask, NEG_INF), -1
        ),
        # Transformers' eager attention: a finfo.min bias added, then softmax.
        "scale+bias+softmax": lambda: torch.softmax(
            x * scale + torch.zeros((), dtype=s.dtype, device=s.device).masked_fill(~mask, finfo_min), -1
        ),
    }
    size = element_size(s.dtype)
    return Case("masked_softmax", seq, mode, impls, work=2 * x.numel() * size)


# ---- the fixed shapes of the README's tables (python -m safeattn bench softmax) -----------


class Timer:
    def __init__(self, device, repeats, warmup):
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def __call__(self, fn, inputs):
        """Median seconds of fn(*inputs[i % len(inputs)])."""
        for i in range(self.warmup):
            fn(*inputs[i % len(inputs)])
        times = []
        if self.device == "cuda":
            for i in range(self.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*inputs[i % len(inputs)])
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for i in range(self.repeats):
                t0 = time.perf_counter()
                fn(*inputs[i % len(inputs)])
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def fresh(shape, dtype, device, n):
    """n random inputs with a few all -inf rows (the case safe softmax exists for)."""
    xs = []
    for _ in range(n):
        x = torch.randn(shape, device=device, dtype=torch.float32).mul_(2).to(dtype)
        x[:: max(1, shape[0] // 7)] = NEG_INF
        xs.append(x)
    return xs


def print_table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)))


def bench_cpu(args):
    torch.set_num_threads(args.threads)
    timer = Timer("cpu", args.repeats, 2)
    ms = lambda t: f"{t * 1e3:.2f}"  # noqa: E731
    fwd_rows, bwd_rows = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for cols in (1024, 8192, 65536):
            shape = (max(1, args.elements // cols), cols)
            xs = fresh(shape, dtype, "cpu", 2)
            ours = timer(lambda x: torch.ops.safeattn.safe_softmax(x, -1), [(x,) for x in xs])
            soft = timer(lambda x: torch.softmax(x, -1), [(x,) for x in xs])
            safe = timer(lambda x: torch.ops.aten._safe_softmax(x, -1), [(x,) for x in xs])
            where = timer(softmax_where, [(x,) for x in xs])
            name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
            fwd_rows.append(
                [name, f"{shape[0]}x{cols}", ms(ours), ms(soft), ms(safe), ms(where)]
                + [f"{soft / ours:.2f}x", f"{safe / ours:.2f}x", f"{where / ours:.2f}x"]
            )
            outs = [torch.ops.safeattn.safe_softmax(x, -1) for x in xs]
            grads = [torch.randn(shape, dtype=dtype) for _ in xs]
            empty = [x.isneginf().all(-1, keepdim=True) for x in xs]
            bargs = list(zip(grads, outs, strict=True))
            ours_b = timer(
                lambda g, y, dt=dtype: torch.ops.safeattn._safe_softmax_backward(g, y, -1, dt), bargs
            )
            torch_b = timer(lambda g, y, dt=dtype: torch.ops.aten._softmax_backward_data(g, y, -1, dt), bargs)
            where_b = timer(
                lambda g, y, e, dt=dtype: softmax_where_backward(g, y, e, -1, dt),
                list(zip(grads, outs, empty, strict=True)),
            )
            bwd_rows.append(
                [name, f"{shape[0]}x{cols}", ms(ours_b), ms(torch_b), ms(where_b)]
                + [f"{torch_b / ours_b:.2f}x", f"{where_b / ours_b:.2f}x"]
            )
        # masked_softmax with a [B, 1, Q, KV] bool mask over [B, H, Q, KV] scores, against the
        # PyTorch composition (scale, masked_fill, _safe_softmax).
        kv = 1024
        b, h = 2, 4
        q = max(1, args.elements // (b * h * kv))
        scores = [torch.randn(b, h, q, kv).to(dtype) for _ in range(2)]
        masks = [torch.rand(b, 1, q, kv) > 0.2 for _ in range(2)]
        margs = list(zip(scores, masks, strict=True))
        ours_m = timer(lambda s, m: torch.ops.safeattn.masked_softmax(s, m, 0.125, -1, None), margs)
        torch_m = timer(
            lambda s, m: torch.ops.aten._safe_softmax((s * 0.125).masked_fill(~m, NEG_INF), -1), margs
        )
        fwd_rows.append(
            [
                name,
                f"masked {b}x{h}x{q}x{kv}",
                ms(ours_m),
                "",
                ms(torch_m),
                "",
                "",
                f"{torch_m / ours_m:.2f}x",
                "",
            ]
        )
    print(f"CPU, {args.threads} threads, ~{args.elements} elements per case, median of {args.repeats} (ms)")
    print_table(
        "forward",
        [
            "dtype",
            "shape",
            "ours",
            "softmax",
            "_safe_softmax",
            "softmax+where",
            "vs softmax",
            "vs _safe",
            "vs +where",
        ],
        fwd_rows,
    )
    print("  (masked row: the peer in the _safe_softmax column is scale + masked_fill + _safe_softmax)")
    print_table(
        "backward",
        ["dtype", "shape", "ours", "softmax bwd", "where+softmax bwd", "vs softmax/_safe", "vs +where"],
        bwd_rows,
    )
    return fwd_rows, bwd_rows


DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def profile_cuda(dtypes, shapes):
    """Our forward and backward, then torch.softmax's forward, twice each, untimed: a short run
    to put under ncu."""
    for dtype in dtypes:
        for shape in shapes:
            (x,) = fresh(shape, dtype, "cuda", 1)
            for _ in range(2):
                out = torch.ops.safeattn.safe_softmax(x, -1)
            for _ in range(2):
                torch.softmax(x, -1)
            grad = torch.randn_like(out)
            for _ in range(2):
                torch.ops.safeattn._safe_softmax_backward(grad, out, -1, dtype)
            del x, out, grad
    torch.cuda.synchronize()
    print(f"profiled {len(dtypes) * len(shapes)} cases")


def bench_cuda(args):
    dtypes = [DTYPE_NAMES[d] for d in args.dtypes.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.profile:
        profile_cuda(dtypes, shapes)
        return None
    timer = Timer("cuda", args.repeats, 5)
    fwd_rows, bwd_rows = [], []
    for dtype in dtypes:
        size = torch.tensor([], dtype=dtype).element_size()
        name = {v: k for k, v in DTYPE_NAMES.items()}[dtype]
        for shape in shapes:
            numel = shape[0] * shape[1]
            xs = fresh(shape, dtype, "cuda", 2)
            dst = torch.empty_like(xs[0])
            copy = timer(lambda x, dst=dst: dst.copy_(x), [(x,) for x in xs])
            ours = timer(lambda x: torch.ops.safeattn.safe_softmax(x, -1), [(x,) for x in xs])
            soft = timer(lambda x: torch.softmax(x, -1), [(x,) for x in xs])
            safe = timer(lambda x: torch.ops.aten._safe_softmax(x, -1), [(x,) for x in xs])

            def gbs(t, reads, numel=numel, size=size):
                return f"{(reads + 1) * numel * size / t / 1e9:.0f}"

            fwd_rows.append(
                [name, f"{shape[0]}x{shape[1]}", gbs(copy, 1), gbs(ours, 1), gbs(soft, 1), gbs(safe, 1)]
                + [f"{copy / ours:.0%}", f"{soft / ours:.2f}x", f"{safe / ours:.2f}x"]
            )
            del dst
            outs = [torch.ops.safeattn.safe_softmax(x, -1) for x in xs]
            del xs
            grads = [torch.randn(shape, device="cuda", dtype=dtype) for _ in outs]
            bargs = list(zip(grads, outs, strict=True))
            ours_b = timer(
                lambda g, y, dt=dtype: torch.ops.safeattn._safe_softmax_backward(g, y, -1, dt), bargs
            )
            torch_b = timer(lambda g, y, dt=dtype: torch.ops.aten._softmax_backward_data(g, y, -1, dt), bargs)
            # The copy floor for a two-input kernel: the same bytes per element moved by copies.
            bwd_rows.append(
                [name, f"{shape[0]}x{shape[1]}", gbs(ours_b, 2), gbs(torch_b, 2)]
                + [f"{(3 / 2) * copy / ours_b:.0%}", f"{torch_b / ours_b:.2f}x"]
            )
            del outs, grads, bargs
            torch.cuda.empty_cache()
        # masked_softmax with a [B, 1, Q, KV] bool mask over [B, H, Q, KV] scores (the attention
        # case) against scale + masked_fill + _safe_softmax; bytes: scores read + output written.
        b, h, q, kv = 8, 16, 1024, 1024
        scores = [torch.randn(b, h, q, kv, device="cuda").to(dtype) for _ in range(2)]
        masks = [torch.rand(b, 1, q, kv, device="cuda") > 0.2 for _ in range(2)]
        margs = list(zip(scores, masks, strict=True))
        ours_m = timer(lambda s, m: torch.ops.safeattn.masked_softmax(s, m, 0.125, -1, None), margs)
        torch_m = timer(
            lambda s, m: torch.ops.aten._safe_softmax((s * 0.125).masked_fill(~m, NEG_INF), -1), margs
        )
        moved = 2 * b * h * q * kv * size
        ours_gbs, torch_gbs = f"{moved / ours_m / 1e9:.0f}", f"{moved / torch_m / 1e9:.0f}"
        label = f"masked {b}x{h}x{q}x{kv}"
        fwd_rows.append([name, label, "", ours_gbs, "", torch_gbs, "", "", f"{torch_m / ours_m:.2f}x"])
        del scores, masks, margs
    print(f"CUDA, {torch.cuda.get_device_name()}, median of {args.repeats} (GB/s)")
    print_table(
        "forward",
        ["dtype", "shape", "copy", "ours", "softmax", "_safe_softmax", "of copy", "vs softmax", "vs _safe"],
        fwd_rows,
    )
    print("  (masked rows: the _safe_softmax column is scale + masked_fill + _safe_softmax)")
    print_table(
        "backward (torch's _softmax_backward_data is also _safe_softmax's backward)",
        ["dtype", "shape", "ours", "softmax bwd", "of copy", "vs softmax/_safe"],
        bwd_rows,
    )
    return fwd_rows, bwd_rows


_MASKED_PEER = "(scale + masked_fill + _safe_softmax)"


def readme_tables(fwd_rows, bwd_rows, device: str) -> str:
    """The README's forward and backward tables, from the rows printed above (same numbers).

    CPU: ms, without the softmax+where peer; CUDA: GB/s. A masked_softmax row names its shape
    and its peer in the aten._safe_softmax column.
    """

    def masked(row) -> bool:
        return row[1].startswith("masked ")

    def masked_label(row) -> str:
        dims = row[1].split()[1].split("x")
        return f"masked_softmax {row[0]} " + (f"[{', '.join(dims)}]" if device == "cpu" else "x".join(dims))

    if device == "cpu":
        fwd_header = [
            "forward",
            "safeattn",
            "torch.softmax",
            "aten._safe_softmax",
            "vs softmax",
            "vs _safe_softmax",
        ]
        fwd = [
            [masked_label(r), r[2], "", f"{r[4]} {_MASKED_PEER}", "", r[7]]
            if masked(r)
            else [f"{r[0]} {r[1]}", r[2], r[3], r[4], r[6], r[7]]
            for r in fwd_rows
        ]
        bwd_header = ["backward", "safeattn", "softmax backward (also _safe_softmax's)", "vs it"]
        bwd = [[f"{r[0]} {r[1]}", r[2], r[3], r[5]] for r in bwd_rows]
    else:
        fwd_header = ["forward", "copy", "safeattn", "torch.softmax", "aten._safe_softmax", "of copy"]
        fwd_header += ["vs softmax", "vs _safe_softmax"]
        fwd = [
            [masked_label(r), "", r[3], "", f"{r[5]} {_MASKED_PEER}", "", "", r[8]]
            if masked(r)
            else [f"{r[0]} {r[1]}", *r[2:9]]
            for r in fwd_rows
        ]
        bwd_header = ["backward", "safeattn", "softmax backward (also _safe_softmax's)", "of copy", "vs it"]
        bwd = [[f"{r[0]} {r[1]}", *r[2:6]] for r in bwd_rows]
    return markdown_table(fwd_header, fwd) + "\n\n" + markdown_table(bwd_header, bwd)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--elements", type=int, default=1 << 24, help="elements per CPU case")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 9 CPU, 50 CUDA)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="CUDA: comma list of bf16, fp16, fp32")
    parser.add_argument(
        "--shapes", default="1048576x1024,131072x8192,4096x65536,4194304x128", help="CUDA: comma list of RxC"
    )
    parser.add_argument(
        "--profile", action="store_true", help="CUDA: run our kernels twice, untimed (for ncu)"
    )
    parser.add_argument("--markdown", action="store_true", help="also print the README's tables")


def run(args: argparse.Namespace) -> int:
    if args.repeats is None:
        args.repeats = 9 if args.device == "cpu" else 50
    if args.device == "cuda":
        rows = bench_cuda(args)
    else:
        rows = bench_cpu(args)
    if args.markdown and rows is not None:
        print(f"\nREADME tables (softmax, {args.device}):\n")
        print(readme_tables(*rows, args.device))
    return 0
