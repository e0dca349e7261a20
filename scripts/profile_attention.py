"""A short CUDA attention workload to run under Nsight Compute (gpu_check.sh's `profile` stage).

The benchmark's prefill shape (B=4, H=16, S=4096, bf16) at one head dim: forward and backward with
`is_causal`, then with a dense causal + left-padding bool mask, `--calls` times each, so that
`ncu -k regex:attention --launch-skip ... --launch-count ...` finds warm kernels of every kind
(forward, backward rows pre-pass, dK/dV, dQ, mask summary).

    python scripts/profile_attention.py [--head-dim 128] [--calls 2]
"""

from __future__ import annotations

import argparse

import safeattn
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    batch, heads, seq, dim = 4, 16, 4096, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = rand(batch, heads, seq, dim), rand(batch, heads, seq, dim), rand(batch, heads, seq, dim)
    grad = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    pad = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
    pad[::2, : seq // 8] = False  # left padding on every other sequence
    mask = safeattn.sdpa_mask(batch, seq, seq, padding_mask=pad)
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        for _ in range(args.calls):
            out, _ = safeattn.attention(q, k, v, **kwargs)
            torch.autograd.grad(out, (q, k, v), grad)
    torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()
