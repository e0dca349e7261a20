"""Decode: one query token a sequence against a KV cache, safeattn against SDPA's backends and FlexAttention.

Each case (batch, cache length, query heads : kv heads, head dim, dtype) times, on fresh random
data, the same attention of one new query token per sequence over a full cache of ``cache``
tokens:

- safeattn.attention_with_kvcache over a contiguous cache ``[B, cache, Hkv, D]`` (FlashAttention's
  layout), and over a paged one (pages of ``--page-size`` tokens, each sequence's pages scattered
  by a shuffled block table);
- SDPA on ``[B, H, 1, D]`` against ``[B, Hkv, cache, D]`` with ``enable_gqa``, once for each
  backend that takes the call (cuDNN, flash, efficient; CUDA), the default choice on the CPU;
- FlexAttention compiled (CUDA; it takes its decoding kernel for a single query row), unless
  ``--no-flex``.

Times are the GPU's time for the kernels (the host kept ahead by a spin kernel), medians of
``--repeats``; bandwidth is the bytes of K and V read over that time, also as a share of the copy
bandwidth (a 1 GiB device-to-device copy, read and write counted; 64 MiB on the CPU) measured in the same run. The
ratio is the fastest peer's time over safeattn's contiguous one (> 1: safeattn is faster);
``paged / contiguous`` the paged cache's time over the contiguous one's. Each case first compares
safeattn's output with SDPA's. Host time: the wall time of one small call (B=1, 1024 keys) with
the GPU idle, averaged over 200 calls, for safeattn and SDPA's default choice.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
import warnings

import torch
import torch.nn.functional as F

from ._bench import machine_name, markdown_table, time_ms

_SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
_QUERY_HEADS = 32


def _sdpa(backend: str | None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return call


_flex_compiled = None


def _flex():
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        # One compiled kernel a shape: the grid's cases would pass dynamo's default recompile
        # limit (8), after which Flex runs unfused.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: _flex_compiled(q, k, v, enable_gqa=True)


def _paged(k_cache: torch.Tensor, v_cache: torch.Tensor, page: int, generator: torch.Generator):
    """The cache as pages of `page` tokens in a shuffled order, and the block table that lists them."""
    batch, length, kv_heads, dim = k_cache.shape
    blocks = math.ceil(length / page)
    order = torch.randperm(batch * blocks, generator=generator).to(k_cache.device)
    table = order.view(batch, blocks).to(torch.int32)
    padded = blocks * page

    def scatter(cache: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(batch, padded, kv_heads, cache.shape[-1], dtype=cache.dtype, device=cache.device)
        full[:, :length] = cache
        pages = torch.empty(
            batch * blocks, page, kv_heads, cache.shape[-1], dtype=cache.dtype, device=cache.device
        )
        pages[order] = full.view(batch * blocks, page, kv_heads, cache.shape[-1])
        return pages

    return scatter(k_cache), scatter(v_cache), table


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second of a device-to-device copy of 1 GiB (64 MiB on the CPU), read plus write."""
    src = torch.empty(1 << (29 if device.type == "cuda" else 25), dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeats=10, gpu_only=device.type == "cuda")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def host_time_us(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Wall time of one small decode call with the GPU idle, averaged over 200 calls."""
    from .serving import attention_with_kvcache

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 8, 64, generator=g).to(device, dtype)
    k = torch.randn(1, 1024, 8, 64, generator=g).to(device, dtype)
    v = torch.randn(1, 1024, 8, 64, generator=g).to(device, dtype)
    seqlens = torch.full((1,), 1024, dtype=torch.int32, device=device)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    calls = {
        "safeattn": lambda: attention_with_kvcache(q, k, v, seqlens),
        "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
    }
    out = {}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / 200 * 1e6
    return out


def measure_case(batch, cache, group, dim, dtype, device, args, generator) -> dict | None:
    """One case's times (ms) by implementation, or None when it does not fit `--max-cache-gib`."""
    from .serving import attention_with_kvcache

    kv_heads = _QUERY_HEADS // group
    cache_bytes = 2 * batch * cache * kv_heads * dim * torch.empty(0, dtype=dtype).element_size()
    if cache_bytes > args.max_cache_gib * 2**30:
        return None

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q = rand(batch, 1, _QUERY_HEADS, dim)
    k_cache, v_cache = rand(batch, cache, kv_heads, dim), rand(batch, cache, kv_heads, dim)
    seqlens = torch.full((batch,), cache, dtype=torch.int32, device=device)
    k_pages, v_pages, table = _paged(k_cache, v_cache, args.page_size, generator)
    # The peers' layout: heads before positions (a copy, made once, outside the timing).
    qt, kt, vt = (
        q.transpose(1, 2).contiguous(),
        k_cache.transpose(1, 2).contiguous(),
        v_cache.transpose(1, 2).contiguous(),
    )

    impls = {
        "safeattn": lambda: attention_with_kvcache(q, k_cache, v_cache, seqlens),
        "safeattn paged": lambda: attention_with_kvcache(q, k_pages, v_pages, seqlens, block_table=table),
    }
    peers = {}
    if device.type == "cuda":
        for backend in _SDPA_BACKENDS:
            peers[f"sdpa {backend.split('_')[0].lower()}"] = _sdpa(backend)
        if not args.no_flex:
            peers["flex"] = _flex()
    else:
        peers["sdpa"] = _sdpa(None)
    reference = _sdpa(None)(qt, kt, vt).transpose(1, 2)
    error = (
        (attention_with_kvcache(q, k_cache, v_cache, seqlens).float() - reference.float()).abs().max().item()
    )
    for name, fn in peers.items():
        try:
            with warnings.catch_warnings():  # each declining backend warns why
                warnings.simplefilter("ignore")
                fn(qt, kt, vt)  # a backend that does not take the call raises here
        except Exception:  # noqa: BLE001 - the backend declines these inputs: no row for it
            continue
        impls[name] = lambda fn=fn: fn(qt, kt, vt)
    ms = {
        name: time_ms(fn, device, repeats=args.repeats, gpu_only=device.type == "cuda")
        for name, fn in impls.items()
    }
    return {
        "batch": batch,
        "cache": cache,
        "gqa": f"{_QUERY_HEADS}:{kv_heads}",
        "dim": dim,
        "dtype": str(dtype).removeprefix("torch."),
        "ms": ms,
        "bytes": cache_bytes,
        "max_error": error,
    }


def _best_peer(row) -> tuple[str, float]:
    peers = {name: t for name, t in row["ms"].items() if not name.startswith("safeattn")}
    name = min(peers, key=peers.get)
    return name, peers[name]


def table_rows(rows: list[dict], copy_bw: float) -> tuple[list[str], list[list]]:
    header = [
        "B",
        "cache",
        "heads",
        "D",
        "dtype",
        "safeattn us",
        "paged us",
        "fastest peer",
        "peer us",
        "safeattn GB/s",
        "% of copy",
        "vs fastest peer",
        "paged / contiguous",
    ]
    out = []
    for r in rows:
        peer, peer_ms = _best_peer(r)
        ours = r["ms"]["safeattn"]
        gbs = r["bytes"] / (ours * 1e-3) / 1e9
        out.append(
            [
                r["batch"],
                r["cache"],
                r["gqa"],
                r["dim"],
                r["dtype"],
                f"{ours * 1e3:.1f}",
                f"{r['ms']['safeattn paged'] * 1e3:.1f}",
                peer,
                f"{peer_ms * 1e3:.1f}",
                f"{gbs:.0f}",
                f"{100 * gbs * 1e9 / copy_bw:.0f}%",
                f"{peer_ms / ours:.2f}x",
                f"{r['ms']['safeattn paged'] / ours:.2f}",
            ]
        )
    return header, out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="default: 1 8 32 128 (CPU: 1 8)")
    parser.add_argument(
        "--cache",
        type=int,
        nargs="+",
        default=None,
        help="cache lengths; default 1024 4096 32768 131072 (CPU: 1024 4096)",
    )
    parser.add_argument(
        "--gqa", type=int, nargs="+", default=[1, 4, 8], help="query heads per kv head (32 query heads)"
    )
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], nargs="+", default=None)
    parser.add_argument(
        "--page-size", type=int, default=256, help="tokens a page of the paged cache (16 to 256)"
    )
    parser.add_argument(
        "--max-cache-gib", type=float, default=16.0, help="skip cases whose K and V take more"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per implementation (default 30, CPU 5)"
    )
    parser.add_argument(
        "--no-flex", action="store_true", help="leave FlexAttention out (its compile takes a while a shape)"
    )
    parser.add_argument("--quick", action="store_true", help="two small cases, few repeats (CI)")
    parser.add_argument("--markdown", action="store_true", help="also print the README's table")


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench decode: --device cuda but no CUDA device is visible")
        return 2
    cpu = device.type == "cpu"
    batches = args.batch or ((1, 2) if args.quick else (1, 8) if cpu else (1, 8, 32, 128))
    caches = args.cache or ((256,) if args.quick else (1024, 4096) if cpu else (1024, 4096, 32768, 131072))
    groups = (4,) if args.quick else args.gqa
    dtypes = [getattr(torch, d) for d in (args.dtype or (["float32"] if cpu else ["bfloat16"]))]
    args.repeats = args.repeats or (3 if args.quick else 5 if cpu else 30)
    where = machine_name() if cpu else torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {where}")
    copy_bw = copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for dtype, dim, group, batch, cache in itertools.product(dtypes, args.head_dim, groups, batches, caches):
        if _QUERY_HEADS % group:
            continue
        row = measure_case(batch, cache, group, dim, dtype, device, args, generator)
        if row is None:
            print(
                f"skipped B={batch} cache={cache} {_QUERY_HEADS}:{_QUERY_HEADS // group}: over --max-cache-gib"
            )
            continue
        if row["max_error"] > (1e-4 if dtype == torch.float32 else 2e-2):
            print(f"WARNING: B={batch} cache={cache}: safeattn differs from SDPA by {row['max_error']:.3g}")
        rows.append(row)
        peer, peer_ms = _best_peer(row)
        print(
            f"B={batch:<4} cache={cache:<7} {row['gqa']:<6} D={dim} {row['dtype']:<9} "
            + "  ".join(f"{name} {t * 1e3:.1f}" for name, t in row["ms"].items())
            + f" us  | vs {peer}: {peer_ms / row['ms']['safeattn']:.2f}x"
        )
    if rows:
        worst = min(rows, key=lambda r: _best_peer(r)[1] / r["ms"]["safeattn"])
        print(
            f"smallest ratio: {_best_peer(worst)[1] / worst['ms']['safeattn']:.2f}x at B={worst['batch']} "
            f"cache={worst['cache']} {worst['gqa']} D={worst['dim']} {worst['dtype']}"
        )
    hosts = host_time_us(device, dtypes[0])
    print("host time per small call: " + ", ".join(f"{name} {us:.1f} us" for name, us in hosts.items()))
    if args.markdown and rows:
        header, body = table_rows(rows, copy_bw)
        print(f"\nREADME table (decode, {where}):\n")
        print(markdown_table(header, body))
    return 0
