"""The suite's own options (tests/conftest.py): --resume-from leaves out the tests a run cut short
by a time limit finished, so that the next call of the GPU host runs only the rest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import finished_test_ids

TESTS = Path(__file__).parent


def test_finished_test_ids_reads_plain_and_xdist_lines():
    log = "\n".join(
        [
            "tests/test_a.py::test_x[cpu] PASSED                 [  1%]",
            "[gw3] [ 54%] PASSED tests/test_a.py::test_y[cuda-1] ",
            "[gw1] [ 55%] FAILED tests/test_a.py::test_z[cpu] ",
            "tests/test_b.py::test_s[8.0 (A100)] SKIPPED (needs a GPU)    [ 60%]",
            "[gw0] [ 61%] XFAIL tests/test_b.py::test_f[False-cuda] ",
            "[gw2] [ 62%] ERROR tests/test_b.py::test_e ",
            "tests/test_b.py::test_p XPASS (fixed)   [ 63%]",
            "SKIPPED [2] tests/test_kvcache.py:656: needs a CUDA GPU",
            "FAILED tests/test_a.py::test_z[cpu] - AssertionError",
        ]
    )
    assert finished_test_ids(log) == {
        "tests/test_a.py::test_x[cpu]",
        "tests/test_a.py::test_y[cuda-1]",
        "tests/test_b.py::test_s[8.0 (A100)]",
        "tests/test_b.py::test_f[False-cuda]",
        "tests/test_b.py::test_p",
    }


def _collect(*args: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_resume_from_leaves_out_what_a_cut_run_finished(tmp_path):
    every = _collect("tests/test_cuda_targets.py")
    assert len(every) >= 4, every
    log = tmp_path / "cut.log"
    log.write_text(
        f"{every[0]} PASSED [ 1%]\n[gw1] [ 2%] SKIPPED {every[1]} \n[gw0] [ 3%] FAILED {every[2]} \n"
    )
    rest = _collect("tests/test_cuda_targets.py", "--resume-from", str(log))
    assert rest == every[2:], rest
