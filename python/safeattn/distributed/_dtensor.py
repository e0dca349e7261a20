"""DTensor sharding rules for the safeattn ops, so that a DTensor in gives a DTensor out.

Each rule lists, for one mesh dimension, the placements under which the op can run on every
rank's local shard with no communication; DTensor expands them over every mesh dimension and
picks the one needing the least redistribution (none when the inputs already match one):

- ``attention``, ``_attention_forward`` and ``_attention_backward``: everything replicated; batch-sharded (q, k, v,
  out, lse on dim 0); head-sharded (dim 1; ``sinks`` and its gradient on dim 0). A mask or bias
  is sharded on the same dim where it has that dim at full size, else replicated (a broadcast
  dim); the gradient of a replicated mask or of ``sinks`` under batch sharding is ``Partial``
  (a sum over ranks that DTensor performs when the value is needed, not before).
- ``safe_softmax``, ``masked_softmax`` and their backward ops: sharded on any dim but the
  softmax dim (the mask follows the scores where it has the dim at full size).
- ``sdpa_mask``: its sizes are arguments, not tensors, so a placement rule cannot shrink
  ``batch_size`` to the local batch. A handler (the mechanism torch uses for its own loss and
  context-parallel ops) runs it on the local shards: replicated inputs give a replicated mask,
  batch-sharded inputs (padding mask, packed ids, ...) a batch-sharded one.

Sequence (query length) sharding is not offered: a rank's queries need every key, and the causal
offsets differ per rank; that is what :func:`safeattn.distributed.context_parallel_attention`
does, with communication.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

# DTensorSpec is what register_sharding passes in place of a tensor argument (placements, mesh,
# tensor_meta); its module is private but has held it since DTensor went public (torch 2.5).
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.experimental import register_sharding

_ops = torch.ops.safeattn
_R = Replicate()

# A rule maps the op's arguments, by schema name (DTensorSpec for a DTensor argument), to a list
# of (output placements, {input name: placement}) for one mesh dimension.
Rule = Callable[[dict], list[tuple[list, dict]]]


def _register(op: torch._ops.OpOverload, rule: Rule) -> None:
    """Register `rule` for `op`, translating its by-name placements into the positional lists
    register_sharding expects: one entry per argument given (positional ones, then keywords in
    the order given), None for a non-tensor one."""
    names = [argument.name for argument in op._schema.arguments]

    def sharding(*args, **kwargs):
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        given = names[: len(args)] + list(kwargs)
        strategies = []
        for outputs, inputs in rule(bound):
            placements = []
            for name in given:
                if isinstance(bound[name], DTensorSpec):
                    if name not in inputs:
                        raise NotImplementedError(
                            f"safeattn: no DTensor sharding rule for {op}'s argument {name!r}"
                        )
                    placements.append(inputs[name])
                else:
                    placements.append(None)
            strategies.append((outputs, placements))
        return strategies

    register_sharding(op)(sharding)


def _spec(value) -> DTensorSpec | None:
    return value if isinstance(value, DTensorSpec) else None


def _shard_if_full(spec: DTensorSpec | None, dim_from_end: int, full_size: int):
    """Placement of a broadcastable tensor (a mask, aligned to the right) when the tensor it
    broadcasts to is sharded on the dim `dim_from_end` places from the end: sharded the same way
    where it has that dim at full size, replicated where the dim is missing or broadcast (1)."""
    if spec is None:
        return None
    dim = spec.ndim - dim_from_end
    if dim >= 0 and full_size != 1 and spec.shape[dim] == full_size:
        return Shard(dim)
    return _R


def _grad_of(placement):
    """Gradient placement of an input broadcast over a sharded dim: a sum over the ranks."""
    return Partial() if placement == _R else placement


def _keep_keyword_placements(strategies: list, keyword_specs: dict) -> list:
    """DTensor never redistributes keyword arguments (only positional ones): keep the strategies
    whose keyword tensors (attention's `sinks`, `key_ranges`) already have the placement they ask for, so a
    mismatch redistributes q/k/v instead of reaching the kernel with a wrong local shape."""
    return [
        (outputs, inputs)
        for outputs, inputs in strategies
        if all(inputs[name] in spec.placements for name, spec in keyword_specs.items())
    ]


# ---- attention ---------------------------------------------------------------------------------
# query [B, Hq, Q, D], key/value [B, Hkv, KV, D|Dv], out [B, Hq, Q, Dv], lse [B, Hq, Q],
# attn_mask broadcastable to [B, Hq, Q, KV] (2-D to 4-D), sinks [Hq], key_ranges [B, Q, 2].


def _head_shardable(query: DTensorSpec, key: DTensorSpec) -> bool:
    """Whether q and k/v can be cut into head shards that keep grouped-query pairs together.
    DTensor cuts unevenly (torch.chunk) when a size is not a multiple of the shard count, which is
    harmless with one key/value head per query head but mismatches the groups otherwise: then
    both head counts must divide by the shard count (the mesh dims that shard q's heads now, or
    the whole mesh)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads == kv_heads:
        return True
    mesh_sizes = query.mesh.shape
    head_dims = [i for i, p in enumerate(query.placements) if p == Shard(1)]
    shards = math.prod(mesh_sizes[i] for i in head_dims) if head_dims else math.prod(mesh_sizes)
    return kv_heads % shards == 0


def _attention_strategies(a: dict, backward: bool, forward_outputs: int = 2) -> list:
    query, key = a["query"], a["key"]
    mask, sinks, ranges = _spec(a.get("attn_mask")), _spec(a.get("sinks")), _spec(a.get("key_ranges"))
    batch, heads = query.shape[0], query.shape[1]
    mask_grad = backward and mask is not None and bool(a.get("grad_mask_needed", False))

    def strategy(dim: int | None):
        """dim: the dim of q/k/v/out/lse that is sharded (None: everything replicated)."""
        if dim is None:
            mask_p = None if mask is None else _R
            sinks_p = None if sinks is None else _R
            ranges_p = None if ranges is None else _R
            shard = _R
        else:
            shard = Shard(dim)
            mask_p = _shard_if_full(mask, 4 - dim, batch if dim == 0 else heads)
            sinks_p = None if sinks is None else (Shard(0) if dim == 1 else _R)
            ranges_p = None if ranges is None else (Shard(0) if dim == 0 else _R)
        inputs = {
            name: shard for name in ("grad_out", "grad_lse", "query", "key", "value", "out", "lse", "lse_lo")
        }
        inputs["attn_mask"], inputs["sinks"], inputs["key_ranges"] = mask_p, sinks_p, ranges_p
        if not backward:
            return [shard] * forward_outputs, inputs  # out, lse (and lse_lo: _attention_forward)
        # Unused gradient outputs are empty tensors: replicated.
        grad_mask_p = _grad_of(mask_p) if mask_grad else _R
        grad_sinks_p = _grad_of(sinks_p) if sinks is not None else _R
        return [shard, shard, shard, grad_mask_p, grad_sinks_p], inputs

    strategies = [strategy(None), strategy(0)]
    if _head_shardable(query, key):
        strategies.append(strategy(1))
    # Keywords: the forward's sinks and key_ranges, the backward's key_ranges.
    keywords = {"sinks": sinks} if not backward and sinks is not None else {}
    if ranges is not None:
        keywords["key_ranges"] = ranges
    if keywords:
        strategies = _keep_keyword_placements(strategies, keywords)
    return strategies


# ---- softmax family ----------------------------------------------------------------------------


def _softmax_strategies(a: dict, input_name: str, outputs: int) -> list:
    """safe_softmax / masked_softmax (outputs=1) and their backward ops (1 output for
    _safe_softmax_backward, 2 for _masked_softmax_backward: grad_scores, grad_mask): sharded on
    any dim but the softmax dim, or replicated."""
    scores = a[input_name]
    ndim = scores.ndim
    dim = a.get("dim", -1)
    softmax_dim = dim + ndim if dim < 0 else dim
    mask = _spec(a.get("mask"))
    mask_grad = mask is not None and bool(a.get("mask_requires_grad", False))

    def strategy(shard: int | None):
        if shard is None:
            placement, mask_p = _R, (None if mask is None else _R)
        else:
            placement = Shard(shard)
            mask_p = _shard_if_full(mask, ndim - shard, scores.shape[shard])
        inputs = {
            "self": placement,
            "scores": placement,
            "grad_out": placement,
            "out": placement,
            "mask": mask_p,
        }
        # The mask gradient (an empty tensor, replicated, when not asked for) is summed over the
        # ranks where the mask is broadcast over the sharded dim.
        grad_mask_p = _grad_of(mask_p) if mask_grad else _R
        return [placement, grad_mask_p][:outputs], inputs

    return [strategy(None)] + [strategy(d) for d in range(ndim) if d != softmax_dim]


# ---- sdpa_mask ---------------------------------------------------------------------------------
# Its tensor inputs are keyword-only; each has the batch as dim 0 except q_positions when it is
# 0-D or 1-D (the same positions for every batch).
_SDPA_MASK_TENSORS = ("q_positions", "chunk_left_padding", "padding_mask", "packed_ids", "block_ids")


def _sdpa_mask_handler(op_call, args, kwargs):
    """sdpa_mask with DTensor inputs: the mask is built on each rank for its local batch."""
    dtensors = {name: kwargs[name] for name in _SDPA_MASK_TENSORS if isinstance(kwargs.get(name), DTensor)}
    mesh = next(iter(dtensors.values())).device_mesh
    for name, t in dtensors.items():
        if t.device_mesh != mesh:
            raise ValueError(f"sdpa_mask: DTensor {name} is on another device mesh than the other inputs")

    def has_batch(name: str, t: DTensor) -> bool:
        return not (name == "q_positions" and t.dim() < 2)

    # Per mesh dim: the mask is batch-sharded where any input with a batch dim is; inputs
    # replicated there are cut locally (Replicate -> Shard needs no communication).
    placements = []
    for mesh_dim in range(mesh.ndim):
        sharded = False
        for name, t in dtensors.items():
            p = t.placements[mesh_dim]
            if p == Shard(0) and has_batch(name, t):
                sharded = True
            elif p != _R:
                raise NotImplementedError(
                    f"sdpa_mask: DTensor {name} must be replicated or sharded on its batch dim (0), got {p}"
                )
        placements.append(Shard(0) if sharded else _R)

    local_kwargs = dict(kwargs)
    local_batch = None
    for name, t in dtensors.items():
        want = placements if has_batch(name, t) else [_R] * mesh.ndim
        local = t.redistribute(mesh, want).to_local()
        local_kwargs[name] = local
        if has_batch(name, t):
            local_batch = local.shape[0]
    local_args = list(args)
    batch_size = args[0]
    if local_batch is not None:
        local_args[0] = local_batch
    mask = op_call(*local_args, **local_kwargs)
    global_shape = (batch_size, *mask.shape[1:])
    global_stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(
        mask, mesh, placements, run_check=False, shape=global_shape, stride=global_stride
    )


_registered = False


def register() -> None:
    """Register every rule (idempotent)."""
    global _registered
    if _registered:
        return
    _register(_ops.attention.default, lambda a: _attention_strategies(a, backward=False))
    # What attention's Autograd kernel calls: out, lse and lse_lo, placed alike.
    _register(
        _ops._attention_forward.default, lambda a: _attention_strategies(a, backward=False, forward_outputs=3)
    )
    _register(_ops._attention_backward.default, lambda a: _attention_strategies(a, backward=True))
    _register(_ops.safe_softmax.default, lambda a: _softmax_strategies(a, "self", outputs=1))
    _register(_ops._safe_softmax_backward.default, lambda a: _softmax_strategies(a, "out", outputs=1))
    _register(_ops.masked_softmax.default, lambda a: _softmax_strategies(a, "scores", outputs=1))
    _register(_ops._masked_softmax_backward.default, lambda a: _softmax_strategies(a, "out", outputs=2))
    DTensor._op_dispatcher._custom_op_handlers[_ops.sdpa_mask.default] = _sdpa_mask_handler
    _registered = True
