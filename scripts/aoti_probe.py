"""Which op makes an AOTInductor package crash when it is loaded? (a diagnostic for the GPU host)

Exports one tiny module per case (a plain Linear as the control, once in a process that never
imports safeattn and once with it imported, then one module per safeattn op), compiles each with
AOTInductor and loads and runs it in a fresh process, so that a segfault in one case names that
case instead of ending the run. Prints one line per case: rc (negative: killed by that signal),
max abs difference against eager, and the last lines of stderr.

    python scripts/aoti_probe.py --device cuda [--cases linear,sdpa_mask,...] [--out DIR] [--backtrace]

--backtrace runs each crashed case again under cuda-gdb (the GPU host has it, no gdb) and prints
the native frames of the crash.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("torch_only", "linear", "sdpa_mask", "masked_softmax", "safe_softmax", "attention")

CHILD = r"""
import faulthandler, sys, torch
faulthandler.enable()
case, device, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
if case != "torch_only":
    import safeattn
S, E = 8, 16

class Case(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(E, E)
    def forward(self, x, pad):
        b, s, _ = x.shape
        y = self.lin(x)
        if case == "sdpa_mask":
            return y + safeattn.sdpa_mask(b, s, s, padding_mask=pad).sum((1, 3)).unsqueeze(-1).to(y.dtype)
        if case == "masked_softmax":
            scores = y @ y.transpose(-1, -2)
            return safeattn.masked_softmax(scores, pad[:, None, :].expand(b, s, s), 0.25) @ y
        if case == "safe_softmax":
            return safeattn.safe_softmax(y @ y.transpose(-1, -2), -1) @ y
        if case == "attention":
            q = y.view(b, s, 2, E // 2).transpose(1, 2)
            return safeattn.attention(q, q, q, pad[:, None, None, :])[0].transpose(1, 2).reshape(b, s, E)
        return y

torch.manual_seed(0)
model = Case().to(device).eval()
x = torch.randn(2, S, E, device=device)
pad = torch.ones(2, S, dtype=torch.bool, device=device)
pad[1, :2] = False
with torch.no_grad():
    ep = torch.export.export(model, (x, pad))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{workdir}/{case}.pt2")
    print("compiled", flush=True)
    loaded = torch._inductor.aoti_load_package(path)
    print("loaded", flush=True)
    got = loaded(x, pad)
    want = model(x, pad)
print("maxdiff", (got - want).abs().max().item(), flush=True)
"""


def print_backtrace(case: str, device: str, workdir: str, out: Path | None) -> None:
    script = Path(workdir) / "child.py"
    script.write_text(CHILD)
    gdb = ["cuda-gdb", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 25"]
    done = subprocess.run(
        [*gdb, "--args", sys.executable, str(script), case, device, workdir],
        capture_output=True,
        text=True,
        timeout=400,
    )
    frames = [line for line in done.stdout.split("\n") if line.startswith("#")]
    if out is not None:
        (out / f"aoti_{case}_gdb.log").write_text(done.stdout + "\n---- stderr\n" + done.stderr)
    print(f"aoti {case} backtrace:", *frames[:25], sep="\n  ", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", default=None, help="folder for each case's full log")
    parser.add_argument(
        "--backtrace", action="store_true", help="native backtrace of crashed cases (cuda-gdb)"
    )
    args = parser.parse_args()
    out = Path(args.out) if args.out else None
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known {list(CASES)}")
    with tempfile.TemporaryDirectory() as workdir:
        procs = {
            case: subprocess.Popen(
                [sys.executable, "-c", CHILD, case, args.device, workdir],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for case in cases
        }
        for case, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=540)
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"aoti_{case}.log").write_text(stdout + "\n---- stderr\n" + stderr)
            stages = " ".join(line for line in stdout.split("\n") if line)
            tail = " | ".join(stderr.strip().split("\n")[-3:]) if proc.returncode else ""
            print(f"aoti {args.device} {case}: rc {proc.returncode}; {stages}; {tail}"[:600], flush=True)
            if args.backtrace and proc.returncode < 0:
                print_backtrace(case, args.device, workdir, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
