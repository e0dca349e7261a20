"""The fakes of ``sdpa_mask``, ``_key_ranges`` and ``_attention_kvcache``: their outputs, with the checks of the
first run by the C++ code itself.

Every op's checks are written once, in C++, on symbolic sizes (csrc/common/checks.h). The other
ops' fakes are C++ Meta kernels beside their CPU entry points, so nothing of them is here.
``sdpa_mask`` may have no tensor argument, and FakeTensorMode cannot place the output of such a
Meta kernel on a device; so its fake is this function, which runs the checks through the private
op ``safeattn::_sdpa_mask_check`` (csrc/ops/sdpa_mask.cpp, the checks' only copy) and adds the
output that they decide: ``[batch_size, 1, q_length, kv_length]`` in ``dtype`` (bool by
default) on ``device``, else on the device of the tensor arguments, else on the CPU.
"""

from __future__ import annotations

import torch


@torch.library.register_fake("safeattn::sdpa_mask")
def _sdpa_mask_fake(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, *, causal=True, **options):
    torch.ops.safeattn._sdpa_mask_check(batch_size, q_length, kv_length, q_offset, kv_offset, **options)
    device = options.get("device")
    if device is None:
        tensors = [t for t in options.values() if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
    dtype = options.get("dtype")
    return torch.empty(
        (batch_size, 1, q_length, kv_length), dtype=torch.bool if dtype is None else dtype, device=device
    )


@torch.library.register_fake("safeattn::_key_ranges")
def _key_ranges_fake(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, *, causal=True, **options):
    """``[Bm, q_length, 2]`` int32 (csrc/ops/sdpa_mask.h): Bm is batch_size with per-row inputs."""
    device = options.pop("device", None)
    torch.ops.safeattn._sdpa_mask_check(
        batch_size, q_length, kv_length, q_offset, kv_offset, device=device, **options
    )
    tensors = [t for t in options.values() if isinstance(t, torch.Tensor)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    return torch.empty((batch_size if tensors else 1, q_length, 2), dtype=torch.int32, device=device)


@torch.library.register_fake("safeattn::_attention_kvcache")
def _attention_kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, *args):
    """``_attention_kvcache``'s outputs (csrc/ops/attention_kvcache.h), on symbolic sizes: its only
    caller, ``attention_with_kvcache``, has checked the arguments by then."""
    batch, q_length, heads, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty((batch, q_length, heads, v_cache.shape[3]))
    return out, q.new_empty((batch, heads, q_length), dtype=lse_dtype)
