"""How much of a causal attention kernel's time its tile order loses at the end (no GPU needed).

List scheduling as the sm_90a kernels do it: `ctas` CTAs, CTA c starts with tile c and each then
takes the next tile in order when it is free (the forward's atomic counter; the backward's grid,
which the hardware hands out in linear order). A tile with n key (or query) tiles of work costs
a n + b us (measured: `hopper_fwd_check --sweep` or `--trace`). Prints the makespan against the
ideal (all work spread evenly) for the order head after head, each head longest first (head
group 1), and for groups of at most G heads ordered longest first across the group, among them
the group head_group_for picks (csrc/ops/cuda/tile_order.h, mirrored here).

    python benchmarks/schedule_sim.py                 # B4 H16 S4096: forward D=128, D=64, backward
    python benchmarks/schedule_sim.py --a 1.2 --b 3   # another cost fit
    python benchmarks/schedule_sim.py --sweep         # head_group_for's rule over many shapes
"""

import argparse
import heapq
import math
import statistics


def makespan(costs, ctas):
    free = [(0.0, c) for c in range(ctas)]
    heapq.heapify(free)
    for cost in costs:
        t, c = heapq.heappop(free)
        heapq.heappush(free, (t + cost, c))
    return max(t for t, _ in free)


def group_sizes(heads, group):
    """tile_order.h's groups: as few as hold at most `group` heads, as equal as they can be."""
    count = math.ceil(heads / group)
    size, larger = divmod(heads, count)
    return [size + 1] * larger + [size] * (count - larger)


def head_group_for(tiles_per_head, heads, ctas):
    """tile_order.h's rule: the fewest heads whose tiles number at least twice the CTAs."""
    return min(heads, max(1, math.ceil(2 * ctas / tiles_per_head)))


def grouped(work_per_head, heads, group):
    """Tile work in longest_first's order: groups of heads, longest first within each."""
    order = []
    for size in group_sizes(heads, group):
        order += sorted([w for _ in range(size) for w in work_per_head], reverse=True)
    return order


def kernels(seq, a):
    """(name, work per tile of one head, us per unit of work) of the three causal kernels."""
    blocks = seq // 128
    # Forward D=128: 128-row tiles; tile m sees m + 1 key tiles of 128.
    fwd128 = [m + 1 for m in range(blocks)]
    # Forward D=64: 192-row tiles (3 consumer warpgroups), 3/4 of the D=128 cost per key tile.
    fwd64 = [math.ceil(min(192 * (m + 1), seq) / 128) for m in range(math.ceil(seq / 192))]
    # Backward: key tile n of 128 keys sees the query tiles of 64 rows from row 128 n on; the cost
    # per query tile is the forward's per key tile scaled by the measured kernels' work ratio
    # (1336 / 487 us for the same causal attention).
    bwd = [(seq - 128 * n) // 64 for n in range(blocks)]
    scale = (1336 / 487) * sum(fwd128) / sum(bwd)
    return [
        ("forward D=128", fwd128, a),
        ("forward D=64", fwd64, 0.75 * a),
        ("backward D=128", bwd, scale * a),
    ]


def over_ideal(work_per_head, heads, ctas, a, b, group):
    """The makespan of `group`'s order and its excess over the ideal (all work spread evenly)."""
    work = sorted(work_per_head, reverse=True)
    ideal = sum(a * w + b for w in work) * heads / ctas
    span = makespan([a * w + b for w in grouped(work, heads, group)], ctas)
    return span, ideal, 100 * (span / ideal - 1)


def report(args):
    for name, work, a in kernels(args.seq, args.a):
        rule = head_group_for(len(work), args.heads, args.ctas)
        _, ideal, _ = over_ideal(work, args.heads, args.ctas, a, args.b, 1)
        print(f"{name}: ideal {ideal:.1f} us")
        for group in sorted(set(args.groups) | {rule}):
            span, _, excess = over_ideal(work, args.heads, args.ctas, a, args.b, group)
            mark = "  (head_group_for)" if group == rule else ""
            print(f"  head group {group:3d}: {span:7.1f} us, {excess:4.1f}% over the ideal{mark}")


def sweep(args):
    """Head after head, head_group_for's groups and one group of all heads, over many shapes."""
    columns = {"head group 1": [], "head_group_for": [], "all heads": []}
    print("seq heads kernel          " + "".join(f"{c:>16s}" for c in columns))
    for seq in (1024, 2048, 4096, 8192, 16384, 32768):
        for heads in (8, 16, 24, 32, 48, 64, 96, 128, 256):
            if heads * seq > 16 * 65536:
                continue
            for name, work, a in kernels(seq, args.a):
                if heads * len(work) < 4 * args.ctas:  # too few tiles to fill the GPU: no tail to win
                    continue
                groups = (1, head_group_for(len(work), heads, args.ctas), heads)
                row = [over_ideal(work, heads, args.ctas, a, args.b, g)[2] for g in groups]
                for column, value in zip(columns.values(), row, strict=True):
                    column.append(value)
                print(f"{seq:5d} {heads:4d} {name:16s}" + "".join(f"{v:15.1f}%" for v in row))
    for stat, pick in (
        ("mean", statistics.mean),
        ("90th pct", lambda v: sorted(v)[int(0.9 * len(v))]),
        ("max", max),
    ):
        print(f"{stat:27s}" + "".join(f"{pick(v):15.1f}%" for v in columns.values()))


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
    parser.add_argument("--sweep", action="store_true", help="many shapes: head_group_for against the others")
    args = parser.parse_args()
    sweep(args) if args.sweep else report(args)


if __name__ == "__main__":
    main()
