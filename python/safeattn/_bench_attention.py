"""safeattn.attention against F.scaled_dot_product_attention, forward and forward+backward.

Peers, measured in the same run on fresh random data (median of repeats):
  none    no mask                                       (PyTorch CPU: flash kernel)
  causal  is_causal=True                                (flash)
  bool    bool mask (causal + left padding, [1,1,S,S])   (PyTorch picks its backend)
  bias    float bias [1,H,S,S] that requires grad        (PyTorch: math path, O(S^2) memory)

  python -m safeattn bench attention --device cpu --threads 2

With --device cuda (H100 / H200) it prints a markdown table for bf16 B=4 H=16 S=4096 (--batch,
--heads and --seq change it: a table for each length), D 64 and 128, forward and forward+backward
TFLOP/s (causal work counted as half of the dense work, the backward as 2.5x the forward, as
FlashAttention counts), all in the same run:
  SDPA flash, is_causal      sdpa_kernel(FLASH_ATTENTION)
  SDPA cuDNN, is_causal      sdpa_kernel(CUDNN_ATTENTION)
  SDPA, causal+padding mask  a dense [B,1,S,S] bool mask, PyTorch's default backend choice
  Flex, causal+padding       compiled FlexAttention with the same mask as a block mask
  safeattn, is_causal / causal+padding mask (the dense mask) / causal+padding described
                             (MaskDescription(padding_mask=...): is_causal plus a key mask)
(--bias: float masks and a learnable bias instead, _bias_cases), and a decode table (Q=1, KV
4096 and 32768, B=8, GQA 32:4, D=128): microseconds and the K/V bytes read per second, against
SDPA (enable_gqa), SDPA flash and FlexAttention where they run.
CUDA events around each call, warm-up first, median of many calls, fresh random inputs for
every call. Rows a peer cannot run (or safeattn's forward+backward before the CUDA backward
exists) print n/a.

  python -m safeattn bench attention --device cuda [--quick]

Both devices end with the host time of one call on a tiny decode step (B=1, Hq=8, Hkv=2, Q=1,
KV=16, D=64, no gradient): back-to-back calls, no synchronisation inside the loop, so on the GPU
it is the time the host needs to queue a call (the call overhead a decode loop pays per layer),
against SDPA with enable_gqa and safeattn's mask builder at the same size (``--overhead``: only
that table). ``--markdown`` also prints the README's tables from the same measurements.

The sweep over sequence length (``python -m safeattn bench --op attention``) takes its case from
``sweep_case`` below. The GPU sweep over length, head dim, GQA and mask against the best peer of
each case, with the design's targets checked (``--sweep``), is ``_bench_sweep.py``: it times with
``attempt_ms`` and compiles Flex with ``compiled_flex`` from here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import statistics
import time

import torch
import torch.nn.functional as F

import safeattn

from ._bench import Case, Settings, markdown_table

KINDS = ("none", "causal", "bool", "bias")
# (batch, heads, sequence lengths) by device when --batch / --heads / --seq are left out.
SHAPE_DEFAULTS = {"cpu": (1, 8, (512, 2048)), "cuda": (4, 16, (4096,))}


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


def cpu_description():
    """The CPU model, its bf16 / fp16 matrix hardware and the safeattn kernel variant in use: the
    CPU attention's speed depends on them (bf16 tiles run on AVX512-BF16 or AMX), and the
    project's machines differ from one stretch of work to the next."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0].splitlines()
        fields = dict(line.split(":", 1) for line in first_cpu if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        model = fields.get("model name")
        if model and "cpu family" in fields:  # a VM may show only "AMD EPYC": the family tells more
            model += f", family {fields['cpu family']} model {fields.get('model', '?')}"
    except (OSError, ValueError):
        pass
    flags = {}
    try:
        flags = torch._C._cpu._get_cpu_capability()
    except AttributeError:  # older torch
        pass
    model = model or flags.get("cpu_name") or "unknown CPU"
    names = ("avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16")
    have = [n for n in names if flags.get(n)]
    lack = [n for n in names if n in flags and not flags.get(n)]
    hardware = f"has {', '.join(have) or 'none of the bf16/fp16 matrix flags'}"
    if lack:
        hardware += f"; lacks {', '.join(lack)}"
    variant = safeattn.build_info()["cpu_isa_in_use"]
    tiles = "" if torch.backends.mkldnn.enabled else " (oneDNN disabled: float32 tiles)"
    return f"CPU: {model} ({hardware}); safeattn CPU kernels {variant}{tiles}"


def ours(q, k, v, **kwargs):
    return safeattn.attention(q, k, v, **kwargs)[0]


def sdpa(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# ---- the sweep over sequence length (python -m safeattn bench --op attention) -------------


def sweep_case(seq: int, mode: str, s: Settings) -> Case:
    batch, heads, head_dim = 1, 8, 64
    backward = mode == "fwd+bwd"
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device=s.device, dtype=s.dtype).requires_grad_(backward)
        for _ in range(3)
    )
    pad = torch.ones(batch, seq, dtype=torch.bool)
    pad[:, : seq // 8] = False  # left padding: causal + padding mask, the first rows empty
    mask = safeattn.sdpa_mask(batch, seq, seq, padding_mask=pad).to(s.device)
    grad_out = torch.randn(batch, heads, seq, head_dim, device=s.device, dtype=s.dtype)

    def run(fn):
        if not backward:

            def forward():
                with torch.no_grad():
                    return fn()

            return forward
        # autograd.grad rather than .backward(): nothing accumulates into .grad between repeats.
        return lambda: torch.autograd.grad(fn(), (q, k, v), grad_out)

    impls = {
        "safeattn": run(lambda: safeattn.attention(q, k, v, attn_mask=mask)[0]),
        "sdpa (bool mask)": run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        # No padding: PyTorch's flash path, the ceiling for a causal mask without a tensor.
        "sdpa (is_causal, no padding)": run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    # Nominal FLOPs of the two matmuls (not halved for causal, the same for every peer); the
    # backward does 2.5x the forward's.
    flops = 4 * batch * heads * seq * seq * head_dim * (3.5 if backward else 1.0)
    return Case("attention", seq, mode, impls, work=flops)


# ---- the fixed shapes of the README's tables (python -m safeattn bench attention) ---------


# ---- CUDA ------------------------------------------------------------------------------------


def _cuda_median_ms(fn, make_inputs, repeats, warmup):
    """Median milliseconds of fn(*make_inputs()) between CUDA events; inputs are made (outside
    the timed span) fresh for every call."""
    for _ in range(warmup):
        fn(*make_inputs())
    spans = []
    for _ in range(repeats):
        args = make_inputs()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        spans.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in spans)


def attempt_ms(fn, make_inputs, repeats, warmup):
    """(median ms, None), or (None, why) for a call that cannot run here: a backend that refuses
    the case (SDPA's reason is the warning it gives before "No available kernel"), a compile
    failure, out of memory."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _cuda_median_ms(fn, make_inputs, repeats, warmup), None
        except Exception as err:  # noqa: BLE001 - a peer that cannot run here (backend, compile) is n/a
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
            # Inductor says "backend='inductor' raised:" and the cause on the next line.
            reason = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
            if isinstance(err, torch.cuda.OutOfMemoryError):
                reason = "out of memory"
            elif "No available kernel" in reason or "No viable backend" in reason:
                # SDPA warns "<backend> kernel not used because:", then the reasons (each message
                # ends with where in ATen it was raised).
                said = [
                    re.sub(r"\s*\(Triggered internally at .*", "", str(w.message)).strip() for w in caught
                ]
                said = [line.splitlines()[0] for line in said if line]
                reason = " ".join(said[:3]) if said else reason
    torch.cuda.empty_cache()
    return None, reason[:160]


def _try_ms(fn, make_inputs, repeats, warmup):
    ms, reason = attempt_ms(fn, make_inputs, repeats, warmup)
    if reason is not None:
        print(f"  (n/a: {reason[:120]})", flush=True)
    return ms


@functools.cache
def compiled_flex():
    """torch.compile(flex_attention, dynamic=False), made once per process. Dynamo compiles it
    again for every new shape, mask_mod and score_mod (one kernel per mask, as its users get),
    and past its recompile limit (8 per function) it would run flex_attention eagerly, the
    scores materialised: a sweep needs many more, so the limits are raised."""
    from torch.nn.attention.flex_attention import flex_attention

    for name in (
        "recompile_limit",
        "cache_size_limit",
        "accumulated_recompile_limit",
        "accumulated_cache_size_limit",
    ):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4096))
    return torch.compile(flex_attention, dynamic=False)


def _has_cuda_backward():
    return torch._C._dispatch_has_kernel_for_dispatch_key("safeattn::_attention_backward", "CUDA")


def _prefill_cases(batch, heads, seq, device, window=0, softcap=0.0, sinks=False):
    """name -> (callable(q, k, v), needs_backward_kernel_of_safeattn). window > 0: the masked
    rows' mask is a causal sliding window of that many keys (with the padding) instead of
    causality, and the is_causal rows are left out. softcap > 0 / sinks: every safeattn row
    with that softcap (Gemma 2) / per-head sink logits (GPT-OSS); SDPA has neither and is left
    out, Flex takes the softcap as a score_mod (no sinks: then it is left out too), and a row
    with the same mask as a float one shows the mma.sync kernels (what such calls took before
    the sm_90a kernels had softcaps and sinks)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pad = torch.ones(batch, seq, dtype=torch.bool, device=device)
    for b in range(batch):
        pad[b, : b * seq // 8] = False  # left padding: 0, S/8, 2S/8, ... per batch
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if window:
        causal &= torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1 - window)
    dense = causal[None, None] & pad[:, None, None, :]  # [B, 1, S, S]
    rule = f"window {window}+padding" if window else "causal+padding"

    def sdpa_with(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return run

    extra = {}
    if softcap > 0:
        extra["softcap"] = softcap
    if sinks:
        extra["sinks"] = torch.randn(heads, device=device)
    cases = {}
    if not window and not extra:  # SDPA has no softcap or sinks
        cases["SDPA flash, is_causal"] = (sdpa_with(SDPBackend.FLASH_ATTENTION), False)
        cases["SDPA cuDNN, is_causal"] = (sdpa_with(SDPBackend.CUDNN_ATTENTION), False)
    if not extra:
        cases[f"SDPA, {rule} mask"] = (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
            False,
        )
    try:
        if sinks:
            raise RuntimeError("no sinks in flex_attention")
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            keep = (kv_idx <= q_idx) & pad[b, kv_idx]
            return keep & (q_idx - kv_idx < window) if window else keep

        def capped(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

        block_mask = create_block_mask(mask_mod, batch, None, seq, seq, device=device)
        flex = compiled_flex()
        score_mod = capped if softcap > 0 else None
        cases[f"Flex (compiled), {rule}"] = (
            lambda q, k, v: flex(q, k, v, block_mask=block_mask, score_mod=score_mod),
            False,
        )
    except Exception as err:  # noqa: BLE001 - older torch, or no block-mask support here
        print(f"  (FlexAttention n/a: {err})")
    if not window:
        cases["safeattn, is_causal"] = (
            lambda q, k, v: safeattn.attention(q, k, v, is_causal=True, **extra)[0],
            True,
        )
        if not extra:
            cases[DETERMINISTIC_CASE] = cases["safeattn, is_causal"]  # timed with deterministic algorithms on
    cases[f"safeattn, {rule} mask"] = (
        lambda q, k, v: safeattn.attention(q, k, v, attn_mask=dense, **extra)[0],
        True,
    )
    if extra:
        float_mask = torch.zeros(dense.shape, device=device).masked_fill_(~dense, float("-inf"))
        cases[f"safeattn, {rule} float mask (mma.sync)"] = (
            lambda q, k, v: safeattn.attention(q, k, v, attn_mask=float_mask, **extra)[0],
            True,
        )
    # The same mask, undrawn: is_causal, a key mask and (a window) key ranges.
    described = safeattn.MaskDescription(padding_mask=pad, sliding_window=window or None)
    cases[f"safeattn, {rule} described"] = (
        lambda q, k, v: safeattn.attention(q, k, v, attn_mask=described, **extra)[0],
        True,
    )
    return cases


def _bias_cases(batch, heads, seq, device):
    """name -> (callable(q, k, v), needs_backward_kernel_of_safeattn) for float masks (--bias):
    the causal+padding mask as a [B, 1, S, S] bf16 mask of 0 / -inf (what Transformers' eager
    and sdpa paths build; no gradient), and a learnable per-head bias [1, H, S, S] (ALiBi / T5
    style, bf16, requires grad) under causality, against SDPA with the same masks (its
    memory-efficient kernel) and compiled Flex with the bias as a score_mod over the causal
    block mask."""
    pad = torch.ones(batch, seq, dtype=torch.bool, device=device)
    for b in range(batch):
        pad[b, : b * seq // 8] = False
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    dense = causal[None, None] & pad[:, None, None, :]
    float_mask = torch.zeros(dense.shape, device=device, dtype=torch.bfloat16).masked_fill_(
        ~dense, float("-inf")
    )
    bias = (torch.randn(1, heads, seq, seq, device=device) * 0.5).to(torch.bfloat16).requires_grad_()
    # SDPA takes no is_causal with a mask: its own leaf with causality drawn in (a view of `bias`
    # would be freed by the first timed backward).
    causal_bias = bias.detach().masked_fill(~causal, float("-inf")).requires_grad_()
    cases = {
        "SDPA, causal+padding float mask": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask),
            False,
        ),
        "SDPA, causal + learnable bias": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias),
            False,
        ),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        def padded_causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & pad[b, kv_idx]

        def plain_causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + bias[0, h, q_idx, kv_idx]

        flex = compiled_flex()
        padded_blocks = create_block_mask(padded_causal, batch, None, seq, seq, device=device)
        causal_blocks = create_block_mask(plain_causal, None, None, seq, seq, device=device)
        cases["Flex (compiled), causal+padding block mask"] = (
            lambda q, k, v: flex(q, k, v, block_mask=padded_blocks),
            False,
        )
        cases["Flex (compiled), causal + learnable bias"] = (
            lambda q, k, v: flex(q, k, v, block_mask=causal_blocks, score_mod=add_bias),
            False,
        )
    except Exception as err:  # noqa: BLE001 - older torch, or no block-mask support here
        print(f"  (FlexAttention n/a: {err})")
    cases["safeattn, causal+padding float mask"] = (
        lambda q, k, v: safeattn.attention(q, k, v, attn_mask=float_mask)[0],
        True,
    )
    cases["safeattn, causal + learnable bias"] = (
        lambda q, k, v: safeattn.attention(q, k, v, attn_mask=bias, is_causal=True)[0],
        True,
    )
    return cases


def _window_pairs(batch, seq, window):
    """The (query, key) pairs a causal window of `window` keys leaves visible under the left
    padding _prefill_cases uses, summed over the batch."""
    total = 0
    for b in range(batch):
        n = seq - b * seq // 8  # the row's tokens after its padding
        w = min(window, n)
        total += w * (w + 1) // 2 + (n - w) * w
    return total


def _cuda_repeats(args):
    """(timed calls, warm-up calls) per CUDA case: few with --quick."""
    return (5, 2) if args.quick else (args.repeats_cuda, 5)


def _cuda_prefill(args, batch, heads, seq, dtypes):
    """The prefill table at (batch, heads, seq): every case of each head dim and dtype, forward and
    forward+backward, with the ratios against SDPA flash; returns its rows."""
    device = "cuda"
    repeats, warmup = _cuda_repeats(args)
    has_bwd = _has_cuda_backward()
    work = (
        f"a causal window of {args.window} keys: its visible pairs"
        if args.window
        else "causal work counted as half"
    )
    print(f"### Prefill: B={batch} H={heads} S={seq}, {work}")
    print()
    dtype_column = len(dtypes) > 1
    print(
        "| case | D |"
        + (" dtype |" if dtype_column else "")
        + " fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd vs flash | fwd+bwd vs flash |"
    )
    print("|---|---|" + ("---|" if dtype_column else "") + "---|---|---|---|---|---|")
    prefill_rows = []
    for head_dim, dtype in [(d, t) for d in args.head_dim for t in dtypes]:  # D 64 and 128 by default
        flops_fwd = 4 * batch * heads * seq * seq * head_dim / 2
        if args.window:  # the window's own work: its visible (query, key) pairs, padding out
            flops_fwd = 4 * heads * head_dim * _window_pairs(batch, seq, args.window)
        if args.bias:
            cases = _bias_cases(batch, heads, seq, device)
        else:
            cases = _prefill_cases(batch, heads, seq, device, args.window, args.softcap, args.sinks)
        if args.generic_kernels:  # the FlashAttention-2 peer and safeattn's rows
            cases = {
                name: case
                for name, case in cases.items()
                if (name.startswith("SDPA flash") or name.startswith("safeattn"))
                and name != DETERMINISTIC_CASE
            }
        flash_fwd = flash_both = None
        for name, (fn, is_ours) in cases.items():
            results = []
            for backward in (False, True):
                if backward and is_ours and not has_bwd:
                    results.append(None)
                    continue

                def make(backward=backward, head_dim=head_dim, dtype=dtype):
                    qkv = [
                        torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype).requires_grad_(
                            backward
                        )
                        for _ in range(3)
                    ]
                    if backward:
                        qkv.append(torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype))
                    return qkv

                def run(q, k, v, grad=None, fn=fn):
                    out = fn(q, k, v)
                    if grad is not None:
                        out.backward(grad)

                with torch.set_grad_enabled(backward), _deterministic(name == DETERMINISTIC_CASE):
                    results.append(_try_ms(run, make, repeats, warmup))
            fwd_ms, both_ms = results
            if name.startswith("SDPA flash"):
                flash_fwd, flash_both = fwd_ms, both_ms

            def cell(ms, flops):
                return ("n/a", "n/a") if ms is None else (f"{ms:.3f}", f"{flops / ms / 1e9:.0f}")

            f_ms, f_tf = cell(fwd_ms, flops_fwd)
            b_ms, b_tf = cell(both_ms, 3.5 * flops_fwd)
            ratio = "n/a" if fwd_ms is None or flash_fwd is None else f"{flash_fwd / fwd_ms:.2f}x"
            ratio_both = "n/a" if both_ms is None or flash_both is None else f"{flash_both / both_ms:.2f}x"
            dtype_cell = f" {str(dtype).replace('torch.', '')} |" if dtype_column else ""
            print(
                f"| {name} | {head_dim} |{dtype_cell} {f_ms} | {f_tf} | {b_ms} | {b_tf} | {ratio} | {ratio_both} |",
                flush=True,
            )
            prefill_rows.append([name, head_dim, f_ms, f_tf, b_ms, b_tf])
    return prefill_rows


def main_cuda(args):
    """Prints the prefill table of each --seq (B=--batch, H=--heads) and the decode table; returns
    their rows for the README's tables (a prefill case is named with its S when there are several)."""
    device = "cuda"
    repeats, warmup = _cuda_repeats(args)
    dtypes = [getattr(torch, name) for name in args.cuda_dtype]
    shown = ", ".join(str(d).replace("torch.", "") for d in dtypes)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {shown}, median of {repeats} calls")
    if args.generic_kernels:
        print(
            "safeattn on its generic kernels (mma.sync: what A100 / Ada / Blackwell run), against SDPA flash"
        )
    if not _has_cuda_backward():
        print("safeattn forward+backward: n/a (no CUDA kernel for _attention_backward in this build)")
    prefill_rows = []
    for seq in args.seq:
        print()
        rows = _cuda_prefill(args, args.batch, args.heads, seq, dtypes)
        if len(args.seq) > 1:
            rows = [[f"{row[0]} (S={seq})", *row[1:]] for row in rows]
        prefill_rows += rows
    decode_rows = []
    if args.generic_kernels:
        return prefill_rows, decode_rows
    print()
    batch, hq, hkv, head_dim, dtype = 8, 32, 4, 128, torch.bfloat16
    print(f"### Decode: Q=1, B={batch}, Hq={hq}, Hkv={hkv}, D={head_dim} (GB/s: K and V bytes read)")
    print()
    print("| case | KV | us | GB/s |")
    print("|---|---|---|---|")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        flex = compiled_flex()
    except ImportError:
        flex = None
    for kv_len in (4096, 32768):

        def make(kv_len=kv_len):
            q = torch.randn(batch, hq, 1, head_dim, device=device, dtype=dtype)
            k = torch.randn(batch, hkv, kv_len, head_dim, device=device, dtype=dtype)
            v = torch.randn(batch, hkv, kv_len, head_dim, device=device, dtype=dtype)
            return q, k, v

        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        cases = {
            "SDPA (enable_gqa)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            "SDPA flash (enable_gqa)": flash,
        }
        if flex is not None:
            cases["Flex (compiled, enable_gqa)"] = lambda q, k, v: flex(q, k, v, enable_gqa=True)
        cases["safeattn"] = lambda q, k, v: safeattn.attention(q, k, v, enable_gqa=True)[0]
        kv_bytes = 2 * batch * hkv * kv_len * head_dim * 2
        for name, fn in cases.items():
            with torch.no_grad():
                ms = _try_ms(fn, make, repeats * 4, warmup)
            cells = ("n/a", "n/a") if ms is None else (f"{ms * 1e3:.1f}", f"{kv_bytes / ms / 1e6:.0f}")
            print(f"| {name} | {kv_len} | {cells[0]} | {cells[1]} |", flush=True)
            decode_rows.append([name, kv_len, *cells])
    return prefill_rows, decode_rows


# The deterministic backward (torch.use_deterministic_algorithms(True)): the dQ kernel instead of
# atomic dQ adds.
DETERMINISTIC_CASE = "safeattn, is_causal, deterministic"


@contextlib.contextmanager
def _deterministic(on):
    """torch.use_deterministic_algorithms(True) for the duration when `on`."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if on:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def call_overhead(device):
    """Host microseconds per call of a tiny decode step (best of 7 rounds of back-to-back calls),
    float32 on the CPU, bf16 on the GPU (what its kernels take; float32 there as one more row):
    prints the table, returns its rows."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 8, 1, 64, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, 16, 64, device=device, dtype=dtype) for _ in range(2))
    pad = torch.ones(1, 16, dtype=torch.bool, device=device)
    cases = {
        "safeattn.attention": lambda: safeattn.attention(q, k, v, enable_gqa=True),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "safeattn.sdpa_mask (padding)": lambda: safeattn.sdpa_mask(1, 1, 16, 15, padding_mask=pad),
    }
    if device == "cuda":
        q32, k32, v32 = (t.float() for t in (q, k, v))
        cases["safeattn.attention, float32 (no kernel: ATen ops)"] = lambda: safeattn.attention(
            q32, k32, v32, enable_gqa=True
        )
    print()
    print(
        f"### Call overhead on {device}: host us per call, tiny decode step ({str(dtype)[6:]}), no gradient"
    )
    print()
    print("| call | us |")
    print("|---|---|")
    calls = 2000
    rows = []
    for name, fn in cases.items():
        with torch.no_grad():
            for _ in range(200):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = float("inf")
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best = min(best, (time.perf_counter() - t0) / calls * 1e6)
                if device == "cuda":
                    torch.cuda.synchronize()
        print(f"| {name} | {best:.1f} |", flush=True)
        rows.append([name, f"{best:.1f}"])
    return rows


def main_cpu(args):
    """Prints the CPU table; returns its rows (dtype, S, D, mask, pass, safeattn ms, SDPA ms)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(
        f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, B={args.batch} H={args.heads}"
    )
    if args.device == "cpu":
        print(cpu_description())
    header = f"{'dtype':<9}{'S':>6}{'D':>5}  {'mask':<7}{'pass':<8}{'safeattn ms':>12}{'SDPA ms':>10}{'speedup':>9}"
    print(header)
    print("-" * len(header))
    rows = []
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
                        rows.append((dtype_name, seq, head_dim, kind, label, t_ours, t_sdpa))
    return rows


_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def readme_tables(tables: dict) -> str:
    """The README's tables, from the rows measured above (same numbers): CPU, one row per (dtype,
    S, D, mask) with both passes as "safeattn / SDPA (SDPA / safeattn)" in ms; CUDA, the prefill
    table without the ratio column and the decode table with a column pair per cache length;
    then the call overhead."""
    out = []
    if "cpu" in tables:
        rows = {}
        for dtype_name, seq, head_dim, kind, label, t_ours, t_sdpa in tables["cpu"]:
            key = (_DTYPE_SHORT.get(dtype_name, dtype_name), seq, head_dim, kind)
            rows.setdefault(key, {})[label] = f"{t_ours:.2f} / {t_sdpa:.2f} ({t_sdpa / t_ours:.2f}x)"
        header = ["dtype", "S", "D", "mask", "fwd: safeattn / SDPA", "fwd+bwd: safeattn / SDPA"]
        out.append(
            markdown_table(header, [[*key, cells["fwd"], cells["fwd+bwd"]] for key, cells in rows.items()])
        )
    if "prefill" in tables:
        header = ["case", "D", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s"]
        out.append(markdown_table(header, tables["prefill"]))
    if tables.get("decode"):  # not measured with --generic-kernels
        kv_lengths = list(dict.fromkeys(row[1] for row in tables["decode"]))
        decode = {}
        for name, kv_len, us, gbs in tables["decode"]:
            decode.setdefault(name, {})[kv_len] = [us, gbs]
        header = ["case"] + [cell for kv in kv_lengths for cell in (f"KV={kv} us", "GB/s")]
        out.append(
            markdown_table(
                header,
                [[name] + [c for kv in kv_lengths for c in cells[kv]] for name, cells in decode.items()],
            )
        )
    if tables.get("overhead"):
        out.append(markdown_table(["call", "us"], tables["overhead"]))
    return "\n\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"batch (default: {SHAPE_DEFAULTS['cpu'][0]} on the CPU, "
        f"{SHAPE_DEFAULTS['cuda'][0]} with --device cuda; its prefill table)",
    )
    parser.add_argument(
        "--heads",
        type=int,
        default=None,
        help=f"heads (default: {SHAPE_DEFAULTS['cpu'][1]} on the CPU, "
        f"{SHAPE_DEFAULTS['cuda'][1]} with --device cuda)",
    )
    parser.add_argument(
        "--seq",
        type=int,
        nargs="+",
        default=None,
        help="sequence lengths (default: "
        f"{' '.join(map(str, SHAPE_DEFAULTS['cpu'][2]))} on the CPU, {SHAPE_DEFAULTS['cuda'][2][0]} with "
        "--device cuda: a prefill table each)",
    )
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument(
        "--dtype", nargs="+", default=["bfloat16", "float32"], help="CPU dtypes (CUDA: --cuda-dtype)"
    )
    parser.add_argument(
        "--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="CPU masks (CUDA: its fixed cases)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="CPU repeats (CUDA: --repeats-cuda)")
    parser.add_argument(
        "--repeats-cuda", type=int, default=30, help="timed calls per case with --device cuda"
    )
    parser.add_argument(
        "--quick", action="store_true", help="--device cuda: few calls per case (a smoke run)"
    )
    parser.add_argument("--overhead", action="store_true", help="only the call-overhead table")
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        help="--device cuda: the masked rows with a causal sliding window of this many keys (and "
        "the padding) instead of causality; TFLOP/s count the window's visible pairs",
    )
    parser.add_argument(
        "--softcap",
        type=float,
        default=0.0,
        help="--device cuda: every safeattn row with this softcap (Flex: the same as a score_mod)",
    )
    parser.add_argument(
        "--sinks", action="store_true", help="--device cuda: every safeattn row with per-head sink logits"
    )
    parser.add_argument(
        "--bias",
        action="store_true",
        help="--device cuda: float masks instead (a [B,1,S,S] causal+padding one, a learnable [1,H,S,S] bias)",
    )
    parser.add_argument(
        "--cuda-dtype",
        nargs="+",
        default=["bfloat16"],
        choices=["bfloat16", "float16"],
        help="--device cuda: the dtypes of the prefill table",
    )
    parser.add_argument(
        "--generic-kernels",
        action="store_true",
        help="--device cuda: safeattn on its generic kernels (those of A100 / Ada / Blackwell) on an "
        "H100/H200, against SDPA flash (FlashAttention-2); prefill table only",
    )
    parser.add_argument("--markdown", action="store_true", help="also print the README's tables")
    from . import _bench_sweep

    _bench_sweep.add_arguments(parser)


def resolve_shape(args: argparse.Namespace) -> None:
    """--batch, --heads and --seq left out take their device's defaults (SHAPE_DEFAULTS); a value
    below 1 is refused, naming the argument."""
    batch, heads, seqs = SHAPE_DEFAULTS[args.device]
    args.batch = batch if args.batch is None else args.batch
    args.heads = heads if args.heads is None else args.heads
    args.seq = list(seqs) if args.seq is None else args.seq
    for name, values in (("--batch", [args.batch]), ("--heads", [args.heads]), ("--seq", args.seq)):
        if any(v < 1 for v in values):
            raise SystemExit(f"bench attention: {name} must be at least 1, got {values}")


def run(args: argparse.Namespace) -> int:
    if args.sweep or args.dry_run or args.report:
        from . import _bench_sweep

        return _bench_sweep.run(args)
    resolve_shape(args)
    tables = {}
    if args.overhead:
        torch.set_num_threads(args.threads)
        tables["overhead"] = call_overhead(args.device)
    elif args.device == "cuda" and args.generic_kernels:
        from . import _testing

        with _testing.generic_kernels():
            tables["prefill"], _ = main_cuda(args)
    elif args.device == "cuda":
        tables["prefill"], tables["decode"] = main_cuda(args)
        tables["overhead"] = call_overhead("cuda")
    else:
        tables["cpu"] = main_cpu(args)
        tables["overhead"] = call_overhead(args.device)
    if args.markdown:
        print(f"\nREADME tables (attention, {args.device}):\n")
        print(readme_tables(tables))
    return 0
