"""``python -m safeattn {info,demo}``."""

from __future__ import annotations

import argparse
import sys


def _info() -> int:
    import torch

    import safeattn

    info = safeattn.build_info()
    print(f"safeattn        {info['version']}")
    print(f"torch           {torch.__version__} (built against {info['torch_version']})")
    print(f"CPU ISAs built  {', '.join(info['cpu_isas']) or 'none'}")
    print(f"CPU ISA in use  {info['cpu_isa_in_use']}  (set ATEN_CPU_CAPABILITY to change)")
    if info["with_cuda"]:
        print(f"CUDA            {info['cuda_version']}, archs {', '.join('sm_' + a for a in info['cuda_archs'])}")
        print(f"GPU             {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none visible'}")
    else:
        print("CUDA            not built")
    print("ops             kernels")
    for op, keys in sorted(info["op_kernels"].items()):
        print(f"  {op:<14}{', '.join(keys)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m safeattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what this build holds")
    demo = sub.add_parser("demo", help="native masks next to Transformers', with timings")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--quick", action="store_true", help="small sizes (CI)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    from ._demo import run_demo

    return run_demo(device=args.device, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
