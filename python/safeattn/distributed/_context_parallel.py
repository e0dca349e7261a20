"""Context parallelism: attention over a sequence split across the ranks of a process group.

Each rank holds the queries, keys and values of its part of the sequence. The key/value blocks
travel around a ring (rank r sends to r + 1 and receives from r - 1), so after ``world`` steps
every rank has seen every block while holding at most two at a time; the transfer of the next
block overlaps the attention over the current one. Each (query part, key part) pair is one call
of ``safeattn.attention`` with the two parts' global positions as ``q_offset`` / ``kv_offset``,
so causal and sliding-window masks come from positions and no global mask exists anywhere; a
key-padding mask travels with its keys as a ``[B, S_local]`` slice.

Partial results merge through the log-sum-exp the op returns::

    lse = logaddexp(lse_a, lse_b)        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

(a row no block sees keeps out 0 and lse -inf: the weights are taken as 0 there, never NaN).

The backward runs the same ring: each block's gradients come from safeattn's own backward op
fed with the merged (global) ``out`` and ``lse``, which makes the per-block probabilities the
global ones; dQ accumulates where the queries live, and dK/dV accumulate on their way around the
ring behind the K/V blocks, arriving home after the last step.

Layouts (``S`` global length, ``n`` ranks): ``"contiguous"`` gives rank r the positions
``[r S/n, (r+1) S/n)``; ``"zigzag"`` cuts the sequence into ``2n`` chunks and gives rank r
chunks ``r`` and ``2n-1-r`` (torch's head-tail load balancing), so under a causal mask every
rank has the same amount of work instead of rank n-1 doing n times what rank 0 does::

    S = 8, n = 2      contiguous: rank 0 = 0 1 2 3, rank 1 = 4 5 6 7
                      zigzag:     rank 0 = 0 1 6 7, rank 1 = 2 3 4 5
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence"]

_LAYOUTS = ("contiguous", "zigzag")
_NEG_INF = float("-inf")

# P2P tags: the K/V ring and the dK/dV ring are in flight together in the backward (gloo matches
# messages by tag; NCCL ignores tags and matches by issue order, the same on every rank).
_KV_TAG, _GRAD_TAG = 0, 8


def _group_of(group) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh must be 1-D (the context-parallel dim), got {group.ndim}-D"
            )
        return group.get_group()
    return group if group is not None else dist.group.WORLD


@dataclass(frozen=True)
class _Segment:
    """A run of consecutive positions held by one rank."""

    position: int  # global position of its first token
    begin: int  # index of its first token in the rank's local tensor
    length: int

    @property
    def last(self) -> int:
        return self.position + self.length - 1

    @property
    def rows(self) -> slice:
        return slice(self.begin, self.begin + self.length)


def _segments(layout: str, rank: int, world: int, local_length: int) -> tuple[_Segment, ...]:
    if layout == "contiguous":
        return (_Segment(rank * local_length, 0, local_length),)
    half = local_length // 2
    return (_Segment(rank * half, 0, half), _Segment((2 * world - 1 - rank) * half, half, half))


def _check_layout(op: str, layout: str, local_length: int) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {_LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and local_length % 2:
        raise ValueError(
            f"{op}: with layout 'zigzag' a rank's part must have an even length, got {local_length}"
        )


def shard_sequence(tensor: torch.Tensor, dim: int, *, group=None, layout: str = "contiguous") -> torch.Tensor:
    """This rank's part of a full sequence ``tensor``, cut along ``dim`` in ``layout`` (see
    :func:`context_parallel_attention`): a view for ``"contiguous"``, a copy for ``"zigzag"``.
    No communication: every rank holds ``tensor``."""
    _check_layout("shard_sequence", layout, 0)
    pg = _group_of(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    parts = world * (2 if layout == "zigzag" else 1)
    if tensor.shape[dim] % parts:
        raise ValueError(
            f"shard_sequence: the length {tensor.shape[dim]} of dim {dim} must be a multiple of {parts} "
            f"({world} ranks, layout {layout!r})"
        )
    if layout == "contiguous":
        return tensor.chunk(world, dim)[rank]
    chunks = tensor.chunk(2 * world, dim)
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), dim)


def unshard_sequence(
    tensor: torch.Tensor, dim: int, *, group=None, layout: str = "contiguous"
) -> torch.Tensor:
    """The full sequence from every rank's part (``all_gather``), in position order: the inverse
    of :func:`shard_sequence`. Not differentiable."""
    pg = _group_of(group)
    world = dist.get_world_size(pg)
    _check_layout("unshard_sequence", layout, tensor.shape[dim])
    parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=pg)
    if layout == "contiguous":
        return torch.cat(parts, dim)
    halves = [part.chunk(2, dim) for part in parts]
    ordered = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(ordered, dim)


# ---- the pieces of one (query segment, key segment) block ---------------------------------------


@dataclass(frozen=True)
class _Config:
    group: dist.ProcessGroup
    rank: int
    world: int
    layout: str
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    sliding_window: int | None
    softcap: float


@dataclass(frozen=True)
class _Block:
    """What a (query segment, key segment) pair needs: the op's causal rule (only when the
    diagonal crosses the block) and a window mask (only when the window cuts it)."""

    q: _Segment
    kv: _Segment
    causal: bool
    window_mask: bool


def _block(q: _Segment, kv: _Segment, cfg: _Config) -> _Block | None:
    """None when no query of `q` sees a key of `kv` (the block is skipped)."""
    window = cfg.sliding_window
    if cfg.is_causal:
        if kv.position > q.last:  # every key after every query
            return None
        causal = kv.last > q.position
        if window is None:
            return _Block(q, kv, causal, False)
        # sdpa_mask's causal window: kv > q - window.
        if kv.last <= q.position - window:
            return None
        return _Block(q, kv, causal, kv.position <= q.last - window)
    if window is None:
        return _Block(q, kv, False, False)
    # Bidirectional window: |q - kv| <= window.
    if kv.position - q.last > window or q.position - kv.last > window:
        return None
    return _Block(q, kv, False, max(q.last - kv.position, kv.last - q.position) > window)


def _block_mask(
    block: _Block, padding: torch.Tensor | None, cfg: _Config, batch: int, device
) -> torch.Tensor | None:
    """The block's bool mask: [B|1, 1, q_len, kv_len] for a window, [B, 1, 1, kv_len] for
    key padding alone (broadcast by the op), None when the op's causal rule is enough.
    padding: the block's keys' [B, kv_len] (nonzero = a real token)."""
    if not block.window_mask:
        return None if padding is None else padding.bool()[:, None, None, :]
    base = min(block.q.position, block.kv.position)
    q_offset, kv_offset = block.q.position - base, block.kv.position - base
    # sdpa_mask reads padding_mask at the keys' positions (kv_offset + j): the slice fits only
    # when the keys come first.
    mask = torch.ops.safeattn.sdpa_mask(
        batch if padding is not None else 1,
        block.q.length,
        block.kv.length,
        q_offset,
        kv_offset,
        causal=cfg.is_causal,
        sliding_window=cfg.sliding_window,
        padding_mask=padding if padding is not None and kv_offset == 0 else None,
        device=device,
    )
    if padding is not None and kv_offset != 0:
        mask = mask & padding.bool()[:, None, None, :]
    return mask


def _weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse), 0 where lse is -inf (no key anywhere: exp(-inf + inf) would be NaN).
    A NaN lse stays NaN."""
    return torch.where(lse == _NEG_INF, 0.0, torch.exp(lse_part - lse))


def _merge_into(out: torch.Tensor, lse: torch.Tensor, out_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """out, lse (accumulators, updated in place) <- their merge with one block's result."""
    merged = torch.logaddexp(lse, lse_part)
    out.mul_(_weight(lse, merged).unsqueeze(-1)).add_(out_part * _weight(lse_part, merged).unsqueeze(-1))
    lse.copy_(merged)


def _attention_block_backward(
    grad_out, grad_lse, query, key, value, out, lse, attn_mask, is_causal, scale, q_offset, kv_offset, softcap
):
    """One block's (grad_query, grad_key, grad_value) from safeattn's backward op, given the
    merged out and lse of the whole sequence. The only call of the private op in this file."""
    grad_query, grad_key, grad_value, _, _ = torch.ops.safeattn._attention_backward(
        grad_out=grad_out,
        grad_lse=grad_lse,
        query=query,
        key=key,
        value=value,
        out=out,
        lse=lse,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        q_offset=q_offset,
        kv_offset=kv_offset,
        softcap=softcap,
        sinks=None,  # the sinks' term is in lse already; their gradient is computed by the caller
        grad_mask_needed=False,
    )
    return grad_query, grad_key, grad_value


# ---- the ring --------------------------------------------------------------------------------------


def _ring_exchange(tensors: list[torch.Tensor], cfg: _Config, tag: int):
    """Start sending `tensors` to the next rank and receiving the previous rank's into new buffers.
    Returns (buffers, works); wait on the works before reading the buffers."""
    send_to = dist.get_global_rank(cfg.group, (cfg.rank + 1) % cfg.world)
    recv_from = dist.get_global_rank(cfg.group, (cfg.rank - 1) % cfg.world)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, cfg.group, tag + i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, r, recv_from, cfg.group, tag + i) for i, r in enumerate(received)]
    return received, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kv_ring(key, value, padding, cfg: _Config):
    """The ring over the ranks' key/value blocks (and padding columns): at each step, yields the
    block held (source rank, key, value, padding or None) while the next one is in flight; the
    step's work runs before its exchange is waited on."""
    travelling = [key, value] + ([padding] if padding is not None else [])
    for step in range(cfg.world):
        if step + 1 < cfg.world:
            arriving, works = _ring_exchange(travelling, cfg, _KV_TAG)
        pad_block = travelling[2] if padding is not None else None
        yield (cfg.rank - step) % cfg.world, travelling[0], travelling[1], pad_block
        if step + 1 < cfg.world:
            _wait(works)
            travelling = arriving


def _forward(query, key, value, padding, sinks, cfg: _Config):
    batch, heads, length, _ = query.shape
    acc = _acc_dtype(query.dtype)
    # Same layout as the op's output: stored [B, S, H, Dv], seen as [B, H, S, Dv].
    out = query.new_zeros((batch, length, heads, value.shape[3]), dtype=acc).transpose(1, 2)
    lse = query.new_full((batch, heads, length), _NEG_INF, dtype=acc)
    q_segments = _segments(cfg.layout, cfg.rank, cfg.world, length)
    filled: set[_Segment] = set()  # query segments holding a result (a segment may see no block)
    for source, k_block, v_block, pad_block in _kv_ring(key, value, padding, cfg):
        for q_seg in q_segments:
            for kv_seg in _segments(cfg.layout, source, cfg.world, length):
                block = _block(q_seg, kv_seg, cfg)
                if block is None:
                    continue
                pad = None if pad_block is None else pad_block[:, kv_seg.rows]
                out_part, lse_part = torch.ops.safeattn.attention(
                    query[:, :, q_seg.rows],
                    k_block[:, :, kv_seg.rows],
                    v_block[:, :, kv_seg.rows],
                    _block_mask(block, pad, cfg, batch, query.device),
                    0,
                    block.causal,
                    cfg.scale,
                    cfg.enable_gqa,
                    q_offset=q_seg.position,
                    kv_offset=kv_seg.position,
                    softcap=cfg.softcap,
                )
                rows = (slice(None), slice(None), q_seg.rows)
                if q_seg in filled:
                    _merge_into(out[rows], lse[rows], out_part, lse_part)
                else:  # the segment's first block: nothing to merge with yet
                    out[rows].copy_(out_part)
                    lse[rows].copy_(lse_part)
                    filled.add(q_seg)
    if sinks is not None:
        # One more logit per head in every row's denominator, taking no value.
        with_sinks = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
        out.mul_(_weight(lse, with_sinks).unsqueeze(-1))
        lse = with_sinks
    return out.to(query.dtype), lse


def _backward(grad_out, grad_lse, query, key, value, padding, out, lse, cfg: _Config):
    batch, _, length, _ = query.shape
    acc = _acc_dtype(query.dtype)
    grad_query = torch.zeros_like(query, dtype=acc)
    q_segments = _segments(cfg.layout, cfg.rank, cfg.world, length)
    grad_works = incoming = None
    for source, k_block, v_block, pad_block in _kv_ring(key, value, padding, cfg):
        # This rank's share of the gradient of block `source`.
        grad_key = torch.zeros_like(k_block, dtype=acc)
        grad_value = torch.zeros_like(v_block, dtype=acc)
        for q_seg in q_segments:
            rows = (slice(None), slice(None), q_seg.rows)
            for kv_seg in _segments(cfg.layout, source, cfg.world, length):
                block = _block(q_seg, kv_seg, cfg)
                if block is None:
                    continue
                cols = (slice(None), slice(None), kv_seg.rows)
                pad = None if pad_block is None else pad_block[:, kv_seg.rows]
                gq, gk, gv = _attention_block_backward(
                    grad_out[rows],
                    None if grad_lse is None else grad_lse[rows],
                    query[rows],
                    k_block[cols],
                    v_block[cols],
                    out[rows],
                    # contiguous: the backward op reads lse as if it were (a row slice is not)
                    lse[rows].contiguous(),
                    _block_mask(block, pad, cfg, batch, query.device),
                    block.causal,
                    cfg.scale,
                    q_seg.position,
                    kv_seg.position,
                    cfg.softcap,
                )
                grad_query[rows].add_(gq)
                grad_key[cols].add_(gk)
                grad_value[cols].add_(gv)
        if grad_works is not None:
            # What the ranks before this one gave to block `source` (it travels one step behind).
            _wait(grad_works)
            grad_key += incoming[0]
            grad_value += incoming[1]
        if cfg.world > 1:
            incoming, grad_works = _ring_exchange([grad_key, grad_value], cfg, _GRAD_TAG)
        else:
            incoming = [grad_key, grad_value]
    if grad_works is not None:
        _wait(grad_works)  # the last step's sums, sent on to the block's owner: this rank's own
    return grad_query.to(query.dtype), incoming[0].to(key.dtype), incoming[1].to(value.dtype)


def _sinks_grad(grad_out, grad_lse, out, lse, sinks) -> torch.Tensor:
    """d loss / d sinks[h] = sum over rows of p_sink * (grad_lse - <grad_out, out>), where
    p_sink = exp(sinks[h] - lse) is the sink's share of the row (this rank's rows only)."""
    acc = lse.dtype
    weight = -(grad_out.to(acc) * out.to(acc)).sum(-1)
    if grad_lse is not None:
        weight = weight + grad_lse.to(acc)
    p_sink = _weight(sinks.to(acc)[None, :, None], lse)
    return (p_sink * weight).sum((0, 2)).to(sinks.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, sinks, padding, cfg: _Config):
        # P2P sends need contiguous buffers; the block slices of the op read any strides.
        key, value = key.contiguous(), value.contiguous()
        if padding is not None:
            padding = padding.to(torch.uint8).contiguous()  # a byte per key: any backend sends it
        out, lse = _forward(query, key, value, padding, sinks, cfg)
        ctx.save_for_backward(query, key, value, padding, sinks, out, lse)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, padding, sinks, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_query, grad_key, grad_value = _backward(
            grad_out, grad_lse, query, key, value, padding, out, lse, ctx.cfg
        )
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            grad_sinks = _sinks_grad(grad_out, grad_lse, out, lse, sinks)
        return grad_query, grad_key, grad_value, grad_sinks, None, None


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group=None,
    layout: str = "contiguous",
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    sliding_window: int | None = None,
    padding_mask: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``safeattn.attention`` over a sequence split across the ranks of ``group`` (ring attention).

    Every rank calls it with its own part of the sequence (:func:`shard_sequence` cuts one) and
    gets its part of the output; together they equal ``safeattn.attention`` over the whole
    sequence with the mask the arguments describe, which is never built: each block of the
    ring gets its mask from positions (``q_offset`` / ``kv_offset``) and its keys' padding.
    Differentiable in ``query``, ``key``, ``value`` and ``sinks``. Example (2 ranks, causal,
    zigzag; ``■`` computed, ``⬚`` skipped; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)::

        q\\kv   0 1 2 3         rank 0: q chunk 0 x kv 0; q chunk 3 x kv 0..3
          0    ◩ ⬚ ⬚ ⬚         rank 1: q chunk 1 x kv 0, 1; q chunk 2 x kv 0..2
          1    ■ ◩ ⬚ ⬚         (◩: a diagonal block, the op's causal rule at the block's
          2    ■ ■ ◩ ⬚         offsets; ⬚ blocks are skipped, their K/V only passed on)
          3    ■ ■ ■ ◩         -> 5 chunk blocks on each rank (contiguous layout: 3 and 7)

    Args:
        query: ``[B, Hq, S_local, D]``, this rank's queries. key, value: ``[B, Hkv, S_local, D|Dv]``
            (the same positions as the queries). ``S_local`` is the same on every rank.
        group: the process group, a 1-D DeviceMesh, or None (the default group).
        layout: ``"contiguous"`` (rank r holds the r-th of ``n`` equal parts) or ``"zigzag"``
            (the sequence in ``2n`` chunks, rank r holding chunks r and 2n-1-r: balanced work
            under a causal mask; ``S_local`` must be even).
        is_causal: key at position j visible to the query at position i iff j <= i.
        scale, enable_gqa, softcap, sinks: as in ``safeattn.attention`` (``sinks`` ``[Hq]``,
            the same on every rank; its gradient is this rank's share, to be summed over the
            group like any replicated parameter's under context parallelism).
        sliding_window: ``w``: with ``is_causal`` keys with ``i - w < j <= i``, otherwise
            ``|i - j| <= w`` (``safeattn.sdpa_mask``'s rule).
        padding_mask: ``[B, S_local]`` bool or integer, nonzero where this rank's tokens are real
            (not padding): the keys there are visible.

    Returns:
        ``(out, lse)`` for this rank's queries: ``out`` ``[B, Hq, S_local, Dv]`` (stored
        ``[B, S_local, Hq, Dv]``, as the op's), ``lse`` ``[B, Hq, S_local]`` float32 (float64 for
        float64 inputs). A query that sees no key has out 0 and lse -inf (``sinks[h]`` with
        sinks), and 0 gradients.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(
                f"context_parallel_attention: {name} must be 4-D [batch, heads, seq, dim], got {t.dim()}-D"
            )
    if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        raise ValueError(
            "context_parallel_attention: query, key and value must hold the same positions (local lengths "
            f"{query.shape[2]}, {key.shape[2]}, {value.shape[2]})"
        )
    if padding_mask is not None and (
        padding_mask.dim() != 2 or tuple(padding_mask.shape) != (query.shape[0], query.shape[2])
    ):
        raise ValueError(
            "context_parallel_attention: padding_mask must be [batch, S_local] = "
            f"[{query.shape[0]}, {query.shape[2]}], got {list(padding_mask.shape)}"
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"context_parallel_attention: sliding_window must be > 0, got {sliding_window}")
    _check_layout("context_parallel_attention", layout, query.shape[2])
    pg = _group_of(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    cfg = _Config(pg, rank, world, layout, is_causal, scale, enable_gqa, sliding_window, softcap)
    return _ContextParallelAttention.apply(query, key, value, sinks, padding_mask, cfg)
