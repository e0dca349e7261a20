"""safeattn: attention masks built natively, softmax and attention that never make NaN.

The ops are PyTorch dispatcher ops (``torch.ops.safeattn.*``) with CPU and CUDA kernels, fake
implementations and autograd formulas, so they run eagerly and under ``torch.compile``.
"""

import torch  # loads libtorch, which _C links against

from . import _build_check
from ._version import __version__
from .ops import MaskDescription, attention, masked_softmax, safe_softmax, sdpa_mask
from .serving import attention_with_kvcache, varlen_attention

# Checked before _C loads: a _C built for another torch fails with an undefined symbol or aborts
# the interpreter. `python -m safeattn info` gets the package without _C, to print this itself.
_build_problem = _build_check.problem()
if _build_problem is not None and not _build_check.started_as_cli():
    raise ImportError(_build_problem)
if _build_problem is None:
    try:
        from . import _C  # noqa: F401  loads the native library: registers torch.ops.safeattn.*
    except ImportError as error:
        raise ImportError(_build_check.load_failure(error)) from error
    # Registrations; distributed registers its DTensor rules once torch.distributed.tensor is imported.
    from . import _autograd, _fake, distributed  # noqa: F401

__all__ = [
    "MaskDescription",
    "__version__",
    "attention",
    "attention_with_kvcache",
    "build_info",
    "masked_softmax",
    "safe_softmax",
    "sdpa_mask",
    "varlen_attention",
]


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
