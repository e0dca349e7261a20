"""python -m safeattn {info,demo} run and print what they promise."""

import subprocess
import sys

import safeattn


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "safeattn", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"python -m safeattn {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_info_reports_build():
    out = run("info")
    info = safeattn.build_info()
    assert f"safeattn        {safeattn.__version__}" in out, out
    assert "CPU ISA in use  " + info["cpu_isa_in_use"] in out, out
    assert "DEFAULT" in info["cpu_isas"], f"the DEFAULT variant is always built: {info}"
    assert "sdpa_mask" in out and "CPU" in info["op_kernels"]["sdpa_mask"], out


def test_info_follows_aten_cpu_capability():
    done = subprocess.run(
        [sys.executable, "-m", "safeattn", "info"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": "default"},
        timeout=300,
    )
    assert "CPU ISA in use  DEFAULT" in done.stdout, done.stdout + done.stderr


def test_demo_quick():
    out = run("demo", "--quick", "--device", "cpu")
    assert "■" in out and "⬚" in out, "the demo draws a mask"
    table = [line for line in out.splitlines() if line.strip().startswith(("causal", "sliding", "chunked", "packed"))]
    assert len(table) == 4, f"one row per mask kind:\n{out}"
    assert all(line.rstrip().endswith("yes") for line in table), f"every native mask equals Transformers':\n{out}"
