"""python -m safeattn {info,demo,bench} run on the CPU with small sizes and print what they promise."""

import importlib.util
import math
import os
import re
import struct
import subprocess
import sys
import zlib

import pytest
import safeattn

NEEDS_MATPLOTLIB = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="bench --plot needs matplotlib (pip install matplotlib; it is in requirements-dev.txt)",
)


def run(*args: str, env: dict | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "safeattn", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, f"python -m safeattn {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def table_rows(out: str, first_cells: tuple[str, ...]) -> dict[str, list[str]]:
    """{first cell: cells} of the demo's aligned tables (columns are 2+ spaces apart)."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in first_cells:
            rows[cells[0]] = cells
    return rows


# ---- info --------------------------------------------------------------------------------


def test_info_reports_build():
    out = run("info")
    info = safeattn.build_info()
    assert f"safeattn        {safeattn.__version__}" in out, out
    assert "CPU ISA in use  " + info["cpu_isa_in_use"] in out, out
    assert "CPU bf16 tiles  " + info["cpu_tiles"]["bfloat16"] in out, out
    assert "CPU fp16 tiles  " + info["cpu_tiles"]["float16"] in out, out
    assert "DEFAULT" in info["cpu_isas"], f"the DEFAULT variant is always built: {info}"
    assert "DEFAULT" in info["cpu_isas_runnable"], f"every CPU runs the DEFAULT variant: {info}"
    assert set(info["cpu_isas_runnable"]) <= set(info["cpu_isas"]), f"runnable but not built: {info}"
    import torch

    assert f"torch           {torch.__version__} (safeattn built against {info['torch_version']})" in out, out
    kernel_lines = {
        line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if line.startswith(" " * 16)
    }
    for op in ("sdpa_mask", "safe_softmax", "masked_softmax", "attention", "_attention_backward"):
        assert op in kernel_lines, f"info lists every op's kernels, {op} missing:\n{out}"
        assert kernel_lines[op][0] == "yes", f"{op} has a CPU kernel:\n{out}"
        cuda = "yes" if "CUDA" in info["op_kernels"][op] else "-"
        assert kernel_lines[op][1] == cuda, f"{op}'s CUDA column follows the dispatcher:\n{out}"
    if info["with_cuda"]:
        fwd = ", ".join(map(str, info["attention_fwd_head_dims"])) or "none"
        assert f"tensor-core head dims (bf16, fp16): forward {fwd};" in out, out
        fwd90 = ", ".join(map(str, info["attention_sm90_fwd_head_dims"])) or "none"
        assert f"of them sm_90a (TMA + wgmma, on sm_90): forward {fwd90};" in out, out


def test_cpu_kernels_run_on_torch_threads():
    # ATen's at::parallel_for is an OpenMP region in its headers: built without -fopenmp, every
    # safeattn CPU kernel ran on one thread whatever torch.set_num_threads said.
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert (
            safeattn._C.cpu_parallel_threads() == 2
        ), "at::parallel_for in safeattn's code used one thread of two: built without OpenMP?"
        torch.set_num_threads(1)
        assert (
            safeattn._C.cpu_parallel_threads() == 1
        ), "torch.set_num_threads(1) must hold for safeattn's kernels"
    finally:
        torch.set_num_threads(before)
    out = run("info", env={"OMP_NUM_THREADS": "2"})
    assert "CPU kernels     2 of 2 threads" in out, out


def test_info_follows_aten_cpu_capability():
    out = run("info", env={"ATEN_CPU_CAPABILITY": "default"})
    assert "CPU ISA in use  DEFAULT" in out, out


# ---- demo --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_out() -> str:
    return run("demo", "--quick", "--device", "cpu")


@pytest.mark.slow
def test_demo_model_table(demo_out):
    rows = table_rows(demo_out, ("eager", "sdpa", "safeattn"))
    assert set(rows) == {"eager", "sdpa", "safeattn"}, f"one row per attn_implementation:\n{demo_out}"
    for impl, cells in rows.items():
        assert len(cells) == 6, f"{impl}: diff, NaN, non-zero, eager ms, compiled ms:\n{demo_out}"
        assert float(cells[4]) > 0 and float(cells[5]) > 0, f"{impl}: both timings measured:\n{demo_out}"
    assert float(rows["sdpa"][1]) == 0.0, f"sdpa against itself:\n{demo_out}"
    assert float(rows["safeattn"][1]) < 1e-4, f"safeattn's logits on real tokens match sdpa's:\n{demo_out}"
    assert float(rows["eager"][1]) < 1e-4, f"eager's logits on real tokens match sdpa's:\n{demo_out}"
    nan, total = map(int, rows["safeattn"][2].split("/"))
    nonzero, _ = map(int, rows["safeattn"][3].split("/"))
    assert total > 0 and nan == 0 and nonzero == 0, f"safeattn's padded rows are exactly 0:\n{demo_out}"
    eager_nonzero, _ = map(int, rows["eager"][3].split("/"))
    assert (
        eager_nonzero > 0
    ), f"eager's padded rows hold an average of the values (the demo shows it):\n{demo_out}"


def test_demo_ops_table(demo_out):
    names = (
        "torch.softmax(-inf filled)",
        "torch.softmax(finfo.min filled)",
        "safeattn.safe_softmax(-inf filled)",
        "safeattn.masked_softmax(scores, mask)",
        "softmax(q @ k^T * scale, -inf filled) @ v",
        "F.scaled_dot_product_attention(bool mask)",
        "F.scaled_dot_product_attention(finfo.min bias)",
        "safeattn.attention(bool mask)",
    )
    rows = table_rows(demo_out, names)
    assert set(rows) == set(names), f"one row per call:\n{demo_out}"
    for name, (_, out_nan, out_dead, grad_nan, grad_dead) in rows.items():
        if name.startswith("safeattn"):
            assert (out_nan, out_dead, grad_nan, grad_dead) == (
                "0",
                "0",
                "0",
                "0",
            ), f"{name}: no NaN, empty rows and their gradient exactly 0:\n{demo_out}"
    assert (
        int(rows["torch.softmax(-inf filled)"][1]) > 0
    ), f"torch.softmax makes NaN on empty rows:\n{demo_out}"
    assert (
        int(rows["softmax(q @ k^T * scale, -inf filled) @ v"][3]) > 0
    ), f"hand-written attention's NaN reaches the value gradient:\n{demo_out}"
    assert (
        float(rows["torch.softmax(finfo.min filled)"][2]) > 0
    ), f"finfo.min filling gives garbage:\n{demo_out}"


def test_demo_masks(demo_out):
    assert "■" in demo_out and "⬚" in demo_out, "the demo draws a mask"
    kinds = ("causal", "sliding", "chunked", "packed")
    table = [line for line in demo_out.splitlines() if line.strip().startswith(kinds)]
    assert len(table) == 4, f"one row per mask kind:\n{demo_out}"
    assert all(
        line.rstrip().endswith("yes") for line in table
    ), f"every native mask equals Transformers':\n{demo_out}"


# ---- bench -------------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature and the CRC of every chunk."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in chunk {kind}"
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, f"{path}: chunks {chunks}"
    return struct.unpack(">II", data[16:24])


def ratio_tables(out: str) -> dict[str, list[list[str]]]:
    """{op: table rows (cells)} from the bench's markdown tables."""
    tables, op = {}, None
    for line in out.splitlines():
        if line.startswith("## "):
            op = line.split()[1]
            tables[op] = []
        elif op and line.startswith("| ") and not line.startswith("| S "):
            tables[op].append([c.strip() for c in line.strip("|").split("|")])
    return tables


@NEEDS_MATPLOTLIB
def test_bench_all_ops_with_plots(tmp_path):
    out = run("bench", "--device", "cpu", "--quick", "--seq", "64", "128", "--plot", str(tmp_path))
    tables = ratio_tables(out)
    expected = {"sdpa_mask", "safe_softmax", "masked_softmax", "attention", "transformers"}
    assert set(tables) == expected, f"one section per op:\n{out}"
    for op, rows in tables.items():
        assert rows and all(r[0] in ("64", "128") for r in rows), f"{op}: a row per length and mode:\n{out}"
        ratios = [c for r in rows for c in r if c.endswith("x")]
        assert ratios and all(float(c[:-1]) > 0 for c in ratios), f"{op}: ratios against peers:\n{out}"
        width, height = png_size(tmp_path / f"{op}.png")
        assert (width, height) == (512, 320), f"{op}.png is the small 6.4x4 inch plot at 80 dpi"
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"{op}.png" for op in expected
    ), "a plot per op, nothing else"


def test_bench_op_selection_without_plots(tmp_path):
    out = run("bench", "--device", "cpu", "--quick", "--seq", "32", "--op", "safe_softmax", "masked_softmax")
    assert set(ratio_tables(out)) == {"safe_softmax", "masked_softmax"}, f"only the ops asked for:\n{out}"
    assert "plot:" not in out, f"no plots unless --plot:\n{out}"


def test_bench_model_tiny_training_step_and_prefill():
    out = run(
        "bench",
        "model",
        "--tiny",
        "--no-compile",
        "--device",
        "cpu",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--impl",
        "sdpa",
        "safeattn",
        "--markdown",
    )
    rows = [
        line.split(" | ") for line in out.splitlines() if line.count(" | ") == 5 and not line.startswith("|")
    ]
    cases = {(r[0], r[1], r[2], r[3]) for r in rows}
    want = {
        (phase, tokens, "eager", impl)
        for phase in ("train step", "prefill")
        for tokens in ("padded", "unpadded")
        for impl in ("sdpa", "safeattn")
    }
    assert cases == want, f"a row per phase, padding and implementation:\n{out}"
    for r in rows:
        assert float(r[4]) > 0 and 0 < float(r[5][:-1]) <= 1.0, f"a time and its ratio to the best: {r}"
    assert "n/a" not in out, f"every case ran:\n{out}"


def test_bench_decode_quick_cpu():
    out = run("bench", "decode", "--device", "cpu", "--quick", "--markdown")
    assert "WARNING" not in out, f"safeattn agrees with SDPA in every case:\n{out}"
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")
    ]
    header, body = rows[0], rows[1:]
    assert [(r[0], r[1], r[2]) for r in body] == [("1", "256", "32:8"), ("2", "256", "32:8")], out
    for r in body:
        cell = dict(zip(header, r, strict=False))
        assert cell["fastest peer"] == "sdpa", cell
        ratio = float(cell["vs fastest peer"].rstrip("x"))
        assert math.isclose(
            ratio, float(cell["peer us"]) / float(cell["safeattn us"]), rel_tol=0.02, abs_tol=0.006
        ), cell
        assert float(cell["paged / contiguous"]) > 0, cell
    assert re.search(r"host time per small call: safeattn [0-9.]+ us, sdpa [0-9.]+ us", out), out
    assert "smallest ratio:" in out, out


def test_bench_serving_tiny_cpu():
    import transformers

    if not hasattr(transformers, "ContinuousBatchingConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no continuous batching config")
    out = run("bench", "serving", "--tiny", "--device", "cpu", "--markdown")
    lines = {
        m.group(1): m
        for m in re.finditer(
            r"^(paged\|\w+) +([0-9.]+) s +([0-9]+) tokens/s .* same tokens: (\w+)$", out, re.M
        )
    }
    assert set(lines) == {"paged|sdpa", "paged|safeattn"}, out
    for impl, m in lines.items():
        assert float(m.group(2)) > 0 and int(m.group(3)) > 0, f"{impl}: a time and a rate\n{out}"
        assert m.group(4) == "True", f"{impl}: greedy tokens equal paged|sdpa's\n{out}"
    assert "| paged\\|safeattn |" in out, f"the README table escapes the pipe:\n{out}"


def _tiny_model_args(**extra):
    """bench model's arguments for a one-layer Llama of width 32 over 16 tokens."""
    import types

    shape = dict(vocab=64, hidden=32, mlp=64, layers=1, heads=4, kv_heads=2, head_dim=8, seq=16)
    return types.SimpleNamespace(**shape, **extra)


def test_bench_model_each_model_runs_its_own_implementation():
    """The models are built from one config; each must keep the implementation it was built with
    (Transformers 5 writes it into the config it is given: a shared one made every model run the
    last implementation, and the GPU table compared safeattn with itself)."""
    pytest.importorskip("transformers")
    import torch
    from safeattn import _bench_model

    config = _bench_model.model_config(_tiny_model_args())
    models = {
        impl: _bench_model.make_model(config, impl, "cpu", torch.float32)
        for impl in ("sdpa", "eager", "safeattn")
    }
    for impl, model in models.items():
        layer_config = model.model.layers[0].self_attn.config
        assert (
            layer_config._attn_implementation == impl
        ), f"the {impl} model runs {layer_config._attn_implementation}"


def test_bench_model_times_the_four_configurations():
    """The whole-model target names four configurations (padded or not, eager or compiled) for the
    training step and the prefill: all eight are timed (the compiled ones were the padded training
    step only). The compiled callables are built, not run (torch.compile compiles at the first
    call)."""
    pytest.importorskip("transformers")
    import torch
    from safeattn import _bench_model

    args = _tiny_model_args(batch=2, impl=["sdpa", "safeattn"], compile=True, eager=True)
    table, failed = _bench_model.cases(args, torch.device("cpu"), torch.float32)
    assert not failed, failed
    assert set(table) == {
        (phase, padded, compiled)
        for phase in ("train step", "prefill")
        for padded in (True, False)
        for compiled in (True, False)
    }, sorted(table)
    for key, impls in table.items():
        assert set(impls) == {"sdpa", "safeattn"}, (key, sorted(impls))
    args.compile = False
    table, _ = _bench_model.cases(args, torch.device("cpu"), torch.float32)
    assert table and not any(compiled for _, _, compiled in table), "--no-compile: eager cases only"
    args.compile, args.eager = True, False
    table, _ = _bench_model.cases(args, torch.device("cpu"), torch.float32)
    assert table and all(compiled for _, _, compiled in table), "--no-eager: compiled cases only"


def test_bench_text_progress_without_tqdm(monkeypatch, capsys):
    from safeattn import _cli_bench

    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `from tqdm import tqdm` raise ImportError
    progress = _cli_bench.Progress(2)
    assert progress.bar is None, "no tqdm: the text counter"
    for label in ("first case", "second case"):
        progress.begin(label)
        progress.end()
    err = capsys.readouterr().err
    assert "[1/2] first case" in err and "[2/2] second case" in err, f"text progress: {err!r}"
    assert err.endswith("[2/2] done" + " " * 40 + "\n"), f"the counter ends its line: {err!r}"


# ---- bench attention --sweep (the GPU sweep: its plumbing, on the CPU) ----------------------


def sweep_rows(out: str) -> list[list[str]]:
    """The rows of the first markdown table in `out` (cells stripped), the header and rule left
    out; a report's list of rows short of a target, after it, is not part of it."""
    lines = [line for line in out.split("short of a target")[0].splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[1:]]


def test_bench_attention_sweep_dry_run_lists_each_axis():
    out = run("bench", "attention", "--sweep", "--dry-run")
    rows = sweep_rows(out)
    names = [r[1] for r in rows]
    axes = {axis for r in rows for axis in r[2].split(", ")}
    assert axes == {
        "seq",
        "head_dim",
        "gqa",
        "mask",
        "window",
        "chunk",
        "packed",
        "bias",
    }, f"every axis:\n{out}"
    assert len(set(names)) == len(names), f"a case on several axes is listed once:\n{out}"
    for seq in (512, 1024, 2048, 4096, 8192, 16384, 32768):
        assert any(n.startswith(f"S={seq} ") for n in names), f"S={seq} is swept:\n{out}"
    assert "S=512 B=32 " in out and "S=32768 B=1 " in out, f"B*S = 16384 tokens, B at least 1:\n{out}"
    for part in ("D=64 ", "D=96 ", "D=128 ", "D=256 ", "H=16:16 ", "H=16:4 ", "H=16:2 "):
        assert any(part in n for n in names), f"{part.strip()} is swept:\n{out}"
    masks = {n.split()[-1] for n in names}
    want = {"none", "causal", "padding", "window256", "window1024", "window4096", "chunk512", "chunk8192"}
    want |= {f"packed{n}" for n in (2, 4, 8, 16, 32, 64)} | {"bias1H", "biasB1", "biasBH"}
    assert want <= masks, f"every mask kind, {sorted(want - masks)} missing:\n{out}"
    for r in rows:
        timed = r[3].split(", ")
        mask = r[1].split()[-1]
        if mask in ("none", "causal"):
            assert timed == ["safeattn", "SDPA cuDNN", "SDPA flash"], f"plain masks against SDPA: {r}"
        elif mask.startswith("bias"):
            assert timed == ["safeattn", "Flex", "SDPA efficient"], f"a learnable bias against Flex: {r}"
        else:
            assert timed == ["safeattn", "safeattn dense", "Flex"], f"described masks, dense and Flex: {r}"
    count = re.search(r"^(\d+) cases, (\d+) rows \(fwd, fwd\+bwd\), (\d+) timings", out, re.M)
    assert count and int(count[1]) == len(rows) and int(count[2]) == 2 * len(rows), f"the counts:\n{out}"
    assert int(count[3]) <= 500, f"a few hundred timings at most:\n{out}"

    quick = sweep_rows(run("bench", "attention", "--sweep", "--dry-run", "--quick"))
    quick_axes = {axis for r in quick for axis in r[2].split(", ")}
    assert quick_axes == axes and len(quick) < len(rows) / 3, f"--quick: every axis, few cases: {quick}"

    subset = sweep_rows(
        run(
            "bench",
            "attention",
            "--sweep",
            "--dry-run",
            "--sweep-axis",
            "bias",
            "--sweep-filter",
            "S=4096",
            "S=8192",
        )
    )
    assert subset and all("bias" in r[2].split(", ") for r in subset), f"--sweep-axis: {subset}"
    assert {r[1].split()[0] for r in subset} == {"S=4096", "S=8192"}, f"--sweep-filter, any of: {subset}"


def test_bench_attention_sweep_report_and_summary(tmp_path):
    """--report prints the table and the targets' worst cases from saved numbers (no GPU)."""

    def record(case, mode, family, ms, not_run=None):
        return {
            "case": case,
            "pass": mode,
            "family": family,
            "heads": 16,
            "head_dim": 128,
            "pairs": 4 * 4096 * 4097 // 2,
            "ms": ms,
            "not_run": not_run or {},
        }

    causal = "S=4096 B=4 H=16:16 D=128 causal"
    packed = "S=4096 B=4 H=16:16 D=128 packed8"
    bias = "S=4096 B=4 H=16:16 D=128 bias1H"
    first = {
        "meta": {"device": "test GPU", "torch": "x", "tokens": 16384},
        "records": [
            record(causal, "fwd", "plain", {"safeattn": 1.0, "SDPA cuDNN": 1.1}, {"SDPA flash": "refused"}),
            record(packed, "fwd", "described", {"safeattn": 1.0, "safeattn dense": 0.9, "Flex": 1.5}),
        ],
    }
    second = {
        "meta": first["meta"],
        "records": [
            record(causal, "fwd", "plain", {"safeattn": 1.0, "SDPA cuDNN": 1.2, "SDPA flash": 1.3}),
            record(packed, "fwd+bwd", "described", {"safeattn": 3.0, "safeattn dense": 3.3, "Flex": 3.15}),
            record(bias, "fwd+bwd", "bias", {"safeattn": 2.0, "Flex": 2.6, "SDPA efficient": 5.0}),
        ],
    }
    paths = []
    for name, saved in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(__import__("json").dumps(saved))
        paths.append(str(tmp_path / name))
    out = run("bench", "attention", "--sweep", "--report", *paths)
    rows = {(r[0], r[1]): r for r in sweep_rows(out)}
    assert set(rows) == {(causal, "fwd"), (packed, "fwd"), (packed, "fwd+bwd"), (bias, "fwd+bwd")}, out
    assert rows[(causal, "fwd")][4:7] == [
        "SDPA cuDNN",
        "1.200",
        "1.20x",
    ], f"the later file's row wins:\n{out}"
    assert rows[(packed, "fwd")][7:9] == ["0.900", "0.90x"], f"the dense path and dense / described:\n{out}"
    assert "refused" not in out, f"the replaced row is gone:\n{out}"
    assert "smallest ratio: 1.05x, S=4096 B=4 H=16:16 D=128 packed8 fwd+bwd, against Flex" in out, out
    assert "- every case >= 1.0x the best peer: worst 1.05x, " in out and "(met)" in out, out
    assert (
        "- described masks >= 1.1x Flex, fwd+bwd: worst 1.05x, " in out and "(MISSED in 1 of 1)" in out
    ), out
    assert (
        "- described never slower than dense: worst 0.90x, S=4096 B=4 H=16:16 D=128 packed8 fwd" in out
    ), out
    assert "- learnable bias fwd+bwd >= 1.2x Flex: worst 1.30x, " in out, out
    # The misses, furthest below first: each (row, target) short of it, and nothing else.
    short = out.split("short of a target (2):", 1)[1]
    misses = [line.strip("| ").split(" | ") for line in short.splitlines() if line.startswith("| S=")]
    assert misses == [
        [packed, "fwd", "described never slower than dense", "0.90x"],
        [packed, "fwd+bwd", "described masks >= 1.1x Flex, fwd+bwd", "1.05x"],
    ], out


def test_bench_attention_sweep_time_limit_json_resume(tmp_path, monkeypatch, capsys):
    """The sweep's loop with the GPU work faked: --time-limit stops between passes and still
    prints the summary, --json holds every printed row, --resume runs only the rest."""
    import argparse
    import json
    import types

    import torch
    from safeattn import _bench_attention
    from safeattn import _bench_sweep as sweep

    clock = iter(range(0, 10**6, 10))  # every reading of the clock 10 s after the last
    monkeypatch.setattr(sweep, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "fake GPU")
    built = []

    def fake_build(case, device, dtype):
        built.append(case.name)
        return {name: None for name in case.impl_names() if name}, 1000

    def fake_time(case, backward, impls, repeats, warmup, dtype):
        return {name: 1.0 + 0.1 * i for i, name in enumerate(impls)}, {}

    monkeypatch.setattr(sweep, "build", fake_build)
    monkeypatch.setattr(sweep, "time_case", fake_time)
    monkeypatch.setattr(sweep, "unbuilt_reason", lambda head_dim: None)
    parser = argparse.ArgumentParser()
    _bench_attention.add_arguments(parser)
    path = tmp_path / "sweep.json"
    common = ["--device", "cuda", "--sweep", "--quick", "--json", str(path)]
    assert _bench_attention.run(parser.parse_args([*common, "--time-limit", "200"])) == 0
    out = capsys.readouterr().out
    total = 2 * len(sweep.sweep_cases(quick=True))
    rows = [r for r in sweep_rows(out) if r[1] in ("fwd", "fwd+bwd")]
    saved = json.loads(path.read_text())
    assert "time limit: stopped after" in out and 0 < len(rows) < total, f"stopped early:\n{out}"
    assert len(saved["records"]) == len(rows), "the JSON holds every printed row"
    assert saved["meta"]["stopped"].startswith("time limit"), saved["meta"]
    assert "smallest ratio: " in out and "- every case >= 1.0x the best peer: worst" in out, out

    first = len(built)
    assert _bench_attention.run(parser.parse_args([*common, "--resume"])) == 0
    out = capsys.readouterr().out
    saved = json.loads(path.read_text())
    keys = [(r["case"], r["pass"]) for r in saved["records"]]
    assert len(keys) == total == len(set(keys)), f"--resume ran each remaining pass once: {keys}"
    assert "time limit" not in out and saved["meta"]["stopped"] is None, out
    assert len(built) - first <= total // 2 - len(rows) // 2 + 1, "--resume skips the cases done"


def test_bench_attention_sweep_skips_head_dims_not_built(tmp_path, monkeypatch, capsys):
    """A head dim the build lacks would run on a fallback many times slower: the sweep times no
    case of it, writes no record (so --resume with a fuller build measures it) and says why;
    unbuilt_reason reads the sm_90a lists on an H100/H200 and the generic ones elsewhere."""
    import argparse
    import json

    import safeattn
    import torch
    from safeattn import _bench_attention
    from safeattn import _bench_sweep as sweep

    info = {
        "attention_fwd_head_dims": [64, 96, 128, 256],
        "attention_bwd_head_dims": [64, 96, 128, 256],
        "attention_sm90_fwd_head_dims": [64, 128],
        "attention_sm90_bwd_head_dims": [64, 128, 256],
        "hopper_kernels": True,
    }
    monkeypatch.setattr(safeattn, "build_info", lambda: info)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability[0])
    assert sweep.unbuilt_reason(128) is None
    for head_dim in (96, 256):  # 256: a backward but no forward
        why = sweep.unbuilt_reason(head_dim)
        assert why and f"head dim {head_dim}" in why and "sm_90a" in why and "SAFEATTN_ATTN_HEAD_DIMS" in why
    capability[0] = (8, 0)
    assert sweep.unbuilt_reason(96) is None and sweep.unbuilt_reason(256) is None
    assert "generic CUDA" in sweep.unbuilt_reason(80)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "fake GPU")
    built = []

    def fake_build(case, device, dtype):
        built.append(case)
        return {name: None for name in case.impl_names() if name}, 1000

    monkeypatch.setattr(sweep, "build", fake_build)
    monkeypatch.setattr(sweep, "time_case", lambda case, backward, impls, *a: ({n: 1.0 for n in impls}, {}))
    monkeypatch.setattr(sweep, "unbuilt_reason", lambda d: None if d == 128 else f"no {d} here")
    parser = argparse.ArgumentParser()
    _bench_attention.add_arguments(parser)
    path = tmp_path / "sweep.json"
    args = ["--device", "cuda", "--sweep", "--sweep-axis", "head_dim", "--json", str(path), "--resume"]
    assert _bench_attention.run(parser.parse_args(args)) == 0
    out = capsys.readouterr().out
    cases = sweep.select(sweep.sweep_cases(), ["head_dim"], None)
    others = {c.head_dim for c in cases} - {128}
    assert others and {c.head_dim for c in built} == {128}, [c.name for c in built]
    saved = json.loads(path.read_text())["records"]
    assert saved and {r["head_dim"] for r in saved} == {128}
    for head_dim in others:
        count = sum(c.head_dim == head_dim for c in cases)
        assert f"skipped {count} cases of D={head_dim}: no {head_dim} here" in out, out

    monkeypatch.setattr(sweep, "unbuilt_reason", lambda d: None)  # a fuller build resumes the rest
    assert _bench_attention.run(parser.parse_args(args)) == 0
    saved = json.loads(path.read_text())["records"]
    assert {r["head_dim"] for r in saved} == {c.head_dim for c in cases} and len(saved) == 2 * len(cases)
    assert "skipped" not in capsys.readouterr().out


def _attention_bench_args(*argv):
    import argparse

    from safeattn import _bench_attention

    parser = argparse.ArgumentParser()
    _bench_attention.add_arguments(parser)
    args = parser.parse_args(list(argv))
    _bench_attention.resolve_shape(args)
    return args


def test_bench_attention_shape_defaults_by_device():
    """--batch / --heads / --seq left out take the device's shape; given, they are kept."""
    cpu = _attention_bench_args()
    assert (cpu.batch, cpu.heads, cpu.seq) == (1, 8, [512, 2048])
    cuda = _attention_bench_args("--device", "cuda")
    assert (cuda.batch, cuda.heads, cuda.seq) == (4, 16, [4096])
    given = _attention_bench_args("--device", "cuda", "--batch", "32", "--heads", "8", "--seq", "512", "1024")
    assert (given.batch, given.heads, given.seq) == (32, 8, [512, 1024])


@pytest.mark.parametrize("argv", [("--seq", "0"), ("--batch", "0"), ("--heads", "-2")])
def test_bench_attention_rejects_a_shape_below_one(argv):
    with pytest.raises(SystemExit, match=argv[0]):
        _attention_bench_args("--device", "cuda", *argv)


def test_bench_attention_cuda_prefill_takes_the_given_shape(monkeypatch, capsys):
    """--device cuda times its prefill table at --batch / --heads and each --seq (it used to time
    B=4 H=16 S=4096 whatever was given); with several lengths each row names its S."""
    import torch
    from safeattn import _bench_attention

    timed = []

    def fake_prefill(args, batch, heads, seq, dtypes):
        timed.append((batch, heads, seq))
        return [["safeattn, is_causal", 64, "0.100", "1", "0.300", "1"]]

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "fake GPU")
    monkeypatch.setattr(_bench_attention, "_has_cuda_backward", lambda: True)
    monkeypatch.setattr(_bench_attention, "_cuda_prefill", fake_prefill)
    args = _attention_bench_args(
        "--device", "cuda", "--generic-kernels", "--batch", "32", "--seq", "512", "1024"
    )
    prefill, decode = _bench_attention.main_cuda(args)
    assert timed == [(32, 16, 512), (32, 16, 1024)]
    assert [row[0] for row in prefill] == ["safeattn, is_causal (S=512)", "safeattn, is_causal (S=1024)"]
    assert decode == []
