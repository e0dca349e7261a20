"""What a CUDA build targets (setup.py, PyTorch's TORCH_CUDA_ARCH_LIST convention), that a build
for sm_90 never loses the Hopper kernels silently, and that a GPU the build has no code for gets a
clear error. The setup.py cases run `setup.py --version` (no compilation): they need the source
tree, nvcc and a CUDA build of torch, as CI has."""

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import safeattn
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
NEEDS_NVCC = pytest.mark.skipif(
    not (ROOT / "setup.py").is_file()
    or torch.version.cuda is None
    or not Path(CUDA_HOME, "bin/nvcc").exists(),
    reason="needs the source tree, nvcc and a CUDA build of torch",
)


@functools.cache
def stand_in_cutlass_include():
    """A folder that passes setup.py's test for the CUTLASS headers (cute/tensor.hpp present):
    `--version` compiles nothing, so the target cases hold whether or not nvidia-cutlass is
    installed (a GPU machine with a carried build may lack it); the cases about a missing CUTLASS
    pass their own SAFEATTN_CUTLASS_INCLUDE."""
    root = Path(tempfile.mkdtemp(prefix="safeattn-cutlass-"))
    atexit.register(shutil.rmtree, root, True)
    (root / "cute").mkdir()
    (root / "cute" / "tensor.hpp").write_text("// stand-in: setup.py --version reads no header\n")
    return str(root)


def run_setup(**env):
    """`setup.py --version` with these variables (None: unset); its output and exit code."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SAFEATTN_", "TORCH_CUDA_ARCH_LIST"))}
    full.update({"CUDA_HOME": CUDA_HOME, "SAFEATTN_CUDA": "1", "CUDA_VISIBLE_DEVICES": ""})
    full["SAFEATTN_CUTLASS_INCLUDE"] = stand_in_cutlass_include()
    full.update({k: v for k, v in env.items() if v is not None})
    done = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout + done.stderr, done.returncode


def targets_line(output):
    lines = [line for line in output.splitlines() if line.startswith("safeattn: CUDA targets")]
    assert len(lines) == 1, output
    return lines[0]


@NEEDS_NVCC
@pytest.mark.parametrize(
    "setting, expected",
    [
        (
            "8.0;8.6;9.0+PTX",
            "sm_80, sm_86, sm_90 + PTX and sm_90a (Hopper kernels), from TORCH_CUDA_ARCH_LIST",
        ),
        ("8.0 8.9", "sm_80, sm_89, from TORCH_CUDA_ARCH_LIST"),
        ("9.0a", "sm_90 and sm_90a (Hopper kernels), from TORCH_CUDA_ARCH_LIST"),
        ("Ampere", "sm_80, sm_86 + PTX, from TORCH_CUDA_ARCH_LIST"),
        ("12.0+PTX", "sm_120 + PTX, from TORCH_CUDA_ARCH_LIST"),
    ],
)
def test_torch_cuda_arch_list_chooses_the_targets(setting, expected):
    output, code = run_setup(TORCH_CUDA_ARCH_LIST=setting)
    assert code == 0, output
    assert targets_line(output) == f"safeattn: CUDA targets {expected}", output


@NEEDS_NVCC
@pytest.mark.parametrize("arch_list", [None, ""])
def test_default_targets_without_a_visible_gpu_span_ampere_to_blackwell(arch_list):
    """Unset or empty (how scripts/gpu_check.sh's wheel stage clears a host's own setting)."""
    output, code = run_setup(TORCH_CUDA_ARCH_LIST=arch_list)
    assert code == 0, output
    line = targets_line(output)
    for target in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120 + PTX"):
        assert target in line, f"{target} missing from the default targets: {line}"
    assert line.endswith("from the default list"), line


@NEEDS_NVCC
@pytest.mark.parametrize("threads", ["0", "four", "-2"])
def test_nvcc_threads_must_be_a_count(threads):
    output, code = run_setup(TORCH_CUDA_ARCH_LIST="8.0", NVCC_THREADS=threads)
    assert code != 0, output
    assert "NVCC_THREADS" in output and repr(threads) in output, output


@NEEDS_NVCC
def test_the_deprecated_alias_still_works():
    output, code = run_setup(SAFEATTN_CUDA_ARCHS="80;90")
    assert code == 0, output
    assert "SAFEATTN_CUDA_ARCHS is deprecated" in output
    assert targets_line(output).startswith("safeattn: CUDA targets sm_80, sm_90 and sm_90a"), output


@NEEDS_NVCC
@pytest.mark.parametrize("setting", ["8.0;sm_90", "9", "8.0+ptx", ";"])
def test_a_malformed_arch_list_names_the_variable(setting):
    output, code = run_setup(TORCH_CUDA_ARCH_LIST=setting)
    assert code != 0, output
    assert "TORCH_CUDA_ARCH_LIST" in output, output


@NEEDS_NVCC
def test_an_sm90_build_without_cutlass_stops_with_the_install_command():
    output, code = run_setup(TORCH_CUDA_ARCH_LIST="9.0", SAFEATTN_CUTLASS_INCLUDE="/nonexistent")
    assert code != 0, output
    assert "pip install nvidia-cutlass==" in output and "SAFEATTN_SM90=0" in output, output


@NEEDS_NVCC
def test_sm90_zero_opts_out_of_the_hopper_kernels():
    output, code = run_setup(
        TORCH_CUDA_ARCH_LIST="9.0", SAFEATTN_CUTLASS_INCLUDE="/nonexistent", SAFEATTN_SM90="0"
    )
    assert code == 0, output
    assert targets_line(output) == "safeattn: CUDA targets sm_90, from TORCH_CUDA_ARCH_LIST", output


@NEEDS_NVCC
def test_other_gpus_need_no_cutlass():
    output, code = run_setup(TORCH_CUDA_ARCH_LIST="8.0;8.6", SAFEATTN_CUTLASS_INCLUDE="/nonexistent")
    assert code == 0, output


@pytest.mark.skipif(
    not (torch.cuda.is_available() and safeattn.build_info()["with_cuda"]),
    reason="needs a CUDA GPU and build",
)
def test_a_gpu_without_code_gets_a_clear_error():
    """On a GPU the build covers, the ops run; on one it does not (the GPU host runs this with a
    build for another arch), the first op raises an error that names the GPU, its compute
    capability, the archs built and the rebuild command, instead of "no kernel image"."""
    major, minor = torch.cuda.get_device_capability()
    x = torch.randn(4, 8, device="cuda")
    try:
        safeattn._C._check_device_supported(torch.cuda.current_device())
    except RuntimeError:
        covered = False
    else:
        covered = True
    if covered:
        torch.testing.assert_close(safeattn.safe_softmax(x, -1), torch.softmax(x, -1))
        assert "covered" in safeattn.gpu_coverage() and "not covered" not in safeattn.gpu_coverage()
        return
    with pytest.raises(RuntimeError) as raised:
        safeattn.safe_softmax(x, -1)
    message = str(raised.value)
    for part in (
        torch.cuda.get_device_name(),
        f"compute capability {major}.{minor}",
        "this build holds",
        f'TORCH_CUDA_ARCH_LIST="{major}.{minor}"',
    ):
        assert part in message, f"{part!r} missing from: {message}"
    assert "not covered" in safeattn.gpu_coverage()


# Shared memory (bytes) a block may opt into and an SM has, per compute capability (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability"); every block reserves 1 KB.
KB = 1024
GPU_SMEM = {
    "8.0 (A100)": (163 * KB, 164 * KB),
    "8.6 (A10, RTX 30)": (99 * KB, 100 * KB),
    "8.7 (Jetson Orin)": (163 * KB, 164 * KB),
    "8.9 (L4, L40S, RTX 40)": (99 * KB, 100 * KB),
    "9.0 (H100, H200)": (227 * KB, 228 * KB),
    "10.0 (B200)": (227 * KB, 228 * KB),
    "12.0 (RTX 50)": (99 * KB, 100 * KB),
}
# The GPUs with 164 KB or more an SM: they hold two CTAs of the large shapes.
LARGE_SMEM_GPUS = {"8.0 (A100)", "8.7 (Jetson Orin)", "9.0 (H100, H200)", "10.0 (B200)"}
NEEDS_GENERIC = pytest.mark.skipif(
    not hasattr(safeattn._C, "_generic_tile_shapes"), reason="a build without CUDA kernels"
)


@NEEDS_GENERIC
@pytest.mark.parametrize("gpu", sorted(GPU_SMEM))
def test_generic_tile_shapes_fit_every_gpu(gpu):
    """On every GPU generation the generic kernels serve, each compiled head dim's tile shapes fit
    its shared memory wherever the kernel runs there (or the call is left to the ATen path, as
    smem_fits decides with the small shape), and a large shape is taken only where an SM holds
    two of its CTAs, as it was measured."""
    from safeattn import _testing

    per_block, per_sm = GPU_SMEM[gpu]
    info = safeattn.build_info()
    small_fwd = {d: _testing.generic_tile_shapes(d, 0, 0, 0) for d in info["attention_fwd_head_dims"]}
    for d in info["attention_fwd_head_dims"]:
        tiles = _testing.generic_tile_shapes(d, per_block, per_sm, KB)
        assert tiles.fwd_block_q > 0 and tiles.fwd_block_kv > 0, (gpu, d, tiles)
        if small_fwd[d].fwd_smem > per_block:
            continue  # the forward leaves this head dim to the ATen path here
        assert tiles.fwd_smem <= per_block, (gpu, d, tiles)
        if tiles.fwd_large:
            assert 2 * (tiles.fwd_smem + KB) <= per_sm, (gpu, d, tiles)
            assert tiles.fwd_smem > small_fwd[d].fwd_smem, (gpu, d, tiles)
    for d in info["attention_bwd_head_dims"]:
        tiles = _testing.generic_tile_shapes(d, per_block, per_sm, KB)
        small = _testing.generic_tile_shapes(d, 0, 0, 0)
        assert tiles.bwd_block_q > 0 and tiles.bwd_block_kv > 0, (gpu, d, tiles)
        if small.bwd_smem > per_block:
            continue  # the backward leaves this head dim to the ATen path here (D=96 on 8.6 / 8.9)
        assert tiles.bwd_smem <= per_block, (gpu, d, tiles)


@NEEDS_GENERIC
@pytest.mark.parametrize("gpu", sorted(GPU_SMEM))
def test_generic_large_shapes_where_measured(gpu):
    """D=64's forward takes its 128 x 128 tiles (80 KB) on the GPUs with 164 KB or more an SM
    (A100, H100, B200) and keeps its 32 KB 64-key tiles on those with 100 KB (RTX 30/40/50, L4,
    L40S: one 80 KB CTA an SM would halve their occupancy); the dK/dV kernel takes
    FlashAttention-2's 128-key layouts where a block may have more than 99 KB."""
    from safeattn import _testing

    info = safeattn.build_info()
    per_block, per_sm = GPU_SMEM[gpu]
    large = gpu in LARGE_SMEM_GPUS
    if 64 in info["attention_fwd_head_dims"]:
        tiles = _testing.generic_tile_shapes(64, per_block, per_sm, KB)
        assert tiles.fwd_large == large, tiles
        assert (tiles.fwd_block_q, tiles.fwd_block_kv) == ((128, 128) if large else (128, 64)), tiles
    for d in (64, 128):
        if d in info["attention_bwd_head_dims"]:
            tiles = _testing.generic_tile_shapes(d, per_block, per_sm, KB)
            assert tiles.bwd_large == large, (d, tiles)
            assert tiles.bwd_block_kv == (128 if large else (128 if d == 64 else 64)), (d, tiles)


# The decode wave shapes (attention_decode.cuh, DecodeWaveShape): (head dim, CTAs an SM) -> the
# shared memory of one CTA in KB. A step takes the shape of the fewest CTAs an SM whose wave
# (SMs x CTAs an SM) its (batch, kv head) pairs fill half of to all of, over at most 4096 keys,
# where that many CTAs fit a block's limit; else the default shape (0).
# (head dim, CTAs an SM) -> (KB of one CTA, whether a paged cache of pages shorter than a key tile
# takes it; pages of whole tiles take every shape).
DECODE_WAVE_SHAPES = {(128, 1): (142, False), (64, 1): (187, False), (64, 2): (113, True)}


def expected_wave_ctas(head_dim, keys, pairs, sms, per_block, row_pages):
    for ctas in (1, 2):
        kb, pages = DECODE_WAVE_SHAPES.get((head_dim, ctas), (0, False))
        wave = sms * ctas
        fits = kb and ctas * kb * KB <= per_block and (pages or not row_pages)
        if fits and 2 * pairs >= wave and pairs <= wave and keys <= 4096:
            return ctas
    return 0


@NEEDS_GENERIC
@pytest.mark.parametrize("gpu", sorted(GPU_SMEM))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_decode_wave_shape_where_measured_and_it_fits(gpu, head_dim):
    """The decode kernel's wave shapes are taken where they were measured faster on an H200 and
    only on GPUs whose blocks may take their shared memory: D=128's one CTA of 142 KB never on the
    99 KB GPUs (RTX 30/40/50, L4, L40S), whose launch of it would fail; D=64's one CTA of 187 KB
    and two of 113 KB an SM only on the 227 KB ones (H100/H200, B200); the one-CTA shapes never
    over pages shorter than a key tile (their per-key page fetches ran slower there)."""
    from safeattn import _testing

    per_block, _ = GPU_SMEM[gpu]
    for sms in (108, 132, 148):  # A100, H100/H200, B200
        for pairs in sorted(
            {1, sms // 3, sms // 2 - 1, sms // 2, sms - 1, sms, sms + 1, 3 * sms // 2, 2 * sms, 2 * sms + 1}
        ):
            for keys, row_pages in ((1024, False), (1024, True), (4096, False), (4097, False)):
                want = expected_wave_ctas(head_dim, keys, pairs, sms, per_block, row_pages)
                got = _testing.decode_wave_ctas(head_dim, keys, pairs, 1, sms, per_block, row_pages)
                assert got == want, (gpu, sms, pairs, keys, row_pages)
    big = gpu in {"9.0 (H100, H200)", "10.0 (B200)"}
    # As measured on the H200 (132 SMs): B32 x 4 kv heads (128 pairs), B32 x 8 (256), B8 x 8 (64).
    if head_dim == 64:
        assert _testing.decode_wave_ctas(64, 1024, 32, 4, 132, per_block) == (1 if big else 0)
        assert _testing.decode_wave_ctas(64, 1024, 32, 4, 132, per_block, row_pages=True) == 0
        assert _testing.decode_wave_ctas(64, 1024, 32, 8, 132, per_block) == (2 if big else 0)
    if head_dim == 128:
        fits = gpu in LARGE_SMEM_GPUS
        assert _testing.decode_wave_ctas(128, 1024, 32, 4, 132, per_block) == (1 if fits else 0)
        assert _testing.decode_wave_ctas(128, 1024, 32, 4, 132, per_block, row_pages=True) == 0
        assert _testing.decode_wave_ctas(128, 1024, 32, 8, 132, per_block) == 0
    assert _testing.decode_wave_ctas(head_dim, 1024, 8, 8, 132, per_block) == 0
