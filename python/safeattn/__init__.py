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
    info["hopper_kernels"] = bool(info.get("attention_sm90_fwd_head_dims"))
    return info


def gpu_coverage(device: int | torch.device | None = None) -> str:
    """Whether this build runs on a GPU, and with which attention kernels, in one line:
    ``"NVIDIA H100 80GB HBM3 (9.0): sm_90a kernels (Hopper), generic for the rest"``, or what is
    missing and the command that rebuilds for it (the error a CUDA op would raise there)."""
    index = torch.cuda._get_device_index(device, optional=True)
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    head = f"{name} ({major}.{minor})"
    if not build_info()["with_cuda"]:
        return f"{head}: not covered: this build has no CUDA kernels"
    try:
        _C._check_device_supported(index)
    except RuntimeError as error:
        return f"{head}: not covered: {error}".split("\n", 1)[0]
    if (major, minor) == (9, 0):
        if build_info()["hopper_kernels"]:
            return f"{head}: covered, attention on the sm_90a kernels (TMA + wgmma)"
        return f"{head}: covered, but without the sm_90a kernels: attention runs the generic kernels (slow)"
    return f"{head}: covered, attention on the generic tensor-core kernels (mma.sync)"
