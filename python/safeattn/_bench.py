"""Timing and workload helpers shared by the benchmarks (benchmarks/) and the demo."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_ms(
    fn: Callable[[], object], device: str | torch.device, repeats: int = 20, warmup: int = 3, gpu_only: bool = False
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


def mask_workload(kind: str, batch_size: int, length: int, device: str, pad_fraction: float = 0.1, seed: int = 0):
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
