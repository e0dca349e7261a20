"""A short CUDA attention workload to run under Nsight Compute (benchmarks/profile.sh attention).

Prefill (default): the benchmark's shape (B=4, H=16, S=4096, bf16) at one head dim, forward and
backward with `is_causal`, then with a dense causal + left-padding bool mask, `--calls` times each,
so that `ncu -k regex:attention --launch-skip ... --launch-count ...` finds warm kernels of every
kind (forward, backward rows pre-pass, dK/dV, dQ, mask summary).

Decode (`--decode KV`): one decode step (Q=1, Hq=32, bf16; `--decode-batch` B, default 8,
`--decode-kv-heads` Hkv, default 4, `--head-dim` D) over a full cache of KV keys, as `bench decode`
times it; `--impl` "safeattn" (the serving API), "SDPA cuDNN" or "SDPA flash". The step after the
warm calls runs in the NVTX range "profiled".

`--bias 1H|B1`: the prefill shape with is_causal and a learnable bf16 bias, `[1, H, S, S]` or
`[B, 1, S, S]`, whose gradient the backward computes (as the sweep's bias cases): forward and
backward `--calls` times (`ncu -k regex:bwd_kernel --launch-skip 1 --launch-count 1` takes the
second dK/dV kernel).

`--generic`: safeattn's generic kernels (mma.sync, what A100 / Ada run) forced on an H100/H200
(`safeattn._testing.generic_kernels`), to set beside `--peer flash` (FlashAttention-2).

`--peer flash`: the prefill `is_causal` call through SDPA's flash backend (FlashAttention-2)
instead, the peer's kernels to set beside ours (`ncu -k regex:flash_bwd_dq_dk_dv ...`).

`--case NAME`: one case of the sweep (`python -m safeattn bench attention --sweep`), picked by a
part of its name such as "S=32768 B=1 H=16:16 D=128 chunk512", built as the sweep builds it;
`--impl` picks the implementation (default safeattn; "Flex", "SDPA cuDNN", ...), `--forward-only`
leaves out the backward.

`--deterministic`: the calls under `torch.use_deterministic_algorithms(True)` (the backward's dQ in
its own pass instead of float32 additions).

`--table` also prints the per-kernel device times (torch.profiler) of the last call of each kind,
a narrow line per kernel.

    python benchmarks/profile_attention.py [--head-dim 128] [--calls 2] [--decode KV [--decode-batch B] [--decode-kv-heads H]] [--bias 1H|B1]
        [--generic] [--peer flash] [--deterministic] [--table] [--case NAME [--impl NAME] [--forward-only]]
"""

from __future__ import annotations

import argparse
import contextlib

import safeattn
import torch
from safeattn import _testing
from torch.profiler import ProfilerActivity, profile


def device_us(event):
    """An event's own device time in us (self_device_time_total; self_cuda_time_total before torch 2.4)."""
    if hasattr(event, "self_device_time_total"):
        return event.self_device_time_total
    return event.self_cuda_time_total


def print_kernels(prof, title, rows=14):
    """The profiled call's GPU kernels, a narrow line each (us, share, calls, the name's start),
    longest first, under `-- title`: narrow so that an output cut to its tail keeps every figure."""
    events = sorted((e for e in prof.key_averages() if device_us(e) > 0), key=device_us, reverse=True)
    total = sum(device_us(e) for e in events)
    print(f"-- {title}: {total:.1f} us on the GPU")
    for e in events[:rows]:
        name = e.key.replace("void ", "").replace("safeattn::cuda::", "")
        print(f"{device_us(e):10.1f} us {100 * device_us(e) / total:5.1f}% x{e.count:<3d} {name[:90]}")


def prefill(head_dim, calls, table, peer=None, bias=None):
    batch, heads, seq = 4, 16, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = (
        rand(batch, heads, seq, head_dim),
        rand(batch, heads, seq, head_dim),
        rand(batch, heads, seq, head_dim),
    )
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    pad = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
    pad[::2, : seq // 8] = False  # left padding on every other sequence
    mask = safeattn.sdpa_mask(batch, seq, seq, padding_mask=pad)
    if peer == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for _ in range(calls):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out, (q, k, v), grad)
        return
    cases = ({"is_causal": True}, {"attn_mask": mask})
    leaves = ()
    if bias is not None:
        shape = (1, heads, seq, seq) if bias == "1H" else (batch, 1, seq, seq)
        learnable = (
            (torch.randn(*shape, device="cuda", generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
        )
        cases, leaves = ({"is_causal": True, "attn_mask": learnable},), (learnable,)
    for kwargs in cases:
        for _ in range(calls):
            out, _ = safeattn.attention(q, k, v, **kwargs)
            torch.autograd.grad(out, (q, k, v, *leaves), grad)
        if table:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out, _ = safeattn.attention(q, k, v, **kwargs)
                torch.autograd.grad(out, (q, k, v, *leaves), grad)
                torch.cuda.synchronize()
            print_kernels(prof, f"prefill D={head_dim} {sorted(kwargs)}{f' bias {bias}' if bias else ''}")


def decode(kv_len, calls, table, impl="safeattn", batch=8, kv_heads=4, head_dim=128):
    """One decode step (Q=1, Hq=32, bf16) as `bench decode` times it: safeattn through the serving
    API on a [B, S, Hkv, D] cache, or an SDPA backend ("SDPA cuDNN", "SDPA flash") on [B, Hkv, S, D]
    with enable_gqa. The last call runs inside the NVTX range "profiled" (`ncu --nvtx --nvtx-include
    profiled/` takes every kernel of that one step, whatever the backend names them)."""
    from safeattn.serving import attention_with_kvcache
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq = 32
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q = rand(batch, 1, hq, head_dim)
    k_cache, v_cache = rand(batch, kv_len, kv_heads, head_dim), rand(batch, kv_len, kv_heads, head_dim)
    seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    if impl == "safeattn":

        def step():
            attention_with_kvcache(q, k_cache, v_cache, seqlens)

    else:
        backend = {"SDPA cuDNN": SDPBackend.CUDNN_ATTENTION, "SDPA flash": SDPBackend.FLASH_ATTENTION}[impl]
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k_cache, v_cache))

        def step():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    with torch.no_grad():
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profiled")
        step()
        torch.cuda.nvtx.range_pop()
        if table:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print_kernels(prof, f"decode B={batch} KV={kv_len} Hkv={kv_heads} D={head_dim} {impl}")


def sweep_case(name, impl_name, calls, table, forward_only):
    from safeattn import _bench_sweep as sweep

    matches = [c for c in sweep.sweep_cases() if name in c.name]
    if len(matches) != 1:
        raise SystemExit(
            f"--case {name!r} matches {len(matches)} sweep cases: {[c.name for c in matches][:8]}"
        )
    case = matches[0]
    impl = sweep.build(case, "cuda", torch.bfloat16)[0][impl_name]
    if isinstance(impl, str):
        raise SystemExit(f"{impl_name} cannot run {case.name}: {impl}")
    backward = not forward_only

    def make():
        q = torch.randn(case.batch, case.heads, case.seq, case.head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(
                case.batch, case.kv_heads, case.seq, case.head_dim, device="cuda", dtype=torch.bfloat16
            )
            for _ in range(2)
        )
        return (q.requires_grad_(backward), k.requires_grad_(backward), v.requires_grad_(backward))

    q, k, v = make()
    grad = torch.randn_like(q)

    def step():
        with torch.set_grad_enabled(backward):
            out = impl.fn(q, k, v)
            if backward:
                torch.autograd.grad(out, (q, k, v, *impl.leaves), grad)

    for _ in range(calls):
        step()
    if table:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print_kernels(prof, f"{case.name} {impl_name} {'fwd' if forward_only else 'fwd+bwd'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--decode", type=int, default=0, metavar="KV")
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--decode-kv-heads", type=int, default=4)
    parser.add_argument("--bias", choices=["1H", "B1"], default=None)
    parser.add_argument("--generic", action="store_true")
    parser.add_argument("--peer", choices=["flash"], default=None)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--case", default=None, metavar="NAME")
    parser.add_argument("--impl", default="safeattn")
    parser.add_argument("--forward-only", action="store_true")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(args.deterministic, warn_only=True)
    with _testing.generic_kernels() if args.generic else contextlib.nullcontext():
        if args.case:
            sweep_case(args.case, args.impl, args.calls, args.table, args.forward_only)
        elif args.decode:
            decode(
                args.decode,
                args.calls,
                args.table,
                args.impl,
                args.decode_batch,
                args.decode_kv_heads,
                args.head_dim,
            )
        else:
            prefill(args.head_dim, args.calls, args.table, args.peer, args.bias)
    torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()
