"""Private switches for safeattn's own tests and benchmarks; not part of the API.

``generic_kernels()`` makes attention on an H100/H200 run the generic CUDA kernels (mma.sync, the
ones A100, Ada and Blackwell GPUs run) instead of the sm_90a kernels, so that the GPUs at hand can
test and measure them. It is process-wide and not thread-safe by design: tests and benchmarks
switch it around whole runs (``pytest --generic-kernels``, ``bench attention --generic-kernels``).

``generic_tile_shapes(...)`` gives the generic kernels' tile shapes for a GPU's shared-memory
limits, so that the choice for GPUs not at hand (A100, Ada, Blackwell) is tested anywhere;
``decode_wave_ctas(...)`` the decode kernel's choice of shape the same way.

``attention_path(...)`` says which kernel ``safeattn.attention`` (or its backward) would run for
its arguments, and why not the kernels asked before it, without running any: so a test can assert
the kernel a call takes, and a fallback to a slower one fails it.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from . import _C
from .ops import MaskDescription, _op_mask_arguments


def set_generic_kernels_only(on: bool) -> None:
    if not hasattr(_C, "_set_generic_kernels_only"):
        raise RuntimeError("this build of safeattn has no CUDA kernels")
    _C._set_generic_kernels_only(bool(on))


class GenericTiles(NamedTuple):
    """The generic kernels' tile shapes for one head dim on one GPU (zeros for a direction the
    build lacks that head dim in): the forward's (large shape or not, query and key tile, shared
    memory bytes) and the dK/dV kernel's (the same; bytes: the backward's whole need)."""

    fwd_large: bool
    fwd_block_q: int
    fwd_block_kv: int
    fwd_smem: int
    bwd_large: bool
    bwd_block_q: int
    bwd_block_kv: int
    bwd_smem: int


def generic_tile_shapes(
    head_dim: int, smem_per_block: int, smem_per_sm: int, reserved_per_block: int
) -> GenericTiles:
    """The tile shapes attention's generic CUDA kernels take for ``head_dim`` on a GPU with these
    shared-memory limits (bytes: a block's opt-in, an SM's, what each block reserves), as the
    forward and backward choose them at run time: so the choice for GPUs not at hand is tested."""
    if not hasattr(_C, "_generic_tile_shapes"):
        raise RuntimeError("this build of safeattn has no CUDA kernels")
    v = _C._generic_tile_shapes(head_dim, smem_per_block, smem_per_sm, reserved_per_block)
    return GenericTiles(bool(v[0]), v[1], v[2], v[3], bool(v[4]), v[5], v[6], v[7])


def decode_wave_ctas(
    head_dim: int,
    kv_end: int,
    batch: int,
    kv_heads: int,
    sms: int,
    smem_per_block: int,
    row_pages: bool = False,
) -> int:
    """The CTAs an SM of the decode kernel's wave shape (DecodeWaveShape: many tiles in flight) that
    a decode step takes on a GPU with ``sms`` SMs and ``smem_per_block`` bytes of shared memory a
    block may opt into, over a contiguous cache or one of pages holding whole key tiles (64 tokens
    or more, a power of two), or with ``row_pages`` over shorter pages; 0 where it takes the
    default shape."""
    if not hasattr(_C, "_decode_wave_ctas"):
        raise RuntimeError("this build of safeattn has no CUDA kernels")
    return int(_C._decode_wave_ctas(head_dim, kv_end, batch, kv_heads, sms, smem_per_block, row_pages))


@contextlib.contextmanager
def generic_kernels():
    set_generic_kernels_only(True)
    try:
        yield
    finally:
        set_generic_kernels_only(False)


class AttentionPath(NamedTuple):
    """The kernel a call takes: ``"cpu"``, ``"decode"``, ``"sm90a"``, ``"mma_sync"`` (the generic
    CUDA tensor-core kernels), ``"chunked_aten"`` (ATen ops over chunks of queries) or ``"none"``
    (an empty output: nothing runs)."""

    kernel: str
    # (kernel, why it cannot take the call) for each kernel asked before, in the chooser's order.
    rejected: list[tuple[str, str]]
    # The key ranges (key_ranges, or a described window or chunks) are drawn into a mask first:
    # the generic CUDA kernels (mma_sync) and chunked_aten read them that way; cpu, sm90a and
    # decode read the ranges themselves.
    key_ranges_drawn: bool


def attention_path(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | MaskDescription | None = None,
    dropout_p: float = 0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    q_offset: int = 0,
    kv_offset: int = 0,
    softcap: float = 0,
    sinks: torch.Tensor | None = None,
    key_ranges: torch.Tensor | None = None,
    backward: bool = False,
) -> AttentionPath:
    """Which kernel ``safeattn.attention`` with these arguments runs (``backward=True``: which one
    its backward runs, the mask's gradient included when ``attn_mask`` requires grad), from the
    choosers the op itself follows (csrc/ops/attention_choice.h). Nothing is computed: the op's
    checks run and its outputs are allocated, then its kernel records the choice instead. The
    ``torch.func`` / forward-AD composite (``_attention_math``) is not covered: only the fused op."""
    attn_mask, is_causal, key_ranges = _op_mask_arguments(
        attn_mask, is_causal, key_ranges, query, key, q_offset, kv_offset
    )
    kernel, rejected, drawn = _C._attention_path(
        query,
        key,
        value,
        attn_mask,
        float(dropout_p),
        bool(is_causal),
        scale,
        bool(enable_gqa),
        int(q_offset),
        int(kv_offset),
        float(softcap),
        sinks,
        key_ranges,
        bool(backward),
    )
    return AttentionPath(kernel, [tuple(r) for r in rejected], drawn)
