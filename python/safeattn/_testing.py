"""Private switches for safeattn's own tests and benchmarks; not part of the API.

``generic_kernels()`` makes attention on an H100/H200 run the generic CUDA kernels (mma.sync, the
ones A100, Ada and Blackwell GPUs run) instead of the sm_90a kernels, so that the GPUs at hand can
test and measure them. It is process-wide and not thread-safe by design: tests and benchmarks
switch it around whole runs (``pytest --generic-kernels``, ``bench attention --generic-kernels``).
"""

from __future__ import annotations

import contextlib

from . import _C


def set_generic_kernels_only(on: bool) -> None:
    if not hasattr(_C, "_set_generic_kernels_only"):
        raise RuntimeError("this build of safeattn has no CUDA kernels")
    _C._set_generic_kernels_only(bool(on))


@contextlib.contextmanager
def generic_kernels():
    set_generic_kernels_only(True)
    try:
        yield
    finally:
        set_generic_kernels_only(False)
