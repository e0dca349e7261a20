"""``python -m safeattn demo``: native masks next to Transformers' masks, with timings."""

from __future__ import annotations

import torch

from . import ops
from ._bench import mask_workload, time_ms


def _draw(mask: torch.Tensor) -> str:
    return "\n".join("    " + " ".join("■" if v else "⬚" for v in row) for row in mask.tolist())


def run_demo(device: str | None = None, quick: bool = False) -> int:
    import transformers
    import transformers.masking_utils as mu

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"safeattn demo on {device} (torch {torch.__version__}, transformers {transformers.__version__})\n")

    pad = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    small = ops.sdpa_mask(1, 6, 6, sliding_window=3, padding_mask=pad)
    print("A sliding-window (3) causal mask with two left-padding tokens, built natively:")
    print(_draw(small[0, 0]))
    print("Rows 0 and 1 attend to nothing: safeattn's softmax and attention give 0 there, not NaN.\n")

    batch, length = (2, 256) if quick else (8, 2048)
    print(f"Prefill masks, B={batch}, Q=KV={length}, half the rows left-padded:")
    print(f"  {'mask':<10}{'transformers ms':>17}{'safeattn ms':>13}{'speed-up':>10}  equal")
    for kind in ("causal", "sliding", "chunked", "packed"):
        ours, theirs = mask_workload(kind, batch, length, device)
        expected = mu.sdpa_mask(**theirs)
        got = ops.sdpa_mask(**ours)
        equal = torch.equal(got, expected.expand_as(got))
        t_theirs = time_ms(lambda theirs=theirs: mu.sdpa_mask(**theirs), device, repeats=5 if quick else 10)
        t_ours = time_ms(lambda ours=ours: ops.sdpa_mask(**ours), device, repeats=5 if quick else 10)
        print(f"  {kind:<10}{t_theirs:>17.3f}{t_ours:>13.3f}{t_theirs / t_ours:>9.1f}x  {'yes' if equal else 'NO'}")
        if not equal:
            return 1
    return 0
