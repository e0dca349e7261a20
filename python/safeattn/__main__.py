"""``python -m safeattn {info,demo,bench}``: what was built, what it changes, how fast it is."""

from __future__ import annotations

import argparse
import platform
import sys

from . import _build_check
from ._bench import machine_name
from ._cli_bench import add_arguments


def _info() -> int:
    import torch

    import safeattn

    info = safeattn.build_info()
    print(f"safeattn        {info['version']}")
    print(f"torch           {torch.__version__} (safeattn built against {info['torch_version']})")
    print(f"built for       {_build_check.describe(_build_check.build_record())}")
    print(f"python          {platform.python_version()}")
    print(f"CPU             {machine_name()}, {torch.get_num_threads()} threads")
    runnable = ", ".join(info["cpu_isas_runnable"])
    print(f"CPU ISAs built  {', '.join(info['cpu_isas']) or 'none'} (this CPU runs {runnable})")
    print(f"CPU ISA in use  {info['cpu_isa_in_use']}  (set ATEN_CPU_CAPABILITY to change)")
    print(f"torch's ISA     {torch.backends.cpu.get_cpu_capability()}")
    tiles = info["cpu_tiles"]
    print(f"CPU bf16 tiles  {tiles['bfloat16']}")
    print(f"CPU fp16 tiles  {tiles['float16']}")
    threads = safeattn._C.cpu_parallel_threads()
    print(
        f"CPU kernels     {threads} of {torch.get_num_threads()} threads (at::parallel_for, torch's OpenMP)"
    )
    if info["with_cuda"]:
        record = _build_check.build_record() or {}
        targets = record.get("cuda_targets") or info["cuda_archs"]
        shown = ", ".join("sm_" + t.replace("+PTX", " + PTX") for t in targets)
        if info.get("hopper_kernels"):
            shown += ", sm_90a (Hopper kernels)"
        print(
            f"CUDA            built with {info['cuda_version']} (torch's: {torch.version.cuda}), for {shown}"
        )
        fwd = ", ".join(map(str, info.get("attention_fwd_head_dims", []))) or "none"
        bwd = ", ".join(map(str, info.get("attention_bwd_head_dims", []))) or "none"
        print(f"attention       tensor-core head dims (bf16, fp16): forward {fwd}; backward {bwd}")
        fwd90 = ", ".join(map(str, info.get("attention_sm90_fwd_head_dims", []))) or "none"
        bwd90 = ", ".join(map(str, info.get("attention_sm90_bwd_head_dims", []))) or "none"
        print(f"                of them sm_90a (TMA + wgmma, on sm_90): forward {fwd90}; backward {bwd90}")
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                print(f"GPU {index}".ljust(16) + safeattn.gpu_coverage(index))
        else:
            print("GPU             none visible")
    else:
        print(f"CUDA            not built (torch's: {torch.version.cuda or 'none'})")
    # Which backends each op has, read from the dispatcher (a kernel missing there is missing).
    keys = ("CPU", "CUDA", "Meta", "Autograd")
    ops = sorted(info["op_kernels"].items())
    width = max([len(name) for name, _ in ops] + [len("op")]) + 2
    print(("kernels         " + "op".ljust(width) + "".join(k.ljust(10) for k in keys)).rstrip())
    for name, have in ops:
        marks = "".join(("yes" if k in have else "-").ljust(10) for k in keys)
        print(f"                {name.ljust(width)}{marks}".rstrip())
    return 0


def _unloadable(command: str, problem: str) -> int:
    """The build does not fit the running torch, so _C was not loaded: say so, and how to fix it."""
    from ._version import __version__

    if command == "info":
        now = _build_check.running_torch()
        print(f"safeattn        {__version__} (native library not loaded)")
        print(f"built for       {_build_check.describe(_build_check.build_record())}")
        print(
            f"running         torch {now['torch_version']}, {_build_check.abi_name(now['cxx11_abi'])}, "
            f"CUDA {now['torch_cuda_version'] or 'none'}"
        )
        print(f"python          {platform.python_version()} ({sys.executable})")
        print()
    print(problem, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m safeattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what this build holds")
    demo = sub.add_parser(
        "demo", help="a tiny padded Llama, the ops on fully masked rows, native masks; with timings"
    )
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--quick", action="store_true", help="small sizes (CI)")
    demo.add_argument("--no-compile", action="store_true", help="skip the torch.compile timings")
    bench = sub.add_parser(
        "bench", help="the benchmark suite: ratio tables against peers, plots; the README's tables"
    )
    add_arguments(bench)
    args = parser.parse_args(argv)
    import safeattn

    if safeattn._build_problem is not None:
        return _unloadable(args.command, safeattn._build_problem)
    if args.command == "info":
        return _info()
    if args.command == "demo":
        from ._demo import run_demo

        return run_demo(device=args.device, quick=args.quick, compile=not args.no_compile)
    from ._cli_bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
