"""The attention sweep: ``python -m safeattn bench attention --device cuda --sweep``.

safeattn against the best peer that runs each case, forward and forward+backward, bf16, on
fresh random inputs (the timing and the peers of ``_bench_attention``). A full cross product
of lengths, head dims, GQA ratios and masks would be thousands of timings and a FlexAttention
compile for most of them, so the sweep varies one or two axes at a time around a base shape:
B*S = 16384 tokens (``--tokens``; B = tokens // S, at least 1, so S = 32768 runs B = 1),
Hq = 16, D = 128, S = 4096, causal. The axes (a case on several axes is run once):

  seq       S 512, 1k, 2k, 4k, 8k, 16k, 32k       none, causal, padding
  head_dim  D 64, 96, 128, 256                    none, causal, padding, bias1H
  gqa       Hq:Hkv 16:16, 16:4, 16:2              causal, padding, window1024, packed8
  mask      the base shape                        every kind below
  window    W 256 and 1024 at S 2k; 256, 1024, 4096 at S 8k and 32k
  chunk     C 512 and 2048 at S 4k; 512, 2048, 8192 at S 32k
  packed    2, 4, 8, 16, 32, 64 documents a row at S 4k; 2, 8, 64 at S 32k
  bias      bias1H and biasB1 at S 1k, 2k, 4k, 8k; biasBH at S 4k

``--quick`` keeps a few values of each axis (its extremes: 17 cases, 9 of them with Flex), and
times fewer calls (10 after 3 warm-up, against 30 after 5).

Masks (``safeattn`` is the described mask, a ``MaskDescription``; ``safeattn dense`` the same
mask drawn by ``sdpa_mask`` as ``[B|1, 1, S, S]`` bool, for the target "described never slower
than dense"):
  none, causal  no mask / ``is_causal``; peers SDPA cuDNN and SDPA flash (``sdpa_kernel``)
  padding       causal + left padding: row b has (b % 4 + 1) * S / 16 padding keys (the first
                query rows see no key); ``MaskDescription(padding_mask=...)``
  windowW       causal sliding window of W keys; ``MaskDescription(sliding_window=W)``
  chunkC        causal chunks of C positions; ``MaskDescription(chunk_size=C)``
  packedN       N documents a row (random lengths, a fixed seed), causal within each;
                ``MaskDescription(packed_ids=..., packed_ids_are_runs=True)``
  bias1H/biasB1/biasBH  causal + a learnable bf16 bias ``[1, H, S, S]`` / ``[B, 1, S, S]`` /
                ``[B, H, S, S]`` whose gradient the backward computes; peers Flex with the bias
                captured by a ``score_mod``, and SDPA's memory-efficient kernel with causality
                drawn into its own copy of the bias
The described masks (padding, window, chunk, packed) are timed against compiled FlexAttention
with the same rule as a block mask (built once per case; Flex is compiled once per shape and
mask, as its users run it). SDPA with a dense mask is left out: with causal + padding at B4 H16
S4096 D128 it runs at half Flex's speed (DESIGN.md). A peer that cannot run a case (flash or cuDNN refusing a shape,
Flex failing to compile, out of memory) is skipped and the table says why.

Targets (DESIGN.md) checked in the summary: every case >= 1.0x the best peer; described masks
>= 1.2x Flex forward and >= 1.1x forward+backward; described never slower than dense; learnable
bias forward+backward >= 1.2x Flex.

  python -m safeattn bench attention --sweep --dry-run [--quick]     # the cases, no GPU needed
  python -m safeattn bench attention --device cuda --sweep --quick --time-limit 270 --json q.json
  python -m safeattn bench attention --device cuda --sweep --sweep-axis mask --sweep-filter S=4096
  python -m safeattn bench attention --sweep --report a.json b.json   # one table from saved runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import safeattn

from ._bench import markdown_table
from ._bench_attention import attempt_ms, compiled_flex

BASE_SEQ, BASE_HEADS, BASE_HEAD_DIM = 4096, 16, 128
SEQS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
AXES = ("seq", "head_dim", "gqa", "mask", "window", "chunk", "packed", "bias")

OURS, DENSE = "safeattn", "safeattn dense"
# The peers each family of masks is timed against, in the order they are timed.
PEERS = {
    "plain": ("SDPA cuDNN", "SDPA flash"),
    "described": ("Flex",),
    "bias": ("Flex", "SDPA efficient"),
}
PASSES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class SweepCase:
    seq: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    mask: str  # none, causal, padding, window<W>, chunk<C>, packed<N>, bias1H, biasB1, biasBH
    axes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"S={self.seq} B={self.batch} H={self.heads}:{self.kv_heads} D={self.head_dim} {self.mask}"

    @property
    def family(self) -> str:
        return mask_family(self.mask)

    def impl_names(self) -> tuple[str, ...]:
        return (OURS, DENSE if self.family == "described" else None, *PEERS[self.family])


def mask_kind(mask: str) -> tuple[str, int | None]:
    """("window", 256) for "window256"; ("bias", None) for "bias1H"."""
    match = re.fullmatch(r"(none|causal|padding|window|chunk|packed|bias)(\d+|1H|B1|BH)?", mask)
    if match is None:
        raise ValueError(f"unknown sweep mask {mask!r}")
    kind, size = match.groups()
    return kind, int(size) if size and size.isdigit() else None


def mask_family(mask: str) -> str:
    kind, _ = mask_kind(mask)
    return {"none": "plain", "causal": "plain", "bias": "bias"}.get(kind, "described")


# ---- the cases ---------------------------------------------------------------------------


def sweep_cases(quick: bool = False, tokens: int = 16384) -> list[SweepCase]:
    """Every case of the sweep (``quick``: a few values of each axis), in an order that visits
    each axis early: the first case of every axis, then the second of every axis, and so on,
    so a run cut short by ``--time-limit`` has still covered every axis."""

    def pick(full, short):
        return short if quick else full

    def case(seq=BASE_SEQ, head_dim=BASE_HEAD_DIM, kv_heads=BASE_HEADS, mask="causal"):
        return (seq, max(1, tokens // seq), BASE_HEADS, kv_heads, head_dim, mask)

    every_mask = (
        "none",
        "causal",
        "padding",
        "window256",
        "window1024",
        "chunk1024",
        "packed8",
        "bias1H",
        "biasB1",
    )
    axes = {
        "seq": [
            case(seq=s, mask=m)
            for s, m in pick(
                tuple((s, m) for s in SEQS for m in ("none", "causal", "padding")),
                ((512, "causal"), (32768, "causal"), (32768, "padding")),
            )
        ],
        "head_dim": [
            case(head_dim=d, mask=m)
            for d in (64, 96, 128, 256)
            for m in pick(("none", "causal", "padding", "bias1H"), ("causal",))
        ],
        "gqa": [
            case(kv_heads=BASE_HEADS // ratio, mask=m)
            for ratio in pick((1, 4, 8), (8,))
            for m in pick(("causal", "padding", "window1024", "packed8"), ("causal", "padding"))
        ],
        "mask": [case(mask=m) for m in pick(every_mask, ("none", "causal", "padding"))],
        "window": [
            case(seq=s, mask=f"window{w}")
            for s, w in pick(
                ((2048, 256), (2048, 1024), (8192, 256), (8192, 1024), (8192, 4096))
                + ((32768, 256), (32768, 1024), (32768, 4096)),
                ((4096, 256), (32768, 4096)),
            )
        ],
        "chunk": [
            case(seq=s, mask=f"chunk{c}")
            for s, c in pick(
                ((4096, 512), (4096, 2048), (32768, 512), (32768, 2048), (32768, 8192)),
                ((32768, 8192),),
            )
        ],
        "packed": [
            case(seq=s, mask=f"packed{n}")
            for s, n in pick(
                tuple((4096, n) for n in (2, 4, 8, 16, 32, 64)) + tuple((32768, n) for n in (2, 8, 64)),
                ((4096, 64),),
            )
        ],
        "bias": [
            case(seq=s, mask=m) for s in pick((1024, 2048, 4096, 8192), (4096,)) for m in ("bias1H", "biasB1")
        ]
        + pick([case(mask="biasBH")], []),
    }
    assert tuple(axes) == AXES
    order: dict[tuple, list[str]] = {}
    for rank in range(max(len(cases) for cases in axes.values())):
        for axis, cases in axes.items():
            if rank < len(cases):
                order.setdefault(cases[rank], [])
                if axis not in order[cases[rank]]:
                    order[cases[rank]].append(axis)
    # A case met again on a later axis belongs to that axis too (its first place decides the order).
    for axis, cases in axes.items():
        for key in cases:
            if axis not in order[key]:
                order[key].append(axis)
    return [SweepCase(*key, axes=tuple(a for a in AXES if a in names)) for key, names in order.items()]


def unbuilt_reason(head_dim: int) -> str | None:
    """Why this build's fastest kernels for the GPU in use lack ``head_dim`` (None: they have it).
    A head dim left out of ``SAFEATTN_ATTN_HEAD_DIMS`` runs on a fallback 20-50x slower, which
    would be timed as if it were the kernel: the sweep skips such cases instead."""
    info = safeattn.build_info()
    hopper = torch.cuda.get_device_capability() == (9, 0) and info.get("hopper_kernels")
    prefix = "attention_sm90_" if hopper else "attention_"
    built = set(info.get(f"{prefix}fwd_head_dims", [])) & set(info.get(f"{prefix}bwd_head_dims", []))
    if head_dim in built:
        return None
    kernels = "sm_90a" if hopper else "generic CUDA"
    return (
        f"head dim {head_dim} is not in this build's {kernels} kernels ({', '.join(map(str, sorted(built))) or 'none'}): "
        "rebuild with it in SAFEATTN_ATTN_HEAD_DIMS"
    )


def select(cases: list[SweepCase], axes: list[str] | None, filters: list[str] | None) -> list[SweepCase]:
    """The cases on any of ``axes`` whose name holds any of ``filters`` (None: no condition)."""
    if axes:
        cases = [c for c in cases if set(c.axes) & set(axes)]
    if filters:
        cases = [c for c in cases if any(f in c.name for f in filters)]
    return cases


def print_dry_run(cases: list[SweepCase]) -> None:
    rows = []
    flex_cases = 0
    timings = 0
    for number, c in enumerate(cases, 1):
        impls = [name for name in c.impl_names() if name]
        timings += len(impls) * len(PASSES)
        flex_cases += "Flex" in impls
        rows.append([number, c.name, ", ".join(c.axes), ", ".join(impls)])
    print(markdown_table(["#", "case", "axes", "timed (fwd and fwd+bwd)"], rows))
    print(
        f"\n{len(cases)} cases, {len(cases) * len(PASSES)} rows (fwd, fwd+bwd), {timings} timings, "
        f"{flex_cases * len(PASSES)} Flex compiles; axes: "
        + ", ".join(f"{axis} {sum(axis in c.axes for c in cases)}" for axis in AXES)
    )


# ---- building one case -------------------------------------------------------------------


@dataclasses.dataclass
class Impl:
    """One implementation of a case: fn(q, k, v) -> out, and the tensors besides q, k, v whose
    gradient its backward computes (a learnable bias)."""

    fn: Callable
    leaves: tuple[torch.Tensor, ...] = ()


def left_padding(batch: int, seq: int, device) -> torch.Tensor:
    """[B, S] bool key mask, True = a real token: row b has (b % 4 + 1) * S / 16 padding keys on
    its left, so B = 1 is padded too."""
    pad = torch.ones(batch, seq, dtype=torch.bool, device=device)
    for b in range(batch):
        pad[b, : (b % 4 + 1) * seq // 16] = False
    return pad


def packed_ids(batch: int, seq: int, documents: int, device, seed: int = 0) -> torch.Tensor:
    """[B, S] int64 document ids 0 .. documents-1, each a run of random length (at least one)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        starts = torch.randperm(seq - 1, generator=g)[: documents - 1] + 1
        ids[b, starts] = 1
    return ids.cumsum(-1).to(device)


def describe(case: SweepCase, device) -> safeattn.MaskDescription:
    kind, size = mask_kind(case.mask)
    if kind == "padding":
        return safeattn.MaskDescription(padding_mask=left_padding(case.batch, case.seq, device))
    if kind == "window":
        return safeattn.MaskDescription(sliding_window=size)
    if kind == "chunk":
        return safeattn.MaskDescription(chunk_size=size)
    if kind == "packed":
        ids = packed_ids(case.batch, case.seq, size, device)
        return safeattn.MaskDescription(packed_ids=ids, packed_ids_are_runs=True)
    raise ValueError(f"{case.mask} is not a described mask")


def flex_mask_mod(description: safeattn.MaskDescription):
    """The description's rule as a FlexAttention mask_mod (causal, a window, chunks without left
    padding, key padding, packed ids: what the sweep describes)."""
    window, chunk = description.sliding_window, description.chunk_size
    pad, ids = description.padding_mask, description.packed_ids

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if chunk is not None:
            keep = keep & (q_idx // chunk == kv_idx // chunk)
        if pad is not None:
            keep = keep & pad[b, kv_idx]
        if ids is not None:
            keep = keep & (ids[b, q_idx] == ids[b, kv_idx])
        return keep

    return mask_mod


def build(case: SweepCase, device, dtype) -> tuple[dict[str, Impl | str], int]:
    """{implementation: Impl, or why it cannot run}, and the visible (query, key) pairs over the
    batch (for TFLOP/s)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = {"enable_gqa": True} if case.heads != case.kv_heads else {}
    seq, batch = case.seq, case.batch
    causal_pairs = batch * seq * (seq + 1) // 2
    impls: dict[str, Impl | str] = {}

    def flex_or_reason(mask_mod, mask_batch, score_mod=None, leaves=()):
        try:
            from torch.nn.attention.flex_attention import create_block_mask

            blocks = create_block_mask(mask_mod, mask_batch, None, seq, seq, device=device)
            flex = compiled_flex()
        except Exception as err:  # noqa: BLE001 - no FlexAttention here, or no block mask
            return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        return Impl(lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=blocks, **gqa), leaves)

    kind, _ = mask_kind(case.mask)
    if case.family == "plain":
        causal = kind == "causal"
        impls[OURS] = Impl(lambda q, k, v: safeattn.attention(q, k, v, is_causal=causal, **gqa)[0])
        for name, backend in (
            ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
            ("SDPA flash", SDPBackend.FLASH_ATTENTION),
        ):

            def sdpa(q, k, v, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

            impls[name] = Impl(sdpa)
        return impls, causal_pairs if causal else batch * seq * seq

    if case.family == "described":
        description = describe(case, device)
        per_row = description.padding_mask is not None or description.packed_ids is not None
        dense = description.materialise(batch if per_row else 1, seq, seq, device=device)  # [B|1, 1, S, S]
        pairs = int(dense.sum()) * (1 if per_row else batch)
        impls[OURS] = Impl(lambda q, k, v: safeattn.attention(q, k, v, attn_mask=description, **gqa)[0])
        impls[DENSE] = Impl(lambda q, k, v: safeattn.attention(q, k, v, attn_mask=dense, **gqa)[0])
        impls["Flex"] = flex_or_reason(flex_mask_mod(description), batch if per_row else None)
        return impls, pairs

    # A learnable bias under causality; bf16 as the model's weights would be.
    shape = {"bias1H": (1, case.heads, seq, seq), "biasB1": (batch, 1, seq, seq)}.get(
        case.mask, (batch, case.heads, seq, seq)
    )
    bias = (torch.randn(shape, device=device) * 0.5).to(dtype).requires_grad_()
    impls[OURS] = Impl(
        lambda q, k, v: safeattn.attention(q, k, v, attn_mask=bias, is_causal=True, **gqa)[0], (bias,)
    )
    if case.mask == "bias1H":

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + bias[0, h, q_idx, kv_idx]

    elif case.mask == "biasBH":

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, q_idx, kv_idx]

    else:

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + bias[b, 0, q_idx, kv_idx]

    impls["Flex"] = flex_or_reason(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, add_bias, (bias,))
    # SDPA takes no is_causal with a mask: causality drawn into a leaf of its own.
    above_diagonal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    causal_bias = bias.detach().masked_fill(above_diagonal, float("-inf")).requires_grad_()
    del above_diagonal

    def efficient(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias, **gqa)

    impls["SDPA efficient"] = Impl(efficient, (causal_bias,))
    return impls, causal_pairs


def time_case(case: SweepCase, backward: bool, impls: dict, repeats: int, warmup: int, dtype, device="cuda"):
    """{implementation: ms}, {implementation: why it did not run}."""

    def make():
        q = torch.randn(case.batch, case.heads, case.seq, case.head_dim, device=device, dtype=dtype)
        k, v = (
            torch.randn(case.batch, case.kv_heads, case.seq, case.head_dim, device=device, dtype=dtype)
            for _ in range(2)
        )
        if not backward:
            return q, k, v
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), torch.randn_like(q)

    ms, not_run = {}, {}
    for name, impl in impls.items():
        if isinstance(impl, str):
            not_run[name] = impl
            continue

        def run(q, k, v, grad=None, impl=impl):
            out = impl.fn(q, k, v)
            if grad is not None:
                # autograd.grad, not .backward(): nothing accumulates into .grad between calls.
                torch.autograd.grad(out, (q, k, v, *impl.leaves), grad)

        with torch.set_grad_enabled(backward):
            value, why = attempt_ms(run, make, repeats, warmup)
        if value is None:
            not_run[name] = why
        else:
            ms[name] = value
    return ms, not_run


# ---- the table and the summary -----------------------------------------------------------


def best_peer(record: dict) -> tuple[str, float] | None:
    peers = [(ms, name) for name, ms in record["ms"].items() if name not in (OURS, DENSE)]
    return None if not peers else min(peers)[::-1]


def _ratio(record: dict, other: str | None) -> float | None:
    ours = record["ms"].get(OURS)
    if other is None:
        best = best_peer(record)
        theirs = None if best is None else best[1]
    else:
        theirs = record["ms"].get(other)
    return None if ours is None or theirs is None else theirs / ours


# (name, threshold, which records, the ratio's other implementation: None = the best peer)
TARGETS = (
    ("every case >= 1.0x the best peer", 1.0, lambda r: True, None),
    (
        "described masks >= 1.2x Flex, fwd",
        1.2,
        lambda r: r["family"] == "described" and r["pass"] == "fwd",
        "Flex",
    ),
    (
        "described masks >= 1.1x Flex, fwd+bwd",
        1.1,
        lambda r: r["family"] == "described" and r["pass"] == "fwd+bwd",
        "Flex",
    ),
    ("described never slower than dense", 1.0, lambda r: r["family"] == "described", DENSE),
    (
        "learnable bias fwd+bwd >= 1.2x Flex",
        1.2,
        lambda r: r["family"] == "bias" and r["pass"] == "fwd+bwd",
        "Flex",
    ),
)

TABLE_HEADER = [
    "case",
    "pass",
    "safeattn ms",
    "TFLOP/s",
    "best peer",
    "peer ms",
    "ratio",
    "dense ms",
    "dense / safeattn",
    "not run",
]


def table_row(record: dict) -> list[str]:
    ms = record["ms"]
    ours = ms.get(OURS)
    flops = (
        4
        * record["pairs"]
        * record["heads"]
        * record["head_dim"]
        * (3.5 if record["pass"] == "fwd+bwd" else 1)
    )
    best = best_peer(record)
    ratio = _ratio(record, None)
    dense_ratio = _ratio(record, DENSE)
    not_run = "; ".join(f"{name}: {why}" for name, why in record["not_run"].items())
    return [
        record["case"],
        record["pass"],
        "n/a" if ours is None else f"{ours:.3f}",
        "n/a" if ours is None else f"{flops / ours / 1e9:.0f}",
        "none" if best is None else best[0],
        "n/a" if best is None else f"{best[1]:.3f}",
        "n/a" if ratio is None else f"{ratio:.2f}x",
        f"{ms[DENSE]:.3f}" if DENSE in ms else "",
        "" if dense_ratio is None else f"{dense_ratio:.2f}x",
        not_run.replace("|", "/"),
    ]


def summary(records: list[dict]) -> list[str]:
    """The smallest ratio against the best peer and, per target, its worst case."""
    lines = []
    ratios = [(r, _ratio(r, None)) for r in records]
    ratios = [(value, r) for r, value in ratios if value is not None]
    if ratios:
        value, r = min(ratios, key=lambda pair: pair[0])
        lines.append(f"smallest ratio: {value:.2f}x, {r['case']} {r['pass']}, against {best_peer(r)[0]}")
    for name, threshold, which, other in TARGETS:
        values = [(_ratio(r, other), r) for r in records if which(r)]
        values = [(v, r) for v, r in values if v is not None]
        if not values:
            lines.append(f"- {name}: no case measured")
            continue
        worst, r = min(values, key=lambda pair: pair[0])
        below = sum(v < threshold for v, _ in values)
        verdict = "met" if below == 0 else f"MISSED in {below} of {len(values)}"
        lines.append(f"- {name}: worst {worst:.2f}x, {r['case']} {r['pass']} ({verdict})")
    failed = [f"{r['case']} {r['pass']}" for r in records if OURS not in r["ms"]]
    if failed:
        lines.append(f"- safeattn did not run: {', '.join(failed)}")
    return lines


def shortfalls(records: list[dict]) -> list[list[str]]:
    """Every (row, target) below the target, the furthest below first: case, pass, target, ratio."""
    short = []
    for r in records:
        for name, threshold, which, other in TARGETS:
            value = _ratio(r, other) if which(r) else None
            if value is not None and value < threshold:
                short.append((value, [r["case"], r["pass"], name, f"{value:.2f}x"]))
    return [row for _, row in sorted(short, key=lambda pair: pair[0])]


def print_report(records: list[dict], meta: dict | None = None) -> None:
    if meta:
        print(
            f"# attention sweep: {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
            f"{meta.get('dtype', 'bfloat16')}, B*S = {meta.get('tokens', '?')} tokens"
        )
    print()
    print(markdown_table(TABLE_HEADER, [table_row(r) for r in records]))
    print()
    print_verdict(records)


def print_verdict(records: list[dict]) -> None:
    """The summary, then the rows short of a target: the end of a run and of --report."""
    print("\n".join(summary(records)))
    short = shortfalls(records)
    if short:
        print(f"\nshort of a target ({len(short)}):\n")
        print(markdown_table(["case", "pass", "target", "ratio"], short))


# ---- the command -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the sweep over length, head dim, GQA and mask (docs/cli.md)")
    group.add_argument("--sweep", action="store_true", help="the sweep over length, head dim, GQA and mask")
    group.add_argument(
        "--sweep-axis", action="extend", nargs="+", choices=AXES, help="only the cases on these axes"
    )
    group.add_argument(
        "--sweep-filter",
        action="extend",
        nargs="+",
        metavar="SUBSTR",
        help="only the cases whose name (e.g. 'S=4096 B=4 H=16:16 D=128 window256') holds one of these",
    )
    group.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new case pass after SECONDS (a pass under way, with its compile, finishes)",
    )
    group.add_argument(
        "--json", metavar="PATH", help="write the raw numbers to PATH (rewritten after every case)"
    )
    group.add_argument(
        "--resume", action="store_true", help="keep the records of --json PATH and skip their cases"
    )
    group.add_argument("--dry-run", action="store_true", help="list the cases and what each is timed against")
    group.add_argument(
        "--report", nargs="+", metavar="JSON", help="print the table and summary of saved runs"
    )
    group.add_argument(
        "--tokens", type=int, default=16384, help="B*S of every case (B = tokens // S, at least 1)"
    )


def _load(paths: list[str]) -> tuple[list[dict], dict]:
    """The records of saved runs, a later record of a (case, pass) replacing an earlier one."""
    merged, meta = {}, {}
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        meta = saved.get("meta", meta)
        for record in saved["records"]:
            merged[(record["case"], record["pass"])] = record
    return list(merged.values()), meta


def _write(path: str, meta: dict, records: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    os.replace(tmp, path)  # a run killed mid-write leaves the previous file whole


def run(args: argparse.Namespace) -> int:
    if args.report:
        records, meta = _load(args.report)
        print_report(records, meta)
        return 0
    cases = select(sweep_cases(args.quick, args.tokens), args.sweep_axis, args.sweep_filter)
    if args.dry_run:
        print_dry_run(cases)
        return 0
    if args.device != "cuda" or not torch.cuda.is_available():
        print(
            "bench attention --sweep: runs on a GPU (--device cuda); --dry-run lists it anywhere",
            file=sys.stderr,
        )
        return 2
    dtype = torch.bfloat16
    repeats, warmup = (10, 3) if args.quick else (args.repeats_cuda, 5)
    records: list[dict] = []
    if args.resume and args.json and os.path.exists(args.json):
        records, _ = _load([args.json])
    done = {(r["case"], r["pass"]) for r in records}
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "safeattn": safeattn.__version__,
        "dtype": "bfloat16",
        "tokens": args.tokens,
        "repeats": repeats,
        "warmup": warmup,
        "cases_selected": len(cases),
    }
    print(
        f"# attention sweep: {meta['device']}, torch {meta['torch']}, bf16, B*S = {args.tokens} tokens, "
        f"median of {repeats} calls after {warmup} warm-up; ratio = best peer ms / safeattn ms "
        "(> 1: safeattn faster); TFLOP/s count the visible pairs (x3.5 fwd+bwd)"
    )
    print()
    print(markdown_table(TABLE_HEADER, []))
    for r in records:
        print(markdown_table(TABLE_HEADER, [table_row(r)]).splitlines()[-1])
    start = time.monotonic()
    stopped = None
    unbuilt: dict[int, str | None] = {}  # head dim: why the build cannot time it
    skipped: dict[int, int] = {}  # head dim: its cases left out (no record: a fuller build resumes them)
    for number, case in enumerate(cases, 1):
        todo = [p for p in PASSES if (case.name, p) not in done]
        if not todo:
            continue
        if case.head_dim not in unbuilt:
            unbuilt[case.head_dim] = unbuilt_reason(case.head_dim)
        if unbuilt[case.head_dim]:
            skipped[case.head_dim] = skipped.get(case.head_dim, 0) + 1
            continue
        if args.time_limit is not None and time.monotonic() - start > args.time_limit:
            stopped = f"time limit: stopped after {time.monotonic() - start:.0f} s, before case {number} of {len(cases)}"
            break
        try:
            impls, pairs = build(case, "cuda", dtype)
        except Exception as err:  # noqa: BLE001 - one case that cannot be set up (memory) stops no sweep
            why = (
                "out of memory" if isinstance(err, torch.cuda.OutOfMemoryError) else str(err).splitlines()[0]
            )
            impls = {name: f"building the case: {why[:120]}" for name in case.impl_names() if name}
            pairs = 0
            torch.cuda.empty_cache()
        for mode in todo:
            if args.time_limit is not None and time.monotonic() - start > args.time_limit:
                stopped = f"time limit: stopped after {time.monotonic() - start:.0f} s, in case {number} of {len(cases)}"
                break
            began = time.monotonic()
            ms, not_run = time_case(case, mode == "fwd+bwd", impls, repeats, warmup, dtype)
            record = {
                "case": case.name,
                "pass": mode,
                "axes": list(case.axes),
                **{f.name: getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "axes"},
                "family": case.family,
                "pairs": pairs,
                "ms": ms,
                "not_run": not_run,
                "seconds": round(time.monotonic() - began, 1),  # compiles included: for planning runs
            }
            records.append(record)
            print(markdown_table(TABLE_HEADER, [table_row(record)]).splitlines()[-1], flush=True)
            if args.json:
                _write(args.json, meta, records)
        del impls
        if "Flex" in case.impl_names():
            # Every case compiles Flex anew (a new shape or mask); dropping Dynamo's cache frees
            # what it holds of the last one (captured biases, block masks). Inductor's on-disk
            # cache stays: a second run of the sweep compiles faster.
            torch._dynamo.reset()
        torch.cuda.empty_cache()
        if stopped:
            break
    print()
    if stopped:
        print(stopped)
    print(f"{len(records)} rows of {2 * len(cases)} selected, {time.monotonic() - start:.0f} s")
    for head_dim, count in sorted(skipped.items()):
        print(f"skipped {count} cases of D={head_dim}: {unbuilt[head_dim]}")
    print_verdict(records)
    if args.json:
        _write(args.json, {**meta, "stopped": stopped}, records)
    return 0
