import os
import re
from pathlib import Path

import pytest
import safeattn  # noqa: F401  registers torch.ops.safeattn.*
import torch

# The device parametrisations of every test file, defined here once: the CUDA cases run where a GPU
# is visible (the GPU host runs the same files) and skip with their reason elsewhere.
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
# The attention's CUDA cases also need the CUDA kernels of both directions (built when CUDA is).
HAS_CUDA_ATTENTION = all(
    torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    for op in ("safeattn::attention", "safeattn::_attention_backward")
)
ATTENTION_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not (torch.cuda.is_available() and HAS_CUDA_ATTENTION),
            reason="needs a CUDA GPU and the CUDA attention kernels",
        ),
    ),
]


def cuda_kernel_names(fn, warmup: bool = False) -> list[str]:
    """The CUDA kernels fn launches, in order, as torch.profiler records them (warmup: one call
    first, so that its one-time work stays out of the trace). Under compute-sanitizer (the sanitize
    stage of scripts/gpu_check.sh sets SAFEATTN_TEST_SANITIZER) the profiler records no kernel:
    the test skips there rather than assert on an empty list."""
    if os.environ.get("SAFEATTN_TEST_SANITIZER"):
        pytest.skip("compute-sanitizer holds the CUDA profiling interface: the profiler records no kernel")
    if warmup:
        fn()
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type.name == "CUDA"]


def pytest_addoption(parser):
    parser.addoption(
        "--generic-kernels",
        action="store_true",
        help="run attention on the generic CUDA kernels (those of A100/Ada/Blackwell) on an H100/H200",
    )
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run only shard K (or shards K1,K2,...) of N, dealt round-robin after the slow-first "
        "order below, so that the suite can be split over calls of limited length",
    )
    parser.addoption(
        "--resume-from",
        default=None,
        metavar="LOG",
        help="leave out the tests that a run cut short (a time limit) finished, as its -v output "
        "LOG names them (passed, skipped, xfailed, xpassed); failed and errored ones run again",
    )


# A test's end in pytest -v output, with or without xdist: "tests/x.py::t[a] PASSED [ 3%]" or
# "[gw3] [ 54%] PASSED tests/x.py::t[a]" (a parameter id may hold spaces: "t[8.0 (A100)]").
_NODE = r"tests/[^\s:]+::[^\s\[]+(?:\[[^\]]*\])?"
_END = r"(?:PASSED|SKIPPED|XFAIL|XPASS)"
_FINISHED = re.compile(rf"({_NODE}) {_END}\b|\b{_END} ({_NODE})")


def finished_test_ids(log: str) -> set[str]:
    """The node ids a pytest -v log reports as passed, skipped, xfailed or xpassed."""
    return {a or b for a, b in _FINISHED.findall(log)}


def pytest_configure(config):
    # Process-wide, so every xdist worker sets it in its own process.
    if config.getoption("--generic-kernels"):
        from safeattn import _testing

        _testing.set_generic_kernels_only(True)
    # On a host with several GPUs (scripts/gpu_check.sh sets SAFEATTN_TEST_SPREAD_GPUS=1 there),
    # xdist worker gwN puts its "cuda" tensors on GPU N % count instead of every worker on GPU 0.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if (
        os.environ.get("SAFEATTN_TEST_SPREAD_GPUS") == "1"
        and worker.startswith("gw")
        and torch.cuda.is_available()
    ):
        count = torch.cuda.device_count()
        if count > 1:
            torch.cuda.set_device(int(worker[2:]) % count)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (compilation, AOTInductor, gradcheck: 40-220 s each on the GPU host)
    start first, each paired with one ordinary test, so that with
    `pytest -n N --maxschedchunk 1` (xdist hands every worker two tests, then one at a time) the
    first N workers each take one slow test at once instead of one worker meeting several of them
    last, which made the whole suite take 520-560 s with 14 workers there."""
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    # With pytest-timeout (gpu_check.sh passes --timeout 300, to catch hangs), a slow test gets three
    # times that: with 15 workers compiling at once on the GPU host, the AOTInductor and compile
    # tests took 290 s and more, and two of them were cut at 300 s.
    if config.pluginmanager.hasplugin("timeout"):
        limit = config.getoption("timeout", None)
        if limit:
            for item in slow:
                if item.get_closest_marker("timeout") is None:
                    item.add_marker(pytest.mark.timeout(3 * float(limit)))
    if slow:
        other = [item for item in items if item.get_closest_marker("slow") is None]
        paired = [item for pair in zip(slow, other, strict=False) for item in pair]
        paired += slow[len(other) :] + other[len(slow) :]
        items[:] = paired
    shard = config.getoption("--shard")
    if shard:
        try:
            ks, n = shard.split("/")
            n = int(n)
            wanted = {int(k) for k in ks.split(",")}
        except ValueError:
            raise pytest.UsageError(f"--shard: expected K/N or K1,K2/N, got {shard!r}") from None
        if n < 1 or not wanted <= set(range(n)):
            raise pytest.UsageError(f"--shard: every K must be in [0, N), got {shard!r}")
        keep = [item for i, item in enumerate(items) if i % n in wanted]
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n not in wanted])
        items[:] = keep
    resume = config.getoption("--resume-from")
    if resume:
        try:
            done = finished_test_ids(Path(resume).read_text(errors="replace"))
        except OSError as e:
            raise pytest.UsageError(f"--resume-from: cannot read {resume!r}: {e}") from None
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = [item for item in items if item.nodeid not in done]
