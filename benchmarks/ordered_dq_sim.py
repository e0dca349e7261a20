"""What an ordered dQ reduction would cost the sm_90a dK/dV kernel under causality (no GPU needed).

The deterministic backward now recomputes S and dP in a dQ pass of its own (7 products to the
default's 5; benchmarks/notes_attention_cuda.md, "Hopper backward"). The alternative keeps dQ in
the dK/dV kernel and makes its additions bit-reproducible by their order: each (head, query step)
takes the key tiles' dQ tiles in one fixed order, a CTA waiting (a counter in global memory) until
the tile before it in that order has been added, then adding its own (a bulk reduce-add, waited
for) and passing the turn on. This simulates that against today's unordered additions:

  - a CTA per (key tile n, head): a fixed cost `--fixed` (K and V in, dK and dV out) and one step
    of `--step` us per 64-row query step it sees (causal: steps 2n .. S/64 - 1), CTAs started in
    launch order on `--ctas` SMs as they free up (list scheduling, as the hardware hands out a grid);
  - ordered: the add of step m by key tile n waits for key tile n + 1's add of the same step
    (ranks descending in the key tile: CTA n + 1 reached that step one step earlier, so a column's
    CTAs side by side form a wavefront), takes `--add` us (the reduce-add's completion and the
    counter's hand-off), and a CTA cannot stage step k's dQ before its add of step k - 2 is done
    (two stage buffers); with --inline the consumers wait for the turn and the add themselves. A CTA waits on larger key tiles, so they must be launched first (a
    longest-first grid could fill every SM with waiters: a deadlock once a head has more key tiles
    than there are SMs); the launch orders compared are all heads' last key tile first ("n-major")
    and each head's key tiles from its last to its first, head after head ("head-major");
  - or ("bottom-up") the shipped longest-first grid, each CTA walking its column from the last
    query step up to the diagonal with ranks ascending (key tile n waits for n - 1, launched
    before it: no deadlock); then every CTA of a column starts at the same step and CTA n's adds
    trail CTA 0's by n adds;
  - or ("deferred") that walk with the add issued by a consumer thread as bwd_kernel.cuh does: a
    step's dQ is stored at its end and added at the next step's add point (after its S^T and dP^T
    are issued), where the thread first waits for its previous add to complete and passes that
    turn on, then waits for this add's turn: a turn passes two add points after its step.

    python benchmarks/ordered_dq_sim.py                      # B4 H16 S4096 D=64 (H200 fit)
    python benchmarks/ordered_dq_sim.py --seq 32768 --heads 16
"""

import argparse
import heapq


def schedule(ctas, order, duration_of):
    """Start each CTA of `order` on the first free SM; duration_of(cta, start) -> its end time
    (which may depend on CTAs started before it). Returns the makespan."""
    free = [0.0] * ctas
    heapq.heapify(free)
    end = 0.0
    for cta in order:
        start = heapq.heappop(free)
        finish = duration_of(cta, start)
        heapq.heappush(free, finish)
        end = max(end, finish)
    return end


def simulate(args, ordered, launch):
    key_tiles = args.seq // 128
    steps_total = args.seq // 64
    heads = range(args.heads)
    if launch in (None, "bottom-up", "deferred"):  # longest first, as shipped
        order = [(n, h) for n in range(key_tiles) for h in heads]
    elif launch == "n-major":
        order = [(n, h) for n in reversed(range(key_tiles)) for h in heads]
    else:
        order = [(n, h) for h in heads for n in reversed(range(key_tiles))]
    added = {}  # (n, h, m) -> time the add of step m by key tile n completed

    bottom_up = launch in ("bottom-up", "deferred")

    def duration_deferred(cta, start):
        # The consumer's own thread, the add deferred as today's: at each step's add point it waits
        # for its last add to complete, passes that step's turn on (released), waits for this step's
        # turn (key tile n - 1's release) and issues this step's add.
        # As bwd_kernel.cuh does it: a step's dQ is stored at its end and added at the next step's
        # add point (add_pending), where the add before it is also passed on (pass_turn).
        n, h = cta
        t = start + args.fixed / 2
        first = 0 if args.full else 2 * n
        walk = list(range(steps_total - 1, first - 1, -1))
        held, held_m, stored_m = None, None, None  # the add in flight; the dQ stored, not added
        for m in [*walk, None]:
            if m is not None:
                t += args.step / 2  # S^T and dP^T issued: the add point
            if held is not None:
                t = max(t, held)
                added[(n, h, held_m)] = t  # passed on
                held = None
            if stored_m is not None:
                t = max(t, added.get((n - 1, h, stored_m), 0.0))
                held, held_m = t + args.add, stored_m
            if m is not None:
                t += args.step / 2
            stored_m = m
        if held is not None:
            t = max(t, held)
            added[(n, h, held_m)] = t
        return t + args.fixed / 2

    def duration(cta, start):
        if launch == "deferred":
            return duration_deferred(cta, start)
        n, h = cta
        t = start + args.fixed / 2  # K and V loaded
        done = []
        first = 0 if args.full else 2 * n
        walk = range(steps_total - 1, first - 1, -1) if bottom_up else range(first, steps_total)
        for k, m in enumerate(walk):
            t += args.step
            if ordered:
                if k >= 2:  # its stage buffer: step k - 2's add done
                    t = max(t, done[k - 2])
                if bottom_up:  # ranks ascending: key tile n - 1 (launched before) adds first
                    turn = added.get((n - 1, h, m), 0.0)
                else:
                    turn = added.get((n + 1, h, m), 0.0) if args.full or m // 2 >= n + 1 else 0.0
                finish = max(t, turn) + args.add
                if args.inline:  # a consumer thread waits for the turn and the add: its warpgroup too
                    t = finish
                added[(n, h, m)] = finish
                done.append(finish)
        end = t + args.fixed / 2
        return max(end, done[-1]) if done else end

    return schedule(args.ctas, order, duration)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctas", type=int, default=132)
    parser.add_argument("--heads", type=int, default=64, help="batch x heads (default 4 x 16)")
    parser.add_argument("--seq", type=int, default=4096)
    # The H200 fit at D=64 (B4 H16 S4096 causal: 2048 CTAs, 67584 steps, the kernel 809 us).
    parser.add_argument("--step", type=float, default=1.45, help="us per 64-row query step")
    parser.add_argument("--fixed", type=float, default=3.0, help="us per CTA: K and V in, dK and dV out")
    parser.add_argument(
        "--add", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0], help="us per ordered add"
    )
    parser.add_argument("--full", action="store_true", help="no causality: every key tile sees every step")
    parser.add_argument(
        "--inline",
        action="store_true",
        help="the consumer warpgroup itself waits for its turn and its add's completion (as today's "
        "add is issued by a consumer thread), not a warp of the producer's",
    )
    args = parser.parse_args()
    base = simulate(args, False, None)
    print(f"S={args.seq}, {args.heads} heads, {args.ctas} SMs: unordered (longest first) {base:.0f} us")
    for launch in ("n-major", "head-major", "bottom-up", "deferred"):
        if launch not in ("bottom-up", "deferred"):
            t = simulate(args, False, launch)
            print(f"  unordered, {launch:10s} (the launch order's own cost): {t:.0f} us ({t / base:.2f}x)")
        for add in args.add:
            args_add = argparse.Namespace(**{**vars(args), "add": add})
            t = simulate(args_add, True, launch)
            print(f"  ordered, {launch:10s} add {add:.1f} us: {t:.0f} us ({t / base:.2f}x)")


if __name__ == "__main__":
    main()
