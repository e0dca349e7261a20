"""Is safeattn._C built for the torch that is running? Answered without loading _C.

An extension compiled against one torch and loaded into another fails with an undefined symbol,
or loads and aborts the interpreter (a C++ ABI mismatch), neither of which says what to do. So
setup.py writes ``_build_config.py`` next to ``_C`` (the torch version, its CUDA version and C++
ABI), ``import safeattn`` compares it with the running torch first, and a mismatch is an
ImportError that names both sides and the command that rebuilds safeattn for this torch.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path

import torch

from ._version import __version__

PACKAGE_DIR = Path(__file__).resolve().parent
RECORDED = (
    "torch_version",
    "torch_cuda_version",
    "cxx11_abi",
    "with_cuda",
    "cuda_targets",
    "sm90a",
    "build_env",
)


def build_record() -> dict | None:
    """What setup.py recorded when it built _C, or None where no build wrote it."""
    try:
        config = importlib.import_module(f"{__package__}._build_config")
    except ModuleNotFoundError:
        return None
    return {name: getattr(config, name, None) for name in RECORDED}


def running_torch() -> dict:
    return {
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def _release(version: str) -> str:
    """ "2.9.1+cu128" -> "2.9.1": the local tag names the CUDA variant, compared on its own."""
    return version.split("+", 1)[0]


def abi_name(cxx11: bool) -> str:
    return "the C++11 ABI" if cxx11 else "the pre-C++11 ABI"


def mismatches(built: dict, now: dict) -> list[str]:
    """Each difference between the build and the running torch that breaks _C, in words.

    Torch has no stable C++ ABI across releases (patch releases included: torchvision pins
    the exact one), so the releases must be equal. The CUDA variant matters only where CUDA
    kernels were built: a CPU-only _C links no CUDA library and runs with either variant."""
    found = []
    if _release(built["torch_version"]) != _release(now["torch_version"]):
        found.append(f"built against torch {built['torch_version']}, running torch {now['torch_version']}")
    if built["with_cuda"] and built["torch_cuda_version"] != now["torch_cuda_version"]:
        have = f"CUDA {now['torch_cuda_version']}" if now["torch_cuda_version"] else "no CUDA (a CPU build)"
        found.append(
            f"CUDA kernels built for torch's CUDA {built['torch_cuda_version']}, running torch has {have}"
        )
    if bool(built["cxx11_abi"]) != now["cxx11_abi"]:
        found.append(
            f"built with {abi_name(built['cxx11_abi'])}, running torch uses {abi_name(now['cxx11_abi'])}"
        )
    return found


def source_tree() -> Path | None:
    """The source tree this package lives in (an editable or in-place build), else None."""
    root = PACKAGE_DIR.parents[1]
    return root if (root / "setup.py").is_file() and (root / "csrc").is_dir() else None


def rebuild_command(built: dict | None) -> str:
    """The command that rebuilds _C against the running torch, with the build switches used."""
    env = (built or {}).get("build_env") or {}
    prefix = "".join(f"{name}={shlex.quote(value)} " for name, value in sorted(env.items()))
    root = source_tree()
    if root is not None:
        return (
            f"cd {shlex.quote(str(root))} && {prefix}python -m pip install --no-build-isolation --no-deps -e .\n"
            f"    (an in-place build instead: {prefix}python setup.py build_ext --inplace)"
        )
    # --no-cache-dir: pip would otherwise reuse the wheel it built for the old torch.
    return (
        f"{prefix}python -m pip install --no-build-isolation --no-deps --no-cache-dir "
        f"--force-reinstall safeattn=={__version__}\n"
        f"    (installed from an sdist or a source folder: the same command with its path for the last argument)"
    )


def describe(record: dict | None) -> str:
    if record is None:
        return "no build record"
    cuda = (
        f"CUDA kernels for CUDA {record['torch_cuda_version']}" if record["with_cuda"] else "no CUDA kernels"
    )
    return f"torch {record['torch_version']}, {abi_name(record['cxx11_abi'])}, {cuda}"


def problem() -> str | None:
    """Why _C must not be loaded into this process, with the fix; None when it may."""
    record = build_record()
    now = running_torch()
    if record is None:
        native = sorted(p.name for p in PACKAGE_DIR.glob("_C.*") if p.suffix in (".so", ".pyd"))
        what = (
            f"safeattn's native library ({native[0]}) has no build record ({PACKAGE_DIR / '_build_config.py'}): "
            "it was built by an older setup.py or copied by hand"
            if native
            else f"safeattn's native library _C is not built in {PACKAGE_DIR}"
        )
        return f"{what}. Build it against this torch ({now['torch_version']}):\n    {rebuild_command(None)}"
    found = mismatches(record, now)
    if not found:
        return None
    return (
        f"safeattn {__version__} was built for another torch than the one running "
        f"({Path(torch.__file__).parent}):\n"
        + "".join(f"  - {line}\n" for line in found)
        + "Rebuild it against this torch:\n"
        f"    {rebuild_command(record)}"
    )


def load_failure(error: BaseException) -> str:
    """The message for a _C that passed the check and still failed to load."""
    record = build_record()
    return (
        f"safeattn._C failed to load: {error}\n"
        f"It was built for {describe(record)}; running torch {torch.__version__}. Rebuild it:\n"
        f"    {rebuild_command(record)}"
    )


def started_as_cli() -> bool:
    """True while ``python -m safeattn ...`` imports this package: runpy sets sys.argv[0] to "-m"
    until it has found __main__, and sys.orig_argv names the module. The package then stays
    importable with a broken build, so that ``python -m safeattn info`` can say what is wrong."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-m":
            return argv[i + 1 : i + 2] in (["safeattn"], ["safeattn.__main__"])
        if arg.startswith("-m"):
            return arg[2:] in ("safeattn", "safeattn.__main__")
    return False
