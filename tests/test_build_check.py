"""import safeattn checks the torch _C was built for (python/safeattn/_build_config.py) before it
loads _C, and a mismatch is an ImportError that names both sides and the rebuild command."""

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import safeattn
import torch
from safeattn import _build_check

PACKAGE = Path(safeattn.__file__).resolve().parent
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def record(**changes):
    built = {
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "with_cuda": False,
        "build_env": {},
    }
    built.update(changes)
    return built


def test_this_build_matches_the_running_torch():
    built = _build_check.build_record()
    assert built is not None, f"no _build_config.py next to {PACKAGE}"
    assert _build_check.mismatches(built, _build_check.running_torch()) == [], built
    assert safeattn._build_problem is None


@pytest.mark.parametrize(
    "built, now, expected",
    [
        (
            record(torch_version="1.13.1"),
            {"torch_version": "2.9.1"},
            ["built against torch 1.13.1, running torch 2.9.1"],
        ),
        # patch releases are not ABI-compatible promises either
        (record(torch_version="2.9.0+cu128"), {"torch_version": "2.9.1+cu128"}, ["torch 2.9.0+cu128"]),
        # a CPU-only _C runs with either CUDA variant of the same release
        (record(torch_version="2.13.0+cpu", torch_cuda_version=None), {"torch_version": "2.13.0"}, []),
        (
            record(torch_version="2.14.1+cu130", torch_cuda_version="13.0", with_cuda=True),
            {"torch_version": "2.14.1+cpu", "torch_cuda_version": None},
            ["CUDA kernels built for torch's CUDA 13.0, running torch has no CUDA (a CPU build)"],
        ),
        (
            record(torch_version="2.9.1", torch_cuda_version="12.8", with_cuda=True),
            {"torch_version": "2.9.1", "torch_cuda_version": "12.6"},
            ["running torch has CUDA 12.6"],
        ),
        (
            record(torch_version="1.13.1", cxx11_abi=True),
            {"torch_version": "1.13.1", "cxx11_abi": False},
            ["built with the C++11 ABI, running torch uses the pre-C++11 ABI"],
        ),
    ],
)
def test_mismatches(built, now, expected):
    running = {"torch_version": "", "torch_cuda_version": "12.8", "cxx11_abi": built["cxx11_abi"], **now}
    found = _build_check.mismatches(built, running)
    assert len(found) == len(expected), f"{built} vs {running}: {found}"
    for line, part in zip(found, expected, strict=True):
        assert part in line, f"{part!r} not in {line!r}"


def test_rebuild_command_in_a_source_tree(tmp_path, monkeypatch):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "setup.py").write_text("")
    monkeypatch.setattr(_build_check, "PACKAGE_DIR", tmp_path / "python" / "safeattn")
    command = _build_check.rebuild_command(
        record(build_env={"SAFEATTN_CUDA": "0", "SAFEATTN_CPU_ISAS": "DEFAULT;AVX2"})
    )
    expected = f"cd {tmp_path} && SAFEATTN_CPU_ISAS='DEFAULT;AVX2' SAFEATTN_CUDA=0 python -m pip install --no-build-isolation --no-deps -e ."
    assert command.splitlines()[0] == expected, command


def copy_package(dest: Path, config: str | None, native: bytes | None = None) -> Path:
    """A copy of the installed package whose _C is this build's (a link) or `native` bytes, and
    whose build record is `config` (None: no record)."""
    pkg = dest / "safeattn"
    shutil.copytree(PACKAGE, pkg, ignore=shutil.ignore_patterns("_C.*", "_build_config.py", "__pycache__"))
    if native is None:
        (pkg / f"_C{EXT_SUFFIX}").symlink_to(next(PACKAGE.glob("_C.*")))
    else:
        (pkg / f"_C{EXT_SUFFIX}").write_bytes(native)
    if config is not None:
        (pkg / "_build_config.py").write_text(config)
    return dest


def config_text(**changes) -> str:
    return "".join(f"{name} = {value!r}\n" for name, value in record(**changes).items())


def run(path: Path, *args) -> subprocess.CompletedProcess:
    # From the copy's folder, so that neither the source tree nor an installed safeattn is found.
    return subprocess.run(
        [sys.executable, *args],
        cwd=path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(path)},
    )


def test_import_with_another_torch_is_a_clear_import_error(tmp_path):
    other_abi = not torch._C._GLIBCXX_USE_CXX11_ABI
    path = copy_package(
        tmp_path, config_text(torch_version="1.13.1", cxx11_abi=other_abi, build_env={"SAFEATTN_CUDA": "0"})
    )
    result = run(path, "-c", "import safeattn")
    assert result.returncode == 1, result
    err = result.stderr
    assert "ImportError: safeattn 0.1.0 was built for another torch" in err, err
    assert f"built against torch 1.13.1, running torch {torch.__version__}" in err, err
    assert "ABI" in err, err
    assert (
        "SAFEATTN_CUDA=0 python -m pip install --no-build-isolation --no-deps --no-cache-dir --force-reinstall safeattn=="
        in err
    ), err


def test_info_explains_a_mismatched_build(tmp_path):
    path = copy_package(tmp_path, config_text(torch_version="1.13.1"))
    result = run(path, "-m", "safeattn", "info")
    assert result.returncode == 1, result
    assert "native library not loaded" in result.stdout, result.stdout
    assert "built for       torch 1.13.1" in result.stdout, result.stdout
    assert f"running         torch {torch.__version__}" in result.stdout, result.stdout
    assert f"built against torch 1.13.1, running torch {torch.__version__}" in result.stderr, result.stderr
    assert "--no-build-isolation" in result.stderr, result.stderr
    # Only `python -m safeattn` is let through: a package that imports safeattn while -m runs it
    # (sys.argv[0] is "-m" then too) still gets the error.
    (path / "probe").mkdir()
    (path / "probe" / "__init__.py").write_text("import safeattn\n")
    (path / "probe" / "__main__.py").write_text("print(safeattn)\n")
    other = run(path, "-m", "probe")
    assert (
        other.returncode == 1 and "ImportError: safeattn 0.1.0 was built for another torch" in other.stderr
    ), other


def test_import_without_a_build_record(tmp_path):
    path = copy_package(tmp_path, None)
    result = run(path, "-c", "import safeattn")
    assert result.returncode == 1, result
    assert "has no build record" in result.stderr and "--no-build-isolation" in result.stderr, result.stderr


def test_a_native_library_that_fails_to_load_says_how_to_rebuild(tmp_path):
    path = copy_package(tmp_path, config_text(), native=b"not a shared library")
    result = run(path, "-c", "import safeattn")
    assert result.returncode == 1, result
    assert (
        "safeattn._C failed to load" in result.stderr and "--force-reinstall" in result.stderr
    ), result.stderr


def glibc_versions_needed(library):
    """The GLIBC_x.y versions `library` imports (readelf's version-needs section)."""
    out = subprocess.run(
        ["readelf", "-W", "--version-info", str(library)], capture_output=True, text=True, check=True
    )
    needs = out.stdout.split("Version needs section", 1)[-1] if "Version needs section" in out.stdout else ""
    return {tuple(int(x) for x in v.split(".")) for v in re.findall(r"Name: GLIBC_([\d.]+)", needs)}


@pytest.mark.skipif(
    not (
        sys.platform.startswith("linux")
        and platform.machine() == "x86_64"
        and platform.libc_ver()[0] == "glibc"
    ),
    reason="x86_64 glibc builds only (csrc/common/glibc_compat.cpp)",
)
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_c_needs_no_glibc_newer_than_manylinux_2_28():
    # setup.py wraps the newer symbols a build on a newer glibc would import (exp, log, and what
    # the static libstdc++ brings), so that a wheel made anywhere installs on glibc 2.28.
    library = Path(safeattn._C.__file__)
    versions = glibc_versions_needed(library)
    assert versions, f"readelf found no GLIBC version needs in {library}"
    too_new = sorted(v for v in versions if v > (2, 28))
    assert too_new == [], f"{library.name} needs GLIBC {['.'.join(map(str, v)) for v in too_new]}"
