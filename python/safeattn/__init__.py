"""safeattn: attention masks built natively, softmax and attention that never make NaN.

The ops are PyTorch dispatcher ops (``torch.ops.safeattn.*``) with CPU and CUDA kernels, fake
implementations and autograd formulas, so they run eagerly and under ``torch.compile``.
"""

import torch  # noqa: F401  loads libtorch, which _C links against

from . import _C  # noqa: F401  loads the native library: registers torch.ops.safeattn.*
from . import _autograd, _fake  # noqa: F401  registrations
from ._version import __version__
from .ops import attention, sdpa_mask

__all__ = ["__version__", "attention", "build_info", "sdpa_mask"]


def build_info() -> dict:
    """What this build holds: versions, CPU ISA variants, CUDA archs, each op's kernels."""
    return _C.build_info()
