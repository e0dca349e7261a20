"""Summarise Nsight Compute's per-instruction page (`ncu --import REP --page source --csv
--print-source sass`, as `benchmarks/profile.sh generic` writes ncu_generic_*_sass.csv): for each
kernel, its warp instructions, shared-memory wavefronts and bank conflicts, the instruction mix
by opcode, the warp-stall mix, and the hottest instructions with their main stall reasons.

    python benchmarks/sass_counts.py ncu_generic_ours_sass.csv ncu_generic_flash_sass.csv [--top 30]

No dependencies beyond the standard library: the CSVs come back from the GPU host, where ncu is,
and are read here, where it is not.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def kernels(path: str) -> list[dict]:
    """The kernels of one CSV: {"name", "header", "rows"} each, rows as dicts by column name."""
    found: list[dict] = []
    header: list[str] | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                found.append({"name": row[1], "header": [], "rows": []})
                header = None
            elif row[0] == "Address" and found:
                header = found[-1]["header"] = row
            elif header is not None:
                found[-1]["rows"].append(dict(zip(header, row, strict=False)))
    return found


def opcode(source: str) -> str:
    """The SASS opcode without its predicate and modifiers: '@!P0 LDSM.16.M88.4 ...' -> 'LDSM'."""
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split(" ")[0].split(".")[0]


def summarise(kernel: dict, top: int) -> None:
    rows, header = kernel["rows"], kernel["header"]
    executed = [number(r.get("Instructions Executed", "")) for r in rows]
    print(f"== {kernel['name'][:160]}")
    print(
        f"  {sum(executed) / 1e6:.1f}M warp instructions, {sum(number(r.get('# Samples', '')) for r in rows):.0f} samples"
    )
    for column in ("L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive", "L1 Conflicts Shared N-Way"):
        if column in header:
            print(f"  {column}: {sum(number(r[column]) for r in rows) / 1e6:.1f}M")
    mix: collections.Counter = collections.Counter()
    for r, n in zip(rows, executed, strict=False):
        mix[opcode(r["Source"])] += n
    print("  opcodes: " + ", ".join(f"{op} {n / 1e6:.1f}M" for op, n in mix.most_common(24)))
    stalls = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    totals = {c: sum(number(r[c]) for r in rows) for c in stalls}
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
    print("  stalls: " + ", ".join(f"{c[6:]} {100 * v / whole:.0f}%" for c, v in ranked))
    samples = [number(r.get("# Samples", "")) for r in rows]
    hottest = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    for i in sorted(hottest):
        r = rows[i]
        reasons = sorted(((number(r[c]), c[6:]) for c in stalls), reverse=True)[:3]
        why = " ".join(f"{c}:{v:.0f}" for v, c in reasons if v)
        print(f"  {i:6d} {samples[i]:7.0f} {executed[i] / 1e6:7.2f}M  {r['Source'].strip()[:60]:60s} {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--top", type=int, default=30, help="hottest instructions listed per kernel")
    args = parser.parse_args()
    for path in args.csv:
        for kernel in kernels(path):
            summarise(kernel, args.top)


if __name__ == "__main__":
    main()
