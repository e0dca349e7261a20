"""``python -m safeattn bench``: the benchmark suite, over sequence lengths, with plots.

Each op is timed against its peers in the same run, at every sequence length, on fresh random
data (never zeros): the median of repeats taken round-robin across the implementations
(``_bench.time_ms`` per call: CUDA events on the GPU, perf_counter on the CPU). The
tables give each peer's time divided by safeattn's (> 1: safeattn is faster); the plots
(``--plot DIR``, one PNG per op) give throughput against sequence length.

The scripts in ``benchmarks/`` measure the same ops at fixed, larger shapes in more detail; this
suite is the sweep over sequence length that a user can run from an installed package.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import ops
from ._bench import mask_workload, time_ms

NEG_INF = float("-inf")


@dataclass
class Case:
    """One (op, sequence length, pass) point: the callables to time, safeattn's first."""

    op: str
    seq: int
    mode: str  # "fwd", "fwd+bwd", a mask kind, ...
    impls: dict[str, Callable[[], object]]
    work: float  # units of work per call, in the op's throughput unit (bytes, FLOPs, tokens)
    ms: dict[str, float] = field(default_factory=dict)

    def throughput(self, impl: str) -> float:
        return self.work / (self.ms[impl] * 1e-3)


@dataclass
class OpSuite:
    """How to benchmark one op: its modes, its throughput unit, and a case builder."""

    name: str
    unit: str  # what `work` counts, as plotted ("GB/s" means work is in bytes)
    scale: float  # divides work/s for display (1e9 for G...)
    modes: tuple[str, ...]
    build: Callable[[int, str, Settings], Case]
    note: str


@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    quick: bool


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def machine_name() -> str:
    """The CPU's model name (for benchmark tables and plots), or the platform's when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- sdpa_mask ---------------------------------------------------------------------------


def _mask_batch(s: Settings) -> int:
    return 2 if s.quick or s.device.type == "cpu" else 8


def _build_sdpa_mask(seq: int, mode: str, s: Settings) -> Case:
    import transformers.masking_utils as mu

    batch = _mask_batch(s)
    ours, theirs = mask_workload(mode, batch, seq, str(s.device), seed=seq)
    got, expected = ops.sdpa_mask(**ours), mu.sdpa_mask(**theirs)
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
            "safeattn": lambda: ops.sdpa_mask(**ours),
            "transformers": lambda: mu.sdpa_mask(**theirs),
            # The floor: allocating and filling a bool tensor of the same size.
            "bool fill_": lambda: torch.empty(numel, dtype=torch.bool, device=s.device).fill_(True),
        },
        work=numel,  # one byte per mask element
    )


# ---- safe_softmax and masked_softmax -----------------------------------------------------


def _scores(seq: int, s: Settings, heads: int, batch: int = 1) -> torch.Tensor:
    """Attention-shaped scores [B, H, S, S] with every 7th query row fully -inf."""
    x = torch.randn(batch, heads, seq, seq, device=s.device).mul_(2).to(s.dtype)
    x[:, :, ::7] = NEG_INF
    return x


def _softmax_where(x: torch.Tensor) -> torch.Tensor:
    """What users write by hand: softmax, then zero the rows that were all -inf."""
    return torch.where(x.isneginf().all(-1, keepdim=True), 0, torch.softmax(x, -1))


def _build_safe_softmax(seq: int, mode: str, s: Settings) -> Case:
    x = _scores(seq, s, heads=8)
    size = _element_size(s.dtype)
    if mode == "fwd":
        impls = {
            "safeattn": lambda: ops.safe_softmax(x, -1),
            "torch.softmax": lambda: torch.softmax(x, -1),
            "aten._safe_softmax": lambda: torch.ops.aten._safe_softmax(x, -1),
            "softmax+where": lambda: _softmax_where(x),
        }
        return Case("safe_softmax", seq, mode, impls, work=2 * x.numel() * size)  # read + write
    out = ops.safe_softmax(x, -1)
    grad = torch.randn_like(out)
    impls = {
        "safeattn": lambda: torch.ops.safeattn._safe_softmax_backward(grad, out, -1, s.dtype),
        # Also the backward of aten._safe_softmax (and of softmax+where, after its where).
        "torch.softmax": lambda: torch.ops.aten._softmax_backward_data(grad, out, -1, s.dtype),
    }
    return Case("safe_softmax", seq, mode, impls, work=3 * x.numel() * size)  # 2 reads + write


def _build_masked_softmax(seq: int, mode: str, s: Settings) -> Case:
    batch, heads = 2, 4
    x = torch.randn(batch, heads, seq, seq, device=s.device).to(s.dtype)
    pad = torch.ones(batch, seq, dtype=torch.bool)
    pad[1, : seq // 8] = False  # left padding: batch 1's first rows see nothing
    mask = ops.sdpa_mask(batch, seq, seq, padding_mask=pad).to(s.device)  # [B, 1, S, S] bool
    scale = 0.125
    finfo_min = torch.finfo(s.dtype).min
    impls = {
        "safeattn": lambda: ops.masked_softmax(x, mask, scale),
        "scale+masked_fill+_safe_softmax": lambda: torch.ops.aten._safe_softmax(
            (x * scale).masked_fill(~mask, NEG_INF), -1
        ),
        # Transformers' eager attention: a finfo.min bias added, then softmax.
        "scale+bias+softmax": lambda: torch.softmax(
            x * scale + torch.zeros((), dtype=s.dtype, device=s.device).masked_fill(~mask, finfo_min), -1
        ),
    }
    size = _element_size(s.dtype)
    return Case("masked_softmax", seq, mode, impls, work=2 * x.numel() * size)


# ---- attention ---------------------------------------------------------------------------


def _build_attention(seq: int, mode: str, s: Settings) -> Case:
    batch, heads, head_dim = 1, 8, 64
    backward = mode == "fwd+bwd"
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device=s.device, dtype=s.dtype).requires_grad_(backward)
        for _ in range(3)
    )
    pad = torch.ones(batch, seq, dtype=torch.bool)
    pad[:, : seq // 8] = False  # left padding: causal + padding mask, the first rows empty
    mask = ops.sdpa_mask(batch, seq, seq, padding_mask=pad).to(s.device)
    grad_out = torch.randn(batch, heads, seq, head_dim, device=s.device, dtype=s.dtype)

    def run(fn):
        if not backward:

            def forward():
                with torch.no_grad():
                    return fn()

            return forward
        # autograd.grad rather than .backward(): nothing accumulates into .grad between repeats.
        return lambda: torch.autograd.grad(fn(), (q, k, v), grad_out)

    impls = {
        "safeattn": run(lambda: ops.attention(q, k, v, attn_mask=mask)[0]),
        "sdpa (bool mask)": run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        # No padding: PyTorch's flash path, the ceiling for a causal mask without a tensor.
        "sdpa (is_causal, no padding)": run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    # Nominal FLOPs of the two matmuls (not halved for causal, the same for every peer); the
    # backward does 2.5x the forward's.
    flops = 4 * batch * heads * seq * seq * head_dim * (3.5 if backward else 1.0)
    return Case("attention", seq, mode, impls, work=flops)


# ---- a Transformers model ----------------------------------------------------------------


def _build_transformers(seq: int, mode: str, s: Settings) -> Case:
    from ._demo import left_padded_batch, tiny_llama, tiny_llama_config

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


SUITES = {
    suite.name: suite
    for suite in (
        OpSuite(
            "sdpa_mask",
            "Gmask elements/s",
            1e9,
            ("causal", "sliding"),
            _build_sdpa_mask,
            "[B, 1, S, S] bool, left padding on half the rows; bool fill_ = allocate + fill the same bytes",
        ),
        OpSuite(
            "safe_softmax",
            "GB/s",
            1e9,
            ("fwd", "bwd"),
            _build_safe_softmax,
            "rows of S over [1, 8, S, S], every 7th row all -inf; bytes an ideal kernel moves",
        ),
        OpSuite(
            "masked_softmax",
            "GB/s",
            1e9,
            ("fwd",),
            _build_masked_softmax,
            "scores [2, 4, S, S] with a causal + left-padding bool mask [2, 1, S, S]; scale 0.125",
        ),
        OpSuite(
            "attention",
            "GFLOP/s",
            1e9,
            ("fwd", "fwd+bwd"),
            _build_attention,
            "[1, 8, S, 64], causal + left-padding bool mask; nominal 4*S*S*D FLOPs per head (x3.5 with bwd)",
        ),
        OpSuite(
            "transformers",
            "tokens/s",
            1.0,
            ("prefill",),
            _build_transformers,
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


def run_bench(args: argparse.Namespace) -> int:
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
