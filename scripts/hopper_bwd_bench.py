"""Forward + backward of safeattn.attention with the sm_90a backward on and off
(SAFEATTN_ATTN_BWD_SM90, read at each call), against SDPA's cuDNN backend, in one process.

    python scripts/hopper_bwd_bench.py

B=4 H=16 S=4096 bf16, Transformers' [B, S, H, D] layout viewed as [B, H, S, D], is_causal; CUDA
events, 2 warm-ups, median of 7; fwd+bwd counted as 3.5 forwards, causal as half. A quick look
for a GPU call; benchmarks/bench_attention.py is the full comparison.
"""

import os
import statistics

import safeattn
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, S = 4, 16, 4096
SWITCH = "SAFEATTN_ATTN_BWD_SM90"


def median_ms(fn, reps=7):
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def run(d):
    q, k, v = (
        torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * B * H * S * S * d * 0.5

    def forward():
        with torch.no_grad():
            safeattn.attention(q, k, v, is_causal=True)

    def forward_backward():
        out, _ = safeattn.attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)

    def report(name, ms, multiple):
        print(f"D={d} {name:28s} {ms:8.3f} ms {multiple * flops / ms / 1e9:7.1f} TFLOP/s", flush=True)

    os.environ.pop(SWITCH, None)
    report("safeattn fwd", median_ms(forward), 1.0)
    report("safeattn fwd+bwd sm90", median_ms(forward_backward), 3.5)
    os.environ[SWITCH] = "0"
    report("safeattn fwd+bwd mma.sync", median_ms(forward_backward), 3.5)
    os.environ.pop(SWITCH)
    try:
        report("SDPA cuDNN fwd+bwd", median_ms(cudnn), 3.5)
    except RuntimeError as e:
        print(f"D={d} cuDNN failed: {e}")


if __name__ == "__main__":
    for head_dim in (128, 64):
        run(head_dim)
