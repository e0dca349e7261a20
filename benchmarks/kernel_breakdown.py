"""Where one forward + backward's GPU time goes, kernel by kernel (torch.profiler, us per call,
mean of 5): SDPA cuDNN is_causal, safeattn is_causal and safeattn with the bench's causal + padding
dense mask ([B, 1, S, S] bool, row b left-padded by b S/8), B=4 H=16 S=4096 bf16, D 128 and 64.
The benchmarks' TFLOP/s include the host and every small kernel; this names them. On the GPU
host, after a build: `python benchmarks/kernel_breakdown.py [--window W] [--bias]` (W > 0: the
masked cases with a causal sliding window of W keys and the padding, as `bench attention --window
W`; --forward: forward calls only; --bias: safeattn's float-mask cases of `bench attention --bias` instead, the causal + padding
[B, 1, S, S] bf16 mask and the learnable [1, H, S, S] bias)."""

import argparse
import collections
import sys

import torch
from safeattn._bench_attention import _bias_cases, _prefill_cases

B, H, S, CALLS = 4, 16, 4096, 5
# The benchmark's own cases (`python -m safeattn bench attention`), so the two time the same calls.
CASES = (
    "SDPA cuDNN, is_causal",
    "safeattn, is_causal",
    "safeattn, {rule} mask",
    "safeattn, {rule} described",
)


def kernel_times(fn, head_dim, backward=True):
    """Kernel name -> us per forward + backward call (forward only with backward=False)."""
    q, k, v = (
        torch.randn(B, H, S, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        for _ in range(3)
    )
    grad = torch.randn(B, H, S, head_dim, device="cuda", dtype=torch.bfloat16)

    def call():
        out = fn(q, k, v)
        if backward:
            out.backward(grad)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / CALLS
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--forward", action="store_true", help="forward calls only (no gradient)")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128, 64])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.bias:
        cases = _bias_cases(B, H, S, "cuda")
        names = [name for name in cases if name.startswith("safeattn")]
    else:
        cases = _prefill_cases(B, H, S, "cuda", args.window)
        rule = f"window {args.window}+padding" if args.window else "causal+padding"
        names = [c.format(rule=rule) for c in CASES]
    for head_dim in args.head_dim:
        for name in names:
            if name not in cases:  # the is_causal rows: not with a window
                continue
            with torch.set_grad_enabled(not args.forward):
                times = kernel_times(cases[name][0], head_dim, backward=not args.forward)
            print(f"== D={head_dim} {name}: total {sum(times.values()):.0f} us")
            for kernel, t in sorted(times.items(), key=lambda x: -x[1])[:10]:
                print(f"   {t:8.1f}  {kernel[:110]}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
