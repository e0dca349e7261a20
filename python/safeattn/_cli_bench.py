"""``python -m safeattn bench``: the benchmark suite.

Two forms, one suite (each op's cases live in ``_bench_<op>.py``, shared timing in ``_bench.py``):

- ``python -m safeattn bench [--op OP ...] [--plot DIR]``: the sweep over sequence length. Each
  op is timed against its peers in the same run, at every sequence length, on fresh random data
  (never zeros): the median of repeats taken round-robin across the implementations
  (``_bench.time_ms`` per call: CUDA events on the GPU, perf_counter on the CPU). The tables give
  each peer's time divided by safeattn's (> 1: safeattn is faster); the plots (``--plot DIR``,
  one PNG per op) give throughput against sequence length.
- ``python -m safeattn bench {sdpa_mask,softmax,attention,decode,serving,transformers,model} [options] [--markdown]``:
  the fixed, larger shapes of the README's tables, in more detail (each module's docstring says
  what it measures); ``--markdown`` also prints the README's tables from the same run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import (
    _bench_attention,
    _bench_decode,
    _bench_model,
    _bench_sdpa_mask,
    _bench_serving,
    _bench_softmax,
    _bench_transformers,
)
from ._bench import Case, Settings, machine_name, time_ms

# The fixed-shape tables: python -m safeattn bench <name> [options].
TABLES = {
    "sdpa_mask": _bench_sdpa_mask,
    "softmax": _bench_softmax,
    "attention": _bench_attention,
    "decode": _bench_decode,
    "serving": _bench_serving,
    "transformers": _bench_transformers,
    "model": _bench_model,
}


@dataclass
class OpSuite:
    """How to benchmark one op: its modes, its throughput unit, and a case builder."""

    name: str
    unit: str  # what `work` counts, as plotted ("GB/s" means work is in bytes)
    scale: float  # divides work/s for display (1e9 for G...)
    modes: tuple[str, ...]
    build: Callable[[int, str, Settings], Case]
    note: str


SUITES = {
    suite.name: suite
    for suite in (
        OpSuite(
            "sdpa_mask",
            "Gmask elements/s",
            1e9,
            ("causal", "sliding"),
            _bench_sdpa_mask.sweep_case,
            "[B, 1, S, S] bool, left padding on half the rows; bool fill_ = allocate + fill the same bytes",
        ),
        OpSuite(
            "safe_softmax",
            "GB/s",
            1e9,
            ("fwd", "bwd"),
            _bench_softmax.sweep_case_safe_softmax,
            "rows of S over [1, 8, S, S], every 7th row all -inf; bytes an ideal kernel moves",
        ),
        OpSuite(
            "masked_softmax",
            "GB/s",
            1e9,
            ("fwd",),
            _bench_softmax.sweep_case_masked_softmax,
            "scores [2, 4, S, S] with a causal + left-padding bool mask [2, 1, S, S]; scale 0.125",
        ),
        OpSuite(
            "attention",
            "GFLOP/s",
            1e9,
            ("fwd", "fwd+bwd"),
            _bench_attention.sweep_case,
            "[1, 8, S, 64], causal + left-padding bool mask; nominal 4*S*S*D FLOPs per head (x3.5 with bwd)",
        ),
        OpSuite(
            "transformers",
            "tokens/s",
            1.0,
            ("prefill",),
            _bench_transformers.sweep_case,
            "tiny random Llama prefill, left padding, attn_implementation per column",
        ),
    )
}


def lengths(device: torch.device, quick: bool) -> tuple[int, ...]:
    if quick:
        return (64, 128, 256)
    return (256, 512, 1024, 2048) if device.type == "cpu" else (1024, 2048, 4096, 8192)


# ---- timing, progress, tables, plots ----


def time_interleaved(
    impls: dict[str, Callable[[], object]], device: torch.device, repeats: int
) -> dict[str, float]:
    """Median ms of each callable, the repeats taken round-robin (a, b, c, a, b, c, ...).

    Interleaving gives every implementation the same share of whatever else the machine is
    doing, so the ratios stay fair on a shared or throttling machine. Each callable runs twice
    untimed first (warm-up: allocator, caches, lazy initialisation).
    """
    for fn in impls.values():
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            times[name].append(time_ms(fn, device, repeats=1, warmup=0))
    return {name: statistics.median(t) for name, t in times.items()}


# ---- progress, tables, plots -------------------------------------------------------------


class Progress:
    """A tqdm bar on stderr if tqdm is installed, else a one-line text counter.

    begin(label) names the case being measured; end() counts it done.
    """

    def __init__(self, total: int):
        self.total, self.done, self.label = total, 0, ""
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.bar = (
            None if tqdm is None else tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True)
        )

    def begin(self, label: str) -> None:
        self.label = label
        if self.bar is not None:
            self.bar.set_description(label)
        else:
            sys.stderr.write(f"\r[{self.done + 1}/{self.total}] {label:<40}")
            sys.stderr.flush()

    def end(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            if self.done == self.total:
                self.bar.close()
        elif self.done == self.total:
            sys.stderr.write(f"\r[{self.done}/{self.total}] done{' ' * 40}\n")
            sys.stderr.flush()


def print_tables(suite: OpSuite, cases: list[Case], header_line: str) -> None:
    print(f"\n## {suite.name} ({header_line})")
    print(f"{suite.note}")
    for mode in suite.modes:
        rows = [c for c in cases if c.mode == mode]
        if not rows:
            continue
        impls = list(rows[0].impls)
        peers = impls[1:]
        head = [
            "S",
            *(f"{i} ms" for i in impls),
            f"safeattn {suite.unit}",
            *(f"{p} / safeattn" for p in peers),
        ]
        print(f"\n{mode}:")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for c in rows:
            cells = [str(c.seq)]
            cells += [f"{c.ms[i]:.3f}" for i in impls]
            cells.append(_num(c.throughput("safeattn") / suite.scale))
            cells += [f"{c.ms[p] / c.ms['safeattn']:.2f}x" for p in peers]
            print("| " + " | ".join(cells) + " |")


def _num(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def plot(suite: OpSuite, cases: list[Case], directory: str, title_line: str) -> str:
    """One PNG per op: throughput against sequence length, a colour per implementation, a line
    style per mode."""
    import os

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=80)
    styles = ("-", "--", ":", "-.")
    impls = list(dict.fromkeys(i for c in cases for i in c.impls))
    colours = {impl: f"C{n}" for n, impl in enumerate(impls)}
    for style, mode in zip(styles, suite.modes, strict=False):
        rows = [c for c in cases if c.mode == mode]
        for impl in impls:
            pts = [(c.seq, c.throughput(impl) / suite.scale) for c in rows if impl in c.ms]
            if not pts:
                continue
            label = impl if len(suite.modes) == 1 else f"{impl} ({mode})"
            ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, color=colours[impl], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c.seq for c in cases}), [str(s) for s in sorted({c.seq for c in cases})])
    ax.set_xlabel("sequence length S")
    ax.set_ylabel(suite.unit)
    ax.set_title(f"{suite.name}\n{title_line}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(directory, f"{suite.name}.png")
    fig.savefig(path)
    plt.close(fig)
    return path


# ---- the command -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--op", nargs="+", choices=list(SUITES), default=None, help="ops to run (default: all)"
    )
    parser.add_argument("--plot", metavar="DIR", default=None, help="write <op>.png plots into DIR")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (CI)")
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths to sweep")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per point")
    tables = parser.add_subparsers(
        dest="table",
        metavar="{" + ",".join(TABLES) + "}",
        help="instead of the sweep: one op's fixed-shape tables (the README's); options after the name",
    )
    for name, module in TABLES.items():
        sub = tables.add_parser(
            name,
            help=module.__doc__.splitlines()[0],
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)


def run_bench(args: argparse.Namespace) -> int:
    if args.table is not None:
        return TABLES[args.table].run(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    )
    settings = Settings(device, dtype, args.quick)
    seqs = tuple(args.seq) if args.seq else lengths(device, args.quick)
    repeats = args.repeats or (3 if args.quick else (10 if device.type == "cpu" else 30))
    suites = [SUITES[name] for name in (args.op or SUITES)]
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{machine_name()}, {torch.get_num_threads()} thread{'' if torch.get_num_threads() == 1 else 's'}"
    )
    import safeattn

    title = f"{where}, {str(dtype).removeprefix('torch.')}"
    print(
        f"# safeattn {safeattn.__version__} bench on {device.type}: {title}; torch {torch.__version__}; "
        f"median of {repeats}; 'X / safeattn' > 1 means safeattn is faster"
    )
    results: dict[str, list[Case]] = {}
    total = sum(len(s.modes) for s in suites) * len(seqs)
    progress = Progress(total)
    for suite in suites:
        for seq in seqs:
            for mode in suite.modes:
                progress.begin(f"{suite.name} S={seq} {mode}")
                case = suite.build(seq, mode, settings)
                case.ms = time_interleaved(case.impls, device, repeats)
                case.impls = {impl: None for impl in case.impls}  # free the inputs the closures hold
                results.setdefault(suite.name, []).append(case)
                progress.end()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for suite in suites:
        print_tables(suite, results[suite.name], title)
        if args.plot:
            print(f"plot: {plot(suite, results[suite.name], args.plot, title)}")
    if any(not math.isfinite(c.ms[i]) for cases in results.values() for c in cases for i in c.ms):
        return 1
    return 0
