"""Context-parallel attention across processes: a correctness check and a timing against the peers.

  python scripts/dist_check.py --device cpu --world 2                       # gloo, CPU
  NCCL_NVLS_ENABLE=0 python scripts/dist_check.py --device cuda --world 2   # NCCL, one GPU a rank

Starts `--world` processes (torch.multiprocessing, one process group) and, for each sequence
length, times on every rank (causal attention, zigzag / head-tail layout, random inputs):

  one device          safeattn.attention over the whole sequence on each rank alone (the baseline)
  safeattn CP         safeattn.distributed.context_parallel_attention, each rank 1/world of it
  torch CP (flash)    torch's context_parallel over F.scaled_dot_product_attention, SDPA's
  torch CP (cuDNN)    flash / cuDNN backend (CUDA only: on CPU it has no path, see below)
  safeattn CP, pad    causal + 10% left padding, and a causal sliding window of 1/8 of the
  safeattn CP, window sequence: masks torch's context_parallel does not take

Forward and forward+backward, milliseconds (median of the repeats, the slowest rank) and TFLOP/s
per rank (causal work: half the dense 4*B*H*S^2*D, the backward 2.5x the forward, split over the
ranks). --check first compares both rings' output and gradients with the one-device result.
Rows a peer cannot run print n/a and the reason once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device: str, repeats: int, warmup: int) -> float:
    """Median over repeats of the slowest rank's time for fn(); the ranks start together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _measure(run, inputs, grad, device: str, args):
    """(forward ms, forward+backward ms, [out, grads] of one call when --check) of run(leaves)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    check = None
    if args.check:
        out = run(leaves)
        out.backward(grad)
        check = [out.detach()] + [t.grad for t in leaves]
        for t in leaves:
            t.grad = None
    fwd = _time_ms(lambda: run(leaves), device, args.repeats, args.warmup)
    fwd_bwd = _time_ms(lambda: run(leaves).backward(grad), device, args.repeats, args.warmup)
    return fwd, fwd_bwd, check


def _torch_context_parallel(mesh, tensors, backend):
    """torch's context_parallel over SDPA with `backend`; yields the SDPA call on this rank's shards."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    buffers = [t.detach().clone() for t in tensors]
    stack = contextlib.ExitStack()
    stack.enter_context(
        context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers), no_restore_buffers=set(buffers)
        )
    )
    stack.enter_context(sdpa_kernel([kind]))
    return stack, buffers


def _rows(args, rank, world, device, seq):
    import safeattn
    from safeattn import distributed as sd
    from torch.distributed.device_mesh import init_device_mesh

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(seq)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, h, d = args.batch, args.heads, args.head_dim
    q, k, v, grad_out = (randn(b, h, seq, d) for _ in range(4))
    padding = torch.ones(b, seq, dtype=torch.bool, device=device)
    padding[:, : seq // 10] = False

    def shard(t, dim=2):
        return sd.shard_sequence(t, dim, layout="zigzag").contiguous()

    local = [shard(t) for t in (q, k, v)]
    local_grad = shard(grad_out)

    def one_device():
        def run(leaves):
            return safeattn.attention(*leaves, is_causal=True)[0]

        return run, [q, k, v], grad_out

    def ours(**kwargs):
        def run(leaves):
            return sd.context_parallel_attention(*leaves, layout="zigzag", is_causal=True, **kwargs)[0]

        return run, local, local_grad

    candidates = {
        "one device": one_device(),
        "safeattn CP": ours(),
        "torch CP (flash)": "flash",
        "torch CP (cuDNN)": "cudnn",
        "safeattn CP, pad": ours(padding_mask=shard(padding, 1)),
        "safeattn CP, window": ours(sliding_window=max(1, seq // 8)),
    }
    mesh = init_device_mesh(device, (world,))
    flops = 4 * b * h * seq * seq * d / 2  # causal forward
    rows, notes, checks = [], {}, {}
    for name, spec in candidates.items():
        stack = contextlib.nullcontext()
        try:
            if isinstance(spec, str):  # torch's context_parallel with this SDPA backend
                stack, buffers = _torch_context_parallel(mesh, (q, k, v), spec)

                def sdpa(leaves):
                    return F.scaled_dot_product_attention(*leaves, is_causal=True)

                spec = (sdpa, buffers, local_grad)
            with stack:
                fwd, fwd_bwd, checks[name] = _measure(*spec, device, args)
        except Exception as error:  # noqa: BLE001  a peer that cannot run this row
            notes[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            rows.append((name, None, None, None, None))
            continue
        if "pad" in name or "window" in name:  # less work than the causal count: no rate
            rows.append((name, fwd, fwd_bwd, None, None))
            continue
        parts = 1 if name == "one device" else world
        rows.append((name, fwd, fwd_bwd, flops / parts / fwd / 1e9, 3.5 * flops / parts / fwd_bwd / 1e9))
    errors = {}
    if args.check and checks.get("one device") is not None:
        whole = checks["one device"]
        for name, got in checks.items():
            if name == "one device" or "pad" in name or "window" in name:
                continue
            errors[name] = max(
                (sd.unshard_sequence(g.contiguous(), 2, layout="zigzag").float() - w.float())
                .abs()
                .max()
                .item()
                for g, w in zip(got, whole, strict=True)
            )
    return rows, notes, errors


def _worker(rank: int, args, init_file: str) -> None:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group(
        _BACKENDS[device], init_method=f"file://{init_file}", rank=rank, world_size=args.world
    )
    try:
        if rank == 0:
            print(
                f"{args.world} ranks, {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), "
                f"torch {torch.__version__}, {args.dtype}, B={args.batch} H={args.heads} D={args.head_dim}, causal"
            )
            print(
                "| S | row | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |\n|---|---|---|---|---|---|"
            )
        all_notes = {}
        for seq in args.seq:
            rows, notes, errors = _rows(args, rank, args.world, device, seq)
            all_notes.update(notes)
            if rank == 0:
                for name, fwd, fwd_bwd, tf, tf_bwd in rows:
                    if fwd is None:
                        print(f"| {seq} | {name} | n/a | n/a | | |")
                    elif tf is None:
                        print(f"| {seq} | {name} | {fwd:.2f} | {fwd_bwd:.2f} | | |")
                    else:
                        print(f"| {seq} | {name} | {fwd:.2f} | {fwd_bwd:.2f} | {tf:.3g} | {tf_bwd:.3g} |")
                for name, err in errors.items():
                    print(
                        f"  check S={seq}: {name} max |difference| from one device (out, dq, dk, dv): {err:.3g}"
                    )
        if rank == 0:
            for name, note in all_notes.items():
                print(f"  n/a {name}: {note}")
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", help="global sequence lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--check", action="store_true", help="compare each ring with the one-device result first"
    )
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.seq = args.seq or ([8192, 32768] if cuda else [1024, 4096])
    args.heads = args.heads or (16 if cuda else 4)
    args.head_dim = args.head_dim or (128 if cuda else 64)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if cuda and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs, found {torch.cuda.device_count()}")
    init_file = tempfile.mktemp(prefix="safeattn-dist-check-")
    try:
        mp.spawn(_worker, args=(args, init_file), nprocs=args.world)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(init_file)


if __name__ == "__main__":
    main()
