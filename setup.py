"""Builds safeattn._C with torch.utils.cpp_extension.

Sources are found by folder, so adding an op needs no edit here:
  csrc/*.cpp, csrc/common/*.cpp, csrc/ops/*.cpp   compiled once
  csrc/ops/cpu/*_kernel.cpp           compiled once per CPU ISA (see CPU_ISAS)
  csrc/common/*.cu, csrc/ops/cuda/*.cu, csrc/ops/cuda/{generic,hopper}/*.cu and
  csrc/ops/cuda/generic/instances/*.cu            compiled by nvcc for the CUDA targets
  csrc/ops/cuda/hopper/instances/*.cu             compiled by nvcc for sm_90a alone

Environment switches:
  SAFEATTN_CUDA=auto|0|1        auto: build CUDA when nvcc and a CUDA build of torch are present
  TORCH_CUDA_ARCH_LIST="8.0;8.6;9.0+PTX"  the GPU targets, in PyTorch's syntax (cuda_targets below);
                                unset: the GPUs visible now, else DEFAULT_CUDA_ARCHS (Ampere to
                                Blackwell, PTX of the newest). Any 9.x entry builds the Hopper
                                kernels for sm_90a as well; SAFEATTN_CUDA_ARCHS is a deprecated alias
  SAFEATTN_SM90=0               build no Hopper (sm_90a) kernels even when 9.0 is a target: the
                                slow path on H100/H200, and the only way to target 9.0 without CUTLASS
  SAFEATTN_CPU_ISAS="DEFAULT;AVX2;AVX512"  restrict the CPU variants (x86 only; faster dev builds)
  SAFEATTN_OPS="sdpa_mask,..."  compile only these ops' kernels (dev builds; schemas always built)
  SAFEATTN_ATTN_HEAD_DIMS="64,96,128,256"  the head dims whose CUDA attention instantiations are
                                compiled (files attention_{fwd,bwd,fwd_sm90,bwd_sm90}_d<D>_<dtype>.cu;
                                "all" for every file); the others take the generic path. Default:
                                64,96,128,256, the common head dims, tested on a GPU
  SAFEATTN_CUTLASS_INCLUDE=dir  the CUTLASS / CuTe headers (default: the nvidia-cutlass package's
                                cutlass_library/source/include), which the Hopper kernels
                                (csrc/ops/cuda/hopper/instances/*.cu, built for sm_90a, SAFEATTN_WITH_SM90)
                                need: a build that targets 9.0 without them stops (NO_CUTLASS)
  SAFEATTN_DEBUG_INFO=1         keep debug info (-g) in _C; release builds have none (-g0)
  SAFEATTN_BUILD_TEMP=dir       where the object files go (default: setuptools', a temporary
                                directory for an editable install; scripts/env.sh: build/temp)
  MAX_JOBS                      parallel compile jobs (default: from cores and memory)
  NVCC_THREADS=N                nvcc compiles a file's CUDA targets N at a time (--threads; default
                                1): a build for several targets on many cores, such as a wheel's
  SAFEATTN_LOCAL_VERSION=auto   a binary wheel's version names its torch, CUDA and C++ ABI
                                (0.1.0+cu130torch2.14.1cxx11abiTRUE; see package_version)

safeattn is compiled against the torch it will run with, so it is built with build isolation
off, in the environment that has torch: `pip install --no-build-isolation .` (see
NO_BUILD_ISOLATION below). The torch version, its CUDA version and its C++ ABI go into
python/safeattn/_build_config.py next to _C; `import safeattn` compares them with the running
torch before it loads _C.
"""

import importlib.util
import os
import platform
import re
import sys
from pathlib import Path

import setuptools
from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
SETUPTOOLS_MAJOR = int(setuptools.__version__.split(".")[0])

NO_BUILD_ISOLATION = """
safeattn is compiled against the torch installed in your environment, so pip must build it
with build isolation off, in that environment:

    pip install --no-build-isolation safeattn        # from PyPI
    pip install --no-build-isolation .               # from a source tree (-e for editable)
    python -m build --no-isolation                   # building a wheel with pypa/build

With isolation on (pip's default), the build runs in a fresh environment that has no torch;
had it downloaded one, the extension would fit that torch, not yours, and fail to import.
Install torch (>= 2.6), setuptools and ninja first.
"""


def require_build_environment():
    """Fails in seconds, with the command to use, where the build cannot fit the user's torch."""
    if SETUPTOOLS_MAJOR < 64:  # pyproject.toml metadata, editable installs
        raise SystemExit(
            f"safeattn needs setuptools >= 64 to build (found {setuptools.__version__}): "
            "pip install -U setuptools"
        )
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit(
            f"error: torch is not importable where safeattn is being built.{NO_BUILD_ISOLATION}"
        ) from None


require_build_environment()

# torch.utils.cpp_extension reads CUDA_HOME at import; a bare `nvcc` on PATH in /usr/local/bin
# would make it guess /usr/local, which has no CUDA libraries.
if (
    "CUDA_HOME" not in os.environ
    and "CUDA_PATH" not in os.environ
    and Path("/usr/local/cuda/bin/nvcc").exists()
):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "python/safeattn/_version.py").read_text()).group(1)

# CPU ISA variants and their compiler flags. at::vec keys on CPU_CAPABILITY / CPU_CAPABILITY_<X>.
X86_ISAS = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}


def cpu_isas():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {"DEFAULT": []}  # aarch64: the default build is NEON
    wanted = os.environ.get("SAFEATTN_CPU_ISAS")
    if not wanted:
        return X86_ISAS
    names = [n for n in re.split(r"[;, ]+", wanted) if n]
    unknown = set(names) - set(X86_ISAS)
    if unknown or "DEFAULT" not in names:
        raise SystemExit(f"SAFEATTN_CPU_ISAS must list DEFAULT and only {sorted(X86_ISAS)}; got {wanted!r}")
    return {n: X86_ISAS[n] for n in names}


def want_cuda():
    mode = os.environ.get("SAFEATTN_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"SAFEATTN_CUDA must be auto, 0 or 1; got {mode!r}")
    available = (
        torch.version.cuda is not None and CUDA_HOME is not None and (Path(CUDA_HOME) / "bin/nvcc").exists()
    )
    if mode == "1" and not available:
        raise SystemExit("SAFEATTN_CUDA=1 but nvcc or a CUDA build of torch is missing")
    return available if mode == "auto" else mode == "1"


# The targets when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible (build hosts, CI, wheels):
# Ampere (8.0 A100, 8.6 RTX 30 / A10 / A40), Ada (8.9 L4, L40S, RTX 40), Hopper (9.0, with the
# sm_90a kernels), Blackwell (10.0 B200, 12.0 RTX 50 / RTX PRO), and PTX of the newest, which the
# driver compiles for any later GPU. The Blackwell entries need nvcc >= 12.8 and are dropped,
# with a note, before that.
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0;10.0;12.0+PTX"
# PyTorch's named architectures (torch.utils.cpp_extension), for TORCH_CUDA_ARCH_LIST="Ampere;Hopper".
NAMED_CUDA_ARCHS = {
    "Ampere": "8.0;8.6+PTX",
    "Ada": "8.9+PTX",
    "Hopper": "9.0+PTX",
    "Blackwell": "10.0;12.0+PTX",
}


def nvcc_archs():
    """The virtual architectures this nvcc compiles for, e.g. {"80", "90", "120"}."""
    out = os.popen(f'"{Path(CUDA_HOME) / "bin" / "nvcc"}" --list-gpu-arch').read()
    return set(re.findall(r"compute_(\d+)", out))


def parse_arch_list(setting, source):
    """TORCH_CUDA_ARCH_LIST's syntax -> [(sm, ptx)], sm like "86" or "90a": entries split on ';',
    ' ' or ',', each "X.Y" (machine code), "X.Y+PTX" (and PTX), "X.Ya" / "X.Yf" (the arch- or
    family-specific targets), or a name of NAMED_CUDA_ARCHS."""
    targets = []
    for entry in [e for e in re.split(r"[;, ]+", setting.strip()) if e]:
        if entry in NAMED_CUDA_ARCHS:
            targets += parse_arch_list(NAMED_CUDA_ARCHS[entry], source)
            continue
        m = re.fullmatch(r"(\d+)\.(\d)([af]?)(\+PTX)?", entry)
        if not m:
            raise SystemExit(
                f"{source}: {entry!r} is not a CUDA architecture; use PyTorch's syntax, e.g. "
                f'{source}="8.0;8.6;9.0+PTX" (or a name: {", ".join(NAMED_CUDA_ARCHS)})'
            )
        major, minor, suffix, ptx = m.groups()
        targets.append((f"{major}{minor}{suffix}", bool(ptx)))
    if not targets:
        raise SystemExit(f"{source} is empty; unset it for the default ({DEFAULT_CUDA_ARCHS})")
    return targets


def visible_gpu_archs():
    """The compute capabilities of the GPUs visible now, in TORCH_CUDA_ARCH_LIST syntax, or None."""
    try:
        count = torch.cuda.device_count()
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(count)})
    except Exception:  # no driver: a build host
        return None
    return ";".join(f"{major}.{minor}" for major, minor in caps) or None


def cuda_targets():
    """What nvcc compiles the generic CUDA kernels for, {sm: with_ptx}, where that choice came
    from, and whether the Hopper kernels are wanted (a 9.x target and SAFEATTN_SM90 not 0).

    PyTorch's convention decides: TORCH_CUDA_ARCH_LIST when set (as torch.utils.cpp_extension,
    flash-attn and xformers read it); else the GPUs visible at build time; else
    DEFAULT_CUDA_ARCHS. A "9.0a" entry counts as 9.0: the generic kernels run on every sm_90 part
    from plain sm_90 code, and the Hopper kernels always get their own sm_90a target."""
    legacy = os.environ.get("SAFEATTN_CUDA_ARCHS")
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        setting, source = os.environ["TORCH_CUDA_ARCH_LIST"], "TORCH_CUDA_ARCH_LIST"
    elif legacy:
        print("safeattn: SAFEATTN_CUDA_ARCHS is deprecated; use TORCH_CUDA_ARCH_LIST (e.g. '8.0;9.0')")
        setting = ";".join(f"{a[:-1]}.{a[-1:]}" for a in re.split(r"[;, ]+", legacy.replace("a", "")) if a)
        source = "SAFEATTN_CUDA_ARCHS"
    else:
        visible = visible_gpu_archs()
        setting, source = (
            (visible, "the visible GPUs") if visible else (DEFAULT_CUDA_ARCHS, "the default list")
        )
    known = nvcc_archs()
    targets = {}
    for sm, ptx in parse_arch_list(setting, "TORCH_CUDA_ARCH_LIST" if source.startswith("the") else source):
        base = sm.rstrip("af")
        if known and base not in known:
            if not source.startswith("the"):
                raise SystemExit(
                    f"{source}: this nvcc cannot compile for sm_{sm} (it knows {sorted(known, key=int)})"
                )
            print(f"safeattn: this nvcc cannot compile for sm_{sm}; left out of {source}")
            continue
        sm = "90" if base == "90" else sm
        targets[sm] = targets.get(sm, False) or ptx
    if not targets:
        raise SystemExit(f"safeattn: no CUDA target left from {source} ({setting!r})")
    sm90 = os.environ.get("SAFEATTN_SM90", "1")
    if sm90 not in ("0", "1"):
        raise SystemExit(f"SAFEATTN_SM90 must be 0 or 1; got {sm90!r}")
    return targets, source, sm90 == "1" and any(sm.startswith("9") for sm in targets)


def nvcc_threads_flags(n_targets):
    """NVCC_THREADS: how many of a file's targets nvcc compiles at once. With few files and many
    targets (the wheel's six) the build's longest file is otherwise six compiles in a row."""
    setting = os.environ.get("NVCC_THREADS", "1")
    if not setting.isdigit() or int(setting) < 1:
        raise SystemExit(f"NVCC_THREADS must be a whole number of at least 1; got {setting!r}")
    threads = min(int(setting), n_targets)
    return [f"--threads={threads}"] if threads > 1 else []


def gencode_flags(targets):
    flags = []
    for sm, ptx in targets.items():
        flags.append(f"-gencode=arch=compute_{sm},code=sm_{sm}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{sm},code=compute_{sm}")
    return flags


NO_CUTLASS = """
safeattn's fast attention kernels for H100 / H200 (sm_90a, built on CUTLASS's CuTe) need the
CUTLASS headers, and this build targets 9.0 ({source}) but found none. Install the pinned
package and build again:

    pip install nvidia-cutlass==4.2.0.0
    pip install --no-build-isolation safeattn            # in a clone: ... -e .

or point SAFEATTN_CUTLASS_INCLUDE at a CUTLASS checkout's include/ folder. To build without them
on purpose (attention on H100 / H200 then runs the generic kernels, about 2.5x slower), set
SAFEATTN_SM90=0; to build for other GPUs only, set TORCH_CUDA_ARCH_LIST (e.g. "8.0;8.6;8.9").
"""


def cutlass_include():
    """The CUTLASS / CuTe include dir, or None: SAFEATTN_CUTLASS_INCLUDE, else the installed
    nvidia-cutlass package's (found without importing it)."""
    path = os.environ.get("SAFEATTN_CUTLASS_INCLUDE")
    if not path:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(spec.submodule_search_locations[0]) / "source" / "include"
    return str(path) if (Path(path) / "cute" / "tensor.hpp").exists() else None


def op_filter(paths):
    ops = [o for o in re.split(r"[;, ]+", os.environ.get("SAFEATTN_OPS", "")) if o]
    if not ops:
        return paths
    return [p for p in paths if any(Path(p).name.startswith(o + "_") or Path(p).stem == o for o in ops)]


# Generated instantiations exist for head dims 32, 64, 80, 96, 128 and 256 (forward), 32, 64,
# 96, 128 (backward), 64, 96, 128, 256 (sm_90a forward) and 64, 96, 128, 256 (sm_90a backward).
# The default builds the common head dims (96: Phi-3; 256: Gemma, whose backward has only the
# sm_90a kernel: other GPUs run it on the generic path) with tensor-core kernels; the others take
# the generic CUDA kernels unless SAFEATTN_ATTN_HEAD_DIMS=all (more compile time). 256 costs
# about 270 s of compile (2 cores: 57 s per sm_90a file, 19 s per mma.sync one).
DEFAULT_ATTN_HEAD_DIMS = "64,96,128,256"


def head_dim_filter(paths):
    """Keeps the attention instantiations (attention_<dir>_d<D>_<dtype>.cu) of the chosen head
    dims; returns the kept paths and, per direction, the dims kept, which the dispatch code sees
    as SAFEATTN_ATTN_FWD_D<D> / SAFEATTN_ATTN_BWD_D<D> macros and build_info() as lists (a dim
    without its files takes the generic path)."""
    pattern = re.compile(r"attention_(fwd|bwd|fwd_sm90|bwd_sm90)_d(\d+)_\w+\.cu")
    setting = os.environ.get("SAFEATTN_ATTN_HEAD_DIMS", DEFAULT_ATTN_HEAD_DIMS)
    wanted = [] if setting == "all" else [d for d in re.split(r"[;, ]+", setting) if d]
    kept, dims = [], {"fwd": set(), "bwd": set(), "fwd_sm90": set(), "bwd_sm90": set()}
    for p in paths:
        m = pattern.fullmatch(Path(p).name)
        if m and wanted and m.group(2) not in wanted:
            continue
        if m:
            dims[m.group(1)].add(int(m.group(2)))
        kept.append(p)
    return kept, {direction: sorted(d) for direction, d in dims.items()}


def head_dim_macros(dims):
    flags = []
    for direction, kept in dims.items():
        flags += [f"-DSAFEATTN_ATTN_{direction.upper()}_D{d}" for d in kept]
        # For build_info(): bit d / 16 per head dim (nvcc would split a comma-separated list).
        flags.append(f"-DSAFEATTN_ATTN_{direction.upper()}_DIM_BITS={sum(1 << (d // 16) for d in kept)}")
    return flags


def rel(paths):
    return sorted(str(p.relative_to(ROOT)) for p in paths)


def default_jobs():
    # Each C++ TU that includes torch headers peaks at roughly 1.5 GB.
    cores = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 8
    return str(max(1, min(cores, int(mem_gb // 1.5))))


os.environ.setdefault("MAX_JOBS", default_jobs())

WITH_CUDA = want_cuda()
ISAS = cpu_isas()
CUDA_TARGETS, CUDA_TARGETS_FROM, WANT_SM90 = cuda_targets() if WITH_CUDA else ({}, None, False)

common_sources = rel([p for d in ("csrc", "csrc/common", "csrc/ops") for p in (ROOT / d).glob("*.cpp")])
isa_sources = op_filter(rel((ROOT / "csrc/ops/cpu").glob("*_kernel.cpp")))
# The Hopper kernels (wgmma, setmaxnreg) need the sm_90a target and CUTLASS; they are compiled
# on their own (Build below) so that every other .cu file, their host code in hopper/ included,
# keeps the generic targets.
CUDA_DIRS = (
    "csrc/ops/cuda",
    "csrc/ops/cuda/generic",
    "csrc/ops/cuda/generic/instances",
    "csrc/ops/cuda/hopper",
)
HOPPER_KERNEL_DIR = "csrc/ops/cuda/hopper/instances"
hopper_sources = op_filter(rel((ROOT / HOPPER_KERNEL_DIR).glob("*.cu"))) if WANT_SM90 else []
cuda_sources, ATTN_HEAD_DIMS = head_dim_filter(
    rel((ROOT / "csrc/common").glob("*.cu"))
    + op_filter(rel(p for d in CUDA_DIRS for p in (ROOT / d).glob("*.cu")))
    + hopper_sources
)
CUTLASS_INCLUDE = cutlass_include() if any(p in hopper_sources for p in cuda_sources) else None
if CUTLASS_INCLUDE is None and any(p in hopper_sources for p in cuda_sources):
    raise SystemExit(NO_CUTLASS.format(source=CUDA_TARGETS_FROM))
hopper_sources = [p for p in cuda_sources if p in hopper_sources]
cuda_sources = [p for p in cuda_sources if p not in hopper_sources]
if WITH_CUDA:
    shown = ", ".join(f"sm_{sm}" + (" + PTX" if ptx else "") for sm, ptx in CUDA_TARGETS.items())
    hopper = " and sm_90a (Hopper kernels)" if hopper_sources else ""
    print(f"safeattn: CUDA targets {shown}{hopper}, from {CUDA_TARGETS_FROM}")

defines = [
    f'-DSAFEATTN_VERSION="{VERSION}"',
    "-DSAFEATTN_PYTHON_MODULE",
]
# -fopenmp at compile time only: ATen's at::parallel_for is an OpenMP region in its headers, so
# without it every CPU kernel runs on one thread. Not at link time: the GOMP_* calls then bind to
# the libgomp that libtorch_cpu already loaded (torch's own copy, so torch.set_num_threads holds),
# never to a second OpenMP runtime.
# -g0 last: Python's own CFLAGS, which come first, carry -g, and debug info is most of the size
# of a release _C. SAFEATTN_DEBUG_INFO=1 keeps it.
debug_flags = ["-g"] if os.environ.get("SAFEATTN_DEBUG_INFO") == "1" else ["-g0"]
cxx_flags = ["-O3", *(["-fopenmp"] if sys.platform.startswith("linux") else []), *defines, *debug_flags]
if WITH_CUDA:
    cxx_flags.append("-DSAFEATTN_WITH_CUDA")
nvcc_flags = [
    "-O3",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    *defines,
    "-DSAFEATTN_WITH_CUDA",
    # What torch's own extension builds add in some versions (2.11 does, 2.14 does not): set
    # always, so code that relies on implicit half / bfloat16 conversions fails in CI too.
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    *head_dim_macros(ATTN_HEAD_DIMS),
    *(["-DSAFEATTN_WITH_SM90"] if hopper_sources else []),
    # The newest PTX target (0: none), for the message of a GPU the build has no code for.
    f"-DSAFEATTN_CUDA_PTX_ARCH={max((int(sm.rstrip('af')) for sm, ptx in CUDA_TARGETS.items() if ptx), default=0)}",
    *gencode_flags(CUDA_TARGETS),
    *nvcc_threads_flags(len(CUDA_TARGETS)),
]


def link_args():
    """Linux with a C++11-ABI torch (PyPI's since 2.7): a private, hidden copy of libstdc++. Those
    torch builds export some libstdc++ symbols of their own (pytorch #133437), and on some hosts
    (seen: Ubuntu 24.04, g++ 13, torch 2.11) the extension bound iostream facet templates to
    those uninitialised copies and crashed the first time it formatted an error message.

    A pre-C++11-ABI torch (PyPI's 2.6): the system libstdc++. Its std::string is copy-on-write
    and every empty string shares one static representation in libstdc++; with a second copy in
    the extension, a string made by torch and freed here (or the reverse) is not recognised as
    that empty one, and free() aborts the interpreter on import.

    Elsewhere (macOS): nothing; libc++ is the system's and Apple's linker has no --exclude-libs."""
    if sys.platform.startswith("linux") and torch._C._GLIBCXX_USE_CXX11_ABI:
        return ["-static-libstdc++", "-Wl,--exclude-libs,ALL", *glibc_compat_wraps()]
    return glibc_compat_wraps()


def glibc_compat_wraps():
    """x86_64 Linux with glibc: -Wl,--wrap=NAME for each __wrap_NAME that
    csrc/common/glibc_compat.cpp defines (the one list of them), so that _C imports none of those
    glibc symbols newer than 2.28 (manylinux_2_28); tests/test_build_check.py names any other that a
    build host brings. Elsewhere nothing."""
    if not (
        sys.platform.startswith("linux")
        and platform.machine() == "x86_64"
        and platform.libc_ver()[0] == "glibc"
    ):
        return []
    source = (ROOT / "csrc" / "common" / "glibc_compat.cpp").read_text()
    names = sorted(set(re.findall(r"\b__wrap_(\w+)\s*(?:\(|=)", source)))
    return ["-Wl," + ",".join(f"--wrap={name}" for name in names)] if names else []


def build_env():
    """The build switches that were set, so that a rebuild command can repeat them."""
    names = (
        "SAFEATTN_CUDA",
        "TORCH_CUDA_ARCH_LIST",
        "SAFEATTN_CUDA_ARCHS",
        "SAFEATTN_SM90",
        "SAFEATTN_CPU_ISAS",
        "SAFEATTN_OPS",
        "SAFEATTN_ATTN_HEAD_DIMS",
    )
    return {name: os.environ[name] for name in names if name in os.environ}


def build_config():
    """python/safeattn/_build_config.py: what _C is compiled against, readable without loading _C."""
    values = {
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "with_cuda": WITH_CUDA,
        # "86", "120+PTX": the generic kernels' targets; sm90a: the Hopper kernels were built.
        "cuda_targets": [sm + ("+PTX" if ptx else "") for sm, ptx in CUDA_TARGETS.items()],
        "sm90a": bool(hopper_sources),
        "build_env": build_env(),
    }
    lines = [
        "# Generated by setup.py when safeattn._C was built: the torch it was compiled against.",
        "# `import safeattn` compares these with the running torch before it loads _C.",
    ]
    return "\n".join(lines + [f"{name} = {value!r}" for name, value in values.items()]) + "\n"


class Build(BuildExtension):
    """Compiles each CPU kernel once per ISA with its own flags, then links everything; writes
    _build_config.py next to _C (in the source tree for in-place and editable builds)."""

    def finalize_options(self):
        super().finalize_options()
        # SAFEATTN_BUILD_TEMP: the object files' directory. An editable install otherwise gets a
        # fresh temporary one from setuptools at every build; scripts/env.sh puts it in the tree,
        # so that ccache sees the same paths relative to it from every clone.
        if os.environ.get("SAFEATTN_BUILD_TEMP"):
            self.build_temp = os.environ["SAFEATTN_BUILD_TEMP"]

    def run(self):
        super().run()
        # setuptools builds into build_lib, then copies _C to the source tree when in place; by
        # now self.inplace is restored, so the path below is where _C ended up.
        target = Path(self.get_ext_fullpath("safeattn._C")).parent / "_build_config.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(build_config())

    def build_extension(self, ext):
        # BuildExtension has added its own defines to ext.extra_compile_args by now.
        base = (
            ext.extra_compile_args["cxx"]
            if isinstance(ext.extra_compile_args, dict)
            else ext.extra_compile_args
        )
        objects = []
        for isa, flags in ISAS.items():
            objects += self.compiler.compile(
                isa_sources,
                output_dir=os.path.join(self.build_temp, "isa", isa),
                macros=[("CPU_CAPABILITY", isa), (f"CPU_CAPABILITY_{isa}", None)],
                include_dirs=ext.include_dirs,
                extra_postargs={"cxx": base + flags},
                depends=ext.depends,
            )
        if hopper_sources:
            nvcc = [f for f in ext.extra_compile_args["nvcc"] if not f.startswith("-gencode")]
            objects += self.compiler.compile(
                hopper_sources,
                output_dir=os.path.join(self.build_temp, "sm90a"),
                include_dirs=ext.include_dirs + [CUTLASS_INCLUDE],
                extra_postargs={"cxx": base, "nvcc": nvcc + ["-gencode=arch=compute_90a,code=sm_90a"]},
                depends=ext.depends,
            )
        ext.extra_objects = objects
        super().build_extension(ext)


def cuda_library_includes():
    # pip's CUDA builds of torch ship cuBLAS/cuSPARSE headers (which ATen/cuda/CUDAContext.h
    # includes) in nvidia/*/include rather than in the toolkit; a bare nvcc install lacks them.
    site = Path(torch.__file__).parent.parent / "nvidia"
    return sorted(str(p) for p in site.glob("*/include") if (p / "cusparse.h").exists())


# Header search path of every C++ and CUDA source.
include_dirs = [str(ROOT / "csrc")]
if WITH_CUDA:
    include_dirs += cuda_library_includes()

Extension = CUDAExtension if WITH_CUDA else CppExtension
ext = Extension(
    "safeattn._C",
    sources=common_sources + (cuda_sources if WITH_CUDA else []),
    include_dirs=include_dirs,
    depends=rel((ROOT / "csrc").rglob("*.h")),
    extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags} if WITH_CUDA else {"cxx": cxx_flags},
    extra_link_args=link_args(),
)

# The metadata (name, dependencies, extras) is in pyproject.toml; the version is read from
# python/safeattn/_version.py here and by CMakeLists.txt. The license as an SPDX expression
# (PEP 639) where setuptools knows it, else in the older field: with --no-build-isolation the
# build uses whatever setuptools the environment has.
LICENSE = {"license_expression": "BSD-3-Clause"} if SETUPTOOLS_MAJOR >= 77 else {"license": "BSD-3-Clause"}


def package_version():
    """_version.py's release, plus the local part that SAFEATTN_LOCAL_VERSION asks for: a binary
    wheel works only with the torch it was built against, so its version names that torch the way
    flash-attn's release wheels do (scripts/build_wheel.sh). "auto": cu130torch2.14.1cxx11abiTRUE
    (cpu... without CUDA kernels); the full torch release, since `import safeattn` refuses another
    patch release. safeattn.__version__ stays the release; pip normalises the part to lower case."""
    local = os.environ.get("SAFEATTN_LOCAL_VERSION", "")
    if local == "auto":
        variant = f"cu{torch.version.cuda.replace('.', '')}" if WITH_CUDA else "cpu"
        abi = "TRUE" if torch._C._GLIBCXX_USE_CXX11_ABI else "FALSE"
        local = f"{variant}torch{str(torch.__version__).split('+')[0]}cxx11abi{abi}"
    if local and not re.fullmatch(r"[A-Za-z0-9]+(\.[A-Za-z0-9]+)*", local):
        raise SystemExit(f"SAFEATTN_LOCAL_VERSION must be auto or a PEP 440 local label; got {local!r}")
    return f"{VERSION}+{local}" if local else VERSION


setup(
    version=package_version(),
    **LICENSE,
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[ext],
    cmdclass={"build_ext": Build},
)
