"""How much of a causal attention kernel's time its tile order loses at the end (no GPU needed).

List scheduling as the sm_90a kernels do it: `ctas` CTAs, CTA c starts with tile c and each then
takes the next tile in order when it is free (the forward's atomic counter; the backward's grid,
which the hardware hands out in linear order). A tile with n key (or query) tiles of work costs
a n + b us (measured: `hopper_fwd_check --sweep` or `--trace`). Prints the makespan against the
ideal (all work spread evenly) for the order head after head, each head longest first (head
group 1), and for groups of G heads ordered longest first across the group
(csrc/ops/cuda/hopper/tile_order.h).

    python benchmarks/schedule_sim.py                 # B4 H16 S4096: forward D=128, D=64, backward
    python benchmarks/schedule_sim.py --a 1.2 --b 3   # another cost fit
"""

import argparse
import heapq
import math


def makespan(costs, ctas):
    free = [(0.0, c) for c in range(ctas)]
    heapq.heapify(free)
    for cost in costs:
        t, c = heapq.heappop(free)
        heapq.heappush(free, (t + cost, c))
    return max(t for t, _ in free)


def grouped(work_per_head, heads, group):
    """Tile work in longest_first's order: groups of `group` heads, longest first within each."""
    order = []
    for first in range(0, heads, group):
        tiles = [w for _ in range(first, min(heads, first + group)) for w in work_per_head]
        order += sorted(tiles, reverse=True)
    return order


def report(name, work_per_head, heads, ctas, a, b, groups):
    work = [w for w in sorted(work_per_head, reverse=True)]
    ideal = sum(a * w + b for w in work) * heads / ctas
    print(f"{name}: ideal {ideal:.1f} us")
    for group in groups:
        span = makespan([a * w + b for w in grouped(work, heads, group)], ctas)
        print(f"  head group {group:3d}: {span:7.1f} us, {100 * (span / ideal - 1):4.1f}% over the ideal")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ctas", type=int, default=132)
    parser.add_argument("--heads", type=int, default=64, help="batch x heads (default 4 x 16)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument(
        "--a", type=float, default=1.59, help="us per key tile of the D=128 forward (H100 fit)"
    )
    parser.add_argument("--b", type=float, default=4.0, help="fixed us per tile (H100 fit)")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    s, blocks = args.seq, args.seq // 128
    # Forward D=128: 128-row tiles; tile m sees m + 1 key tiles of 128.
    report(
        "forward D=128", [m + 1 for m in range(blocks)], args.heads, args.ctas, args.a, args.b, args.groups
    )
    # Forward D=64: 192-row tiles (3 consumer warpgroups), 3/4 of the D=128 cost per key tile.
    rows = 192
    fwd64 = [math.ceil(min(rows * (m + 1), s) / 128) for m in range(math.ceil(s / rows))]
    report("forward D=64", fwd64, args.heads, args.ctas, 0.75 * args.a, args.b, args.groups)
    # Backward: key tile n of 128 keys sees the query tiles of 64 rows from row 128 n on; the cost
    # per query tile is the forward's per key tile scaled by the measured kernels' work ratio
    # (1336 / 487 us for the same causal attention).
    bwd = [(s - 128 * n) // 64 for n in range(blocks)]
    scale = (1336 / 487) * sum(m + 1 for m in range(blocks)) / sum(bwd)
    report("backward D=128", bwd, args.heads, args.ctas, scale * args.a, args.b, args.groups)


if __name__ == "__main__":
    main()
