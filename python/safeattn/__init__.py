"""safeattn: attention masks built natively, softmax and attention that never make NaN.

The ops are PyTorch dispatcher ops (``torch.ops.safeattn.*``) with CPU and CUDA kernels, fake
implementations and autograd formulas, so they run eagerly and under ``torch.compile``.
"""

import torch  # loads libtorch, which _C links against

from . import (  # noqa: F401  registrations
    _C,  # noqa: F401  loads the native library: registers torch.ops.safeattn.*
    _autograd,
    _fake,
    distributed,  # DTensor sharding rules, registered once torch.distributed.tensor is imported
)
from ._version import __version__
from .ops import attention, masked_softmax, safe_softmax, sdpa_mask

__all__ = ["__version__", "attention", "build_info", "masked_softmax", "safe_softmax", "sdpa_mask"]


def build_info() -> dict:
    """What this build holds: versions, CPU ISA variants, CUDA archs, each op's kernels."""
    info = dict(_C.build_info())
    op_kernels: dict[str, list[str]] = {}
    for key in ("CPU", "CUDA", "Meta", "Autograd"):
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(key):
            if name.startswith("safeattn::"):
                op_kernels.setdefault(name.split("::", 1)[1], []).append(key)
    info["op_kernels"] = op_kernels
    return info
