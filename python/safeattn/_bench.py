"""What the benchmark suite (``python -m safeattn bench``) and the demo share: timing, the
workloads more than one of them runs, and markdown tables.

The suite: ``_cli_bench.py`` (the command line, and the sweep over sequence lengths with plots)
and one module per op, ``_bench_<op>.py``, holding both that op's sweep case and its fixed-shape
tables (the README's, printed in the README's form with ``--markdown``).
"""

from __future__ import annotations

import copy
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


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


# ---- timing ------------------------------------------------------------------------------


def time_ms(
    fn: Callable[[], object],
    device: str | torch.device,
    repeats: int = 20,
    warmup: int = 3,
    gpu_only: bool = False,
) -> float:
    """Median wall time of fn() in milliseconds: CUDA events on the GPU, perf_counter on the CPU.

    On the GPU the events bracket the call, so a call whose kernels finish before the host has
    queued them all counts its host time too (what a caller waits for). ``gpu_only`` keeps the
    GPU busy (a spin kernel of about 0.5 ms) while fn() is queued, so that only the GPU's time
    for its kernels is counted: their bandwidth.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if gpu_only:
                torch.cuda._sleep(1_000_000)  # clock cycles
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- the sweep's unit of work ------------------------------------------------------------


@dataclass
class Settings:
    """What every sweep case is built for."""

    device: torch.device
    dtype: torch.dtype
    quick: bool


@dataclass
class Case:
    """One (op, sequence length, pass) point of the sweep: the callables to time, safeattn's first."""

    op: str
    seq: int
    mode: str  # "fwd", "fwd+bwd", a mask kind, ...
    impls: dict[str, Callable[[], object]]
    work: float  # units of work per call, in the op's throughput unit (bytes, FLOPs, tokens)
    ms: dict[str, float] = field(default_factory=dict)

    def throughput(self, impl: str) -> float:
        return self.work / (self.ms[impl] * 1e-3)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- tables ------------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table, as the README holds them (an empty cell is written "| |")."""

    def line(cells) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in rows)])


# ---- workloads ---------------------------------------------------------------------------


def mask_workload(
    kind: str, batch_size: int, length: int, device: str, pad_fraction: float = 0.1, seed: int = 0
):
    """A prefill mask case: (safeattn.sdpa_mask kwargs, Transformers sdpa_mask kwargs).

    kind: "causal", "sliding" (window 1024 or length/4), "chunked" (chunk 512 or length/8, with
    per-batch left padding) or "packed" (4 sequences per row). Every case has left padding on
    half the batch rows.
    """
    import transformers.masking_utils as mu

    g = torch.Generator().manual_seed(seed)
    pad = torch.ones(batch_size, length, dtype=torch.bool)
    for b in range(0, batch_size, 2):
        left = int(length * pad_fraction * torch.rand((), generator=g).item())
        pad[b, :left] = False
    pad = pad.to(device)
    ours: dict = {"batch_size": batch_size, "q_length": length, "kv_length": length, "padding_mask": pad}
    fn = mu.causal_mask_function
    if kind == "sliding":
        window = min(1024, max(1, length // 4))
        ours["sliding_window"] = window
        fn = mu.sliding_window_causal_mask_function(window)
    elif kind == "chunked":
        chunk = min(512, max(1, length // 8))
        left_padding = (pad.cumsum(-1) == 0).sum(-1)
        ours.update(chunk_size=chunk, chunk_left_padding=left_padding)
        fn = mu.chunked_causal_mask_function(chunk, left_padding)
    elif kind == "packed":
        ids = (torch.arange(length, device=device) * 4 // length).expand(batch_size, length).contiguous()
        ours["packed_ids"] = ids
        fn = mu.and_masks(fn, mu.packed_sequence_mask_function(ids))
    elif kind != "causal":
        raise ValueError(f"unknown mask kind {kind!r}")
    theirs = dict(
        batch_size=batch_size,
        q_length=length,
        kv_length=length,
        mask_function=fn,
        attention_mask=pad,
        allow_is_causal_skip=False,
        device=device,
    )
    return ours, theirs


def tiny_llama_config(quick: bool):
    """The demo's and the sweep's Llama-family model: random weights, nothing downloaded."""
    import transformers

    # Grouped-query attention (4 query heads over 2 key/value heads), as current Llamas have.
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128 if quick else 256,
        intermediate_size=256 if quick else 512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32 if quick else 64,
        max_position_embeddings=4096,
        pad_token_id=0,
    )


def tiny_llama(config, impl: str, device, dtype):
    """A model of `config` with `attn_implementation=impl`; the same random weights for every
    implementation (the seed is reset before each build)."""
    import transformers

    import safeattn.transformers  # noqa: F401  registers attn_implementation="safeattn"

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    return model.to(device=device, dtype=dtype).eval()


def left_padded_batch(batch_size: int, length: int, vocab: int, device, seed: int = 0):
    """input_ids, attention_mask: [B, S]; row b has b * S / (2B) padding tokens on the left."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch_size, length), generator=g)
    attention_mask = torch.ones(batch_size, length, dtype=torch.long)
    for row in range(batch_size):
        pads = row * length // (2 * batch_size)
        attention_mask[row, :pads] = 0
        input_ids[row, :pads] = 0
    return input_ids.to(device), attention_mask.to(device)
