"""Benchmark safeattn.attention against F.scaled_dot_product_attention, forward and forward+backward.

Peers, measured in the same run on fresh random data (median of repeats):
  none    no mask                                       (PyTorch CPU: flash kernel)
  causal  is_causal=True                                (flash)
  bool    bool mask (causal + left padding, [1,1,S,S])   (PyTorch picks its backend)
  bias    float bias [1,H,S,S] that requires grad        (PyTorch: math path, O(S^2) memory)

  python benchmarks/bench_attention.py --device cpu --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import safeattn
import torch
import torch.nn.functional as F

KINDS = ("none", "causal", "bool", "bias")


def _inputs(kind, batch, heads, seq, head_dim, dtype, device, backward):
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(backward)
    kwargs = {}
    if kind == "causal":
        kwargs["is_causal"] = True
    elif kind == "bool":
        pad = torch.ones(batch, seq, dtype=torch.bool)
        pad[:, : seq // 8] = False  # left padding
        kwargs["attn_mask"] = safeattn.sdpa_mask(batch, seq, seq, padding_mask=pad).to(device)
    elif kind == "bias":
        bias = torch.randn(1, heads, seq, seq, device=device, dtype=dtype) * 0.1
        kwargs["attn_mask"] = bias.requires_grad_()  # learnable: PyTorch takes its math path
    return (q, k, v), kwargs


def _time(fns, make_inputs, repeats, device, backward):
    """Median milliseconds of each fn; the fns alternate within every repeat so that a shared,
    noisy machine slows them alike."""
    times = [[] for _ in fns]
    for r in range(repeats + 1):  # the first round warms up
        for i, fn in enumerate(fns):
            args, kwargs = make_inputs()
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if backward:
                out.backward(torch.ones_like(out))
            if device == "cuda":
                torch.cuda.synchronize()
            if r > 0:
                times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def ours(q, k, v, **kwargs):
    return safeattn.attention(q, k, v, **kwargs)[0]


def sdpa(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(
        f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, B={args.batch} H={args.heads}"
    )
    header = f"{'dtype':<9}{'S':>6}{'D':>5}  {'mask':<7}{'pass':<8}{'safeattn ms':>12}{'SDPA ms':>10}{'speedup':>9}"
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for seq in args.seq:
            for head_dim in args.head_dim:
                for kind in args.kinds:
                    for backward in (False, True):
                        with torch.set_grad_enabled(backward or kind == "bias"):

                            def make(kind=kind, seq=seq, head_dim=head_dim, dtype=dtype, backward=backward):
                                return _inputs(
                                    kind, args.batch, args.heads, seq, head_dim, dtype, args.device, backward
                                )

                            t_ours, t_sdpa = _time((ours, sdpa), make, args.repeats, args.device, backward)
                        label = "fwd+bwd" if backward else "fwd"
                        print(
                            f"{dtype_name:<9}{seq:>6}{head_dim:>5}  {kind:<7}{label:<8}"
                            f"{t_ours:>12.2f}{t_sdpa:>10.2f}{t_sdpa / t_ours:>8.2f}x",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
