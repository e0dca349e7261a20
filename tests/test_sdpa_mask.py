"""sdpa_mask against Transformers' masking_utils (independent reference), against our own
broadcasting reference, under opcheck and torch.compile, and on bad input."""

import random
import re

import pytest
import safeattn
import torch
import transformers.masking_utils as mu
from conftest import DEVICES
from safeattn import reference

# --------------------------------------------------------------------------- helpers


def random_case(rng: random.Random, device: str, batch_size: int = 3):
    """A random combination of every mask feature, as both our kwargs and Transformers' mask function."""
    q_length = rng.choice([1, 2, 7, 33, 130])
    prefix = rng.choice([0, 0, 5, 64])  # cached tokens before the queries (decode / chunked prefill)
    kv_length = q_length + prefix + rng.choice([0, 0, 3])  # static caches are longer than what was seen
    kv_offset = rng.choice([0, 0, prefix // 2])
    kv_length -= kv_offset
    q_offset = prefix
    total = kv_offset + kv_length
    kwargs = {"causal": rng.random() < 0.7}
    fn = mu.causal_mask_function if kwargs["causal"] else mu.bidirectional_mask_function
    kind = rng.choice(["plain", "sliding", "chunked", "packed", "block", "sliding+packed"])
    if "sliding" in kind:
        w = rng.choice([1, 3, 16])
        kwargs["sliding_window"] = w
        overlay = (
            mu.sliding_window_overlay(w) if kwargs["causal"] else mu.sliding_window_bidirectional_overlay(w)
        )
        fn = mu.and_masks(fn, overlay)
    # Left and right padding, with some rows padded entirely up to a point.
    width = total - rng.choice([0, 0, 2]) if total > 2 else total  # narrower masks are padded with False
    pad = torch.ones(batch_size, width, dtype=torch.bool)
    for b in range(batch_size):
        left = rng.choice([0, 0, 1, min(9, width)])
        pad[b, :left] = False
        if rng.random() < 0.3 and width > 2:
            pad[b, -rng.randint(1, 2) :] = False
    if kind == "chunked":
        c = rng.choice([2, 5, 32])
        left_padding = (pad.cumsum(-1) == 0).sum(-1)
        kwargs["chunk_size"] = c
        kwargs["chunk_left_padding"] = left_padding.to(device)
        fn = mu.and_masks(fn, mu.chunked_overlay(c, left_padding))
    if "packed" in kind:
        length = max(total, q_offset + q_length)
        ids = torch.sort(torch.randint(0, 4, (batch_size, length)), dim=-1).values
        kwargs["packed_ids"] = ids.to(device)
        fn = mu.and_masks(fn, mu.packed_sequence_mask_function(ids))
    if kind == "block":
        length = max(total, q_offset + q_length)
        ids = torch.randint(-1, 3, (batch_size, length))
        kwargs["block_ids"] = ids.to(device)
        fn = mu.or_masks(fn, mu.blockwise_overlay(ids))
    if rng.random() < 0.85:
        kwargs["padding_mask"] = pad.to(device)
    sizes = dict(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset
    )
    return sizes, kwargs, fn


def transformers_mask(sizes, kwargs, fn):
    pad = kwargs.get("padding_mask")
    return mu.sdpa_mask(
        **sizes,
        mask_function=fn,
        attention_mask=None if pad is None else pad.cpu(),
        allow_is_causal_skip=False,
        device="cpu",
    )


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(60))
def test_matches_transformers(device, seed):
    rng = random.Random(seed)
    sizes, kwargs, fn = random_case(rng, device)
    expected = transformers_mask(sizes, kwargs, fn).expand(sizes["batch_size"], 1, -1, -1)
    ours = safeattn.sdpa_mask(**sizes, **kwargs, device=device)
    assert ours.shape == expected.shape, f"shape {ours.shape} != {expected.shape} for {sizes} {kwargs.keys()}"
    assert ours.is_contiguous(), "the mask must be contiguous"
    mismatch = (ours.cpu() != expected).nonzero()
    assert (
        mismatch.numel() == 0
    ), f"{len(mismatch)} elements differ, first at {mismatch[:3].tolist()} for {sizes} {list(kwargs)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(60))
def test_matches_reference(device, seed):
    rng = random.Random(1000 + seed)
    sizes, kwargs, _ = random_case(rng, device)
    expected = reference.sdpa_mask(**sizes, **kwargs)
    ours = safeattn.sdpa_mask(**sizes, **kwargs, device=device)
    assert torch.equal(ours.cpu(), expected.cpu()), f"differs from the reference for {sizes} {list(kwargs)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("use_finfo_min", [False, True])
def test_float_output_matches_eager_mask(device, dtype, use_finfo_min):
    rng = random.Random(7)
    for _ in range(8):
        sizes, kwargs, fn = random_case(rng, device)
        ours = safeattn.sdpa_mask(**sizes, **kwargs, dtype=dtype, use_finfo_min=use_finfo_min, device=device)
        allowed = transformers_mask(sizes, kwargs, fn).expand(sizes["batch_size"], 1, -1, -1)
        blocked = torch.finfo(dtype).min if use_finfo_min else float("-inf")
        expected = torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.tensor(blocked, dtype=dtype))
        assert ours.dtype == dtype, f"dtype {ours.dtype} != {dtype}"
        assert torch.equal(ours.cpu(), expected), f"float mask differs for {sizes} {list(kwargs)}"
        if use_finfo_min:
            # Exactly what Transformers' eager_mask produces.
            pad = kwargs.get("padding_mask")
            eager = mu.eager_mask(
                **sizes, mask_function=fn, attention_mask=None if pad is None else pad.cpu(), dtype=dtype
            )
            assert torch.equal(ours.cpu(), eager.expand_as(ours)), "differs from transformers eager_mask"


@pytest.mark.parametrize("device", DEVICES)
def test_q_positions_forms(device):
    """0-D start, [Q] (4.57's cache_position) and [B, Q] positions give what q_offset gives."""
    pad = torch.tensor(
        [[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool, device=device
    )
    common = dict(batch_size=2, q_length=3, kv_length=9, sliding_window=4, padding_mask=pad, device=device)
    expected = safeattn.sdpa_mask(q_offset=6, **common)
    start = torch.tensor(6, device=device)
    assert torch.equal(safeattn.sdpa_mask(q_positions=start, **common), expected), "0-D q_positions"
    assert torch.equal(
        safeattn.sdpa_mask(q_positions=torch.arange(6, 9, device=device), **common), expected
    ), "[Q]"
    per_batch = torch.arange(6, 9, device=device).expand(2, 3).contiguous()
    assert torch.equal(safeattn.sdpa_mask(q_positions=per_batch, **common), expected), "[B, Q]"
    # Different positions per batch row (ragged decode) against the reference.
    ragged = torch.tensor([[3, 4, 5], [6, 7, 8]], device=device, dtype=torch.int32)
    got = safeattn.sdpa_mask(q_positions=ragged, **common)
    assert torch.equal(got.cpu(), reference.sdpa_mask(q_positions=ragged, **common).cpu()), "ragged positions"


@pytest.mark.parametrize("device", DEVICES)
def test_positions_outside_ids_never_read(device):
    """q_positions past the ids' width: packed matches nothing, block counts as -1 (no out-of-bounds read)."""
    ids = torch.tensor([[0, 0, 1, 1]], device=device)
    pos = torch.tensor([2, 9, -3], device=device)
    for name in ("packed_ids", "block_ids"):
        kwargs = {name: ids, "q_positions": pos, "causal": name == "packed_ids"}
        got = safeattn.sdpa_mask(1, 3, 4, **kwargs, device=device)
        expected = reference.sdpa_mask(1, 3, 4, **kwargs)
        assert torch.equal(got.cpu(), expected.cpu()), f"{name}: {got.int()} vs {expected.int()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_key_ranges_are_the_rule_without_causality(device, seed):
    """MaskDescription.key_ranges (the native safeattn::_key_ranges): each row's [lo, hi), ANDed
    with causality where the description is causal, is exactly the reference's mask row of the
    same window, chunks (with left padding) and packed runs; offsets on both sides, ids reaching
    past the keys, runs ending past kv_length (their rows empty), one id a row."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(40):
        batch, q_len, kv_len = rng.randint(1, 3), rng.randint(1, 70), rng.randint(1, 90)
        q_offset, kv_offset = rng.randint(0, 50), rng.randint(0, 50)
        causal = rng.random() < 0.6
        rules = {}
        if rng.random() < 0.5:
            rules["sliding_window"] = rng.randint(1, 40)
        if rng.random() < 0.4:
            rules["chunk_size"] = rng.randint(1, 25)
            if rng.random() < 0.5:
                rules["chunk_left_padding"] = torch.randint(0, 20, (batch,), generator=gen)
        if rng.random() < 0.5 or not rules:
            width = max(q_offset + q_len, kv_offset + kv_len) + rng.randint(0, 6)
            cuts = torch.rand(batch, width, generator=gen) < rng.random() * 0.4
            rules["packed_ids"] = cuts.long().cumsum(-1) + rng.randint(-3, 3)
        description = safeattn.MaskDescription(causal=causal, packed_ids_are_runs=True, **rules)
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rules.items()}
        ranges = safeattn.MaskDescription(causal=causal, packed_ids_are_runs=True, **on_device).key_ranges(
            batch, q_len, kv_len, q_offset, kv_offset, device=torch.device(device)
        )
        assert ranges.shape == (batch, q_len, 2) and ranges.dtype == torch.int32
        assert ranges.device.type == torch.device(device).type
        ranges = ranges.cpu()
        assert torch.all((ranges >= 0) & (ranges <= kv_len)), "ranges within [0, kv_len]"
        j = torch.arange(kv_len) + kv_offset  # key positions
        i = torch.arange(q_len)[:, None] + q_offset  # query positions
        drawn = (ranges[..., :1] <= j - kv_offset) & (j - kv_offset < ranges[..., 1:])  # [B, Q, KV]
        case = (description, batch, q_len, kv_len, q_offset, kv_offset)
        expected = reference.sdpa_mask(batch, q_len, kv_len, q_offset, kv_offset, causal=causal, **rules)
        assert torch.equal(drawn & (j <= i) if causal else drawn, expected[:, 0]), case
        if causal:
            # Without causality's end: the chunks and runs as drawn without causality, and the
            # causal window's start (kv > q - w) alone.
            others = {name: value for name, value in rules.items() if name != "sliding_window"}
            rule = reference.sdpa_mask(batch, q_len, kv_len, q_offset, kv_offset, causal=False, **others)[
                :, 0
            ]
            if "sliding_window" in rules:
                rule = rule & (j > i - rules["sliding_window"])
            assert torch.equal(drawn, rule), case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_packed_ids_runs_and_returning_ids(device, dtype):
    """Ids that never decrease (runs: the CUDA kernel makes them intervals) next to ids that
    come back after another id or decrease (per-element compare), long enough for the run
    pre-pass to split rows across its threads, with padding, a window and offsets."""
    gen = torch.Generator().manual_seed(7)
    width = 5000
    runs = torch.sort(torch.randint(0, 40, (width,), generator=gen)).values
    returning = torch.randint(0, 3, (width,), generator=gen)  # 0 0 1 0 2 ...: ids come back
    one_run = torch.full((width,), 5)
    decreasing = torch.flip(runs, (0,))
    ids = torch.stack([runs, returning, one_run, decreasing]).to(device)
    pad = torch.rand(4, width, generator=gen) > 0.1
    for kwargs in (
        dict(packed_ids=ids),
        dict(packed_ids=ids, padding_mask=pad.to(device), sliding_window=700),
        dict(packed_ids=ids, causal=False, padding_mask=pad.to(device)),
    ):
        sizes = dict(batch_size=4, q_length=300, kv_length=4000, q_offset=4700, kv_offset=1000)
        got = safeattn.sdpa_mask(**sizes, **kwargs, dtype=dtype, device=device)
        expected = reference.sdpa_mask(**sizes, **kwargs, dtype=dtype)
        assert torch.equal(
            got.cpu(), expected.cpu()
        ), f"differs from the reference for {list(kwargs)} {dtype}"


def test_docstring_example():
    got = safeattn.sdpa_mask(1, 5, 5, sliding_window=3, padding_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    drawn = """
        ⬚ ⬚ ⬚ ⬚ ⬚
        ⬚ ■ ⬚ ⬚ ⬚
        ⬚ ■ ■ ⬚ ⬚
        ⬚ ■ ■ ■ ⬚
        ⬚ ⬚ ■ ■ ■"""
    expected = torch.tensor([[c == "■" for c in line.split()] for line in drawn.strip().splitlines()])
    assert torch.equal(got[0, 0], expected), f"the docstring's drawing is wrong:\n{got[0, 0].int()}"


@pytest.mark.parametrize("device", DEVICES)
def test_empty_and_degenerate_sizes(device):
    for b, q, kv in [(0, 4, 4), (2, 0, 4), (2, 4, 0), (1, 1, 1)]:
        got = safeattn.sdpa_mask(b, q, kv, device=device)
        assert got.shape == (b, 1, q, kv), f"shape for {(b, q, kv)}"
        assert torch.equal(got.cpu(), reference.sdpa_mask(b, q, kv)), f"values for {(b, q, kv)}"


@pytest.mark.slow
def test_isa_variants_agree(tmp_path):
    """The op gives the same mask whichever CPU ISA variant ATen selects (checked in a subprocess,
    since ATen reads ATEN_CPU_CAPABILITY once)."""
    import subprocess
    import sys

    script = (
        "import torch, safeattn, random\n"
        "torch.manual_seed(0)\n"
        "pad = torch.rand(3, 300) > 0.2\n"
        "ids = torch.sort(torch.randint(0, 3, (3, 300)), -1).values\n"
        "m = [safeattn.sdpa_mask(3, 97, 300, 203, sliding_window=50, padding_mask=pad),\n"
        "     safeattn.sdpa_mask(3, 97, 300, 203, chunk_size=16, packed_ids=ids, dtype=torch.bfloat16),\n"
        "     safeattn.sdpa_mask(3, 97, 300, 203, causal=False, block_ids=ids - 1, padding_mask=pad, dtype=torch.float32)]\n"
        "torch.save(m, __import__('sys').argv[1])\n"
    )
    # ATen takes ATEN_CPU_CAPABILITY at its word, even above what the CPU runs (SIGILL on CI's
    # CPU, which has no AVX-512): only the variants this CPU executes are tried.
    isas = safeattn.build_info()["cpu_isas_runnable"]
    if len(isas) < 2:
        pytest.skip(f"one CPU variant runs here ({isas}): nothing to compare")
    results = {}
    for isa in isas:
        path = str(tmp_path / f"isa_{isa}.pt")
        env = dict(__import__("os").environ, ATEN_CPU_CAPABILITY=isa.lower())
        subprocess.run([sys.executable, "-c", script, path], check=True, env=env)
        results[isa] = torch.load(path)
    first = next(iter(results.values()))
    for isa, masks in results.items():
        for a, b in zip(masks, first, strict=True):
            assert torch.equal(a, b), f"ISA variant {isa} differs"


# --------------------------------------------------------------------------- dispatcher integration


def _opcheck_samples(device):
    rng = random.Random(3)
    for _ in range(4):
        sizes, kwargs, _ = random_case(rng, device)
        yield sizes, kwargs
    yield (
        dict(batch_size=2, q_length=5, kv_length=9, q_offset=0, kv_offset=0),
        {"q_positions": torch.tensor(4, device=device)},
    )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for sizes, kwargs in _opcheck_samples(device):
        args = (
            sizes["batch_size"],
            sizes["q_length"],
            sizes["kv_length"],
            sizes["q_offset"],
            sizes["kv_offset"],
        )
        torch.library.opcheck(
            torch.ops.safeattn.sdpa_mask.default, args, dict(kwargs, device=torch.device(device))
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_compile_dynamic_no_recompile(device):
    torch._dynamo.reset()
    counts = {"frames": 0}

    def counting_backend(gm, example_inputs):
        counts["frames"] += 1
        return gm.forward

    def build(pad, q_length, kv_length):
        return safeattn.sdpa_mask(
            pad.shape[0], q_length, kv_length, kv_length - q_length, padding_mask=pad, sliding_window=8
        )

    compiled = torch.compile(build, fullgraph=True, dynamic=True, backend=counting_backend)
    for n in (17, 33, 64, 100):
        pad = torch.rand(2, n, device=device) > 0.2
        got = compiled(pad, n // 2, n)
        assert torch.equal(got, build(pad, n // 2, n)), f"compiled result differs at length {n}"
    assert counts["frames"] == 1, f"compiled {counts['frames']} graphs for 4 lengths, expected 1"


@pytest.mark.slow
def test_compile_inductor_cpu():
    torch._dynamo.reset()

    def build(pad):
        n = pad.shape[1]
        m = safeattn.sdpa_mask(pad.shape[0], n, n, padding_mask=pad, dtype=torch.float32)
        return m + 1.0

    pad = torch.rand(2, 19) > 0.3
    compiled = torch.compile(build, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(pad), build(pad)), "inductor result differs"


def test_no_gradient():
    out = safeattn.sdpa_mask(1, 3, 3, dtype=torch.float32)
    assert not out.requires_grad, "a mask never requires grad"


# --------------------------------------------------------------------------- bad input

BAD = [
    (dict(batch_size=-1), "batch_size must be >= 0"),
    (dict(q_length=-2), "q_length must be >= 0"),
    (dict(kv_length=-2), "kv_length must be >= 0"),
    (dict(kv_offset=-1), "kv_offset must be >= 0"),
    (dict(sliding_window=0), "sliding_window must be > 0"),
    (dict(chunk_size=-4), "chunk_size must be > 0"),
    (dict(dtype=torch.int32), "dtype must be torch.bool or a floating dtype, got Int"),
    (dict(use_finfo_min=True), "use_finfo_min needs a floating dtype"),
    (dict(q_positions=torch.zeros(4)), "q_positions must have an integer dtype, got Float"),
    (dict(q_positions=torch.zeros(1, 1, 4, dtype=torch.long)), "q_positions must be 0-D, \\[q_length\\]"),
    (dict(q_positions=torch.zeros(5, dtype=torch.long)), "q_positions has 5 positions but q_length is 4"),
    (dict(q_positions=torch.zeros(3, 4, dtype=torch.long)), "q_positions must be \\[batch_size, q_length\\]"),
    (dict(q_positions=torch.tensor(1), q_offset=2), "q_offset must be 0 when q_positions is given"),
    (dict(chunk_left_padding=torch.zeros(2, dtype=torch.long)), "chunk_left_padding needs chunk_size"),
    (
        dict(chunk_size=2, chunk_left_padding=torch.zeros(3, dtype=torch.long)),
        "chunk_left_padding must be \\[batch_size\\]",
    ),
    (dict(padding_mask=torch.ones(2, 6)), "padding_mask must be bool or integer, got Float"),
    (dict(padding_mask=torch.ones(2, 6, 1, dtype=torch.bool)), "padding_mask must be 2-D"),
    (dict(padding_mask=torch.ones(3, 6, dtype=torch.bool)), "padding_mask has batch 3 but batch_size is 2"),
    (dict(packed_ids=torch.zeros(2, 6)), "packed_ids must have an integer dtype"),
    (dict(packed_ids=torch.zeros(2, 5, dtype=torch.long)), "packed_ids is too short: 5 positions, needs 6"),
    (dict(packed_ids=torch.zeros(1, 6, dtype=torch.long)), "packed_ids has batch 1 but batch_size is 2"),
    (dict(block_ids=torch.zeros(6, dtype=torch.long)), "block_ids must be 2-D"),
    (
        dict(q_offset=2**63 - 3),
        re.escape("q_offset + q_length must be <= 2**63 - 1, got 9223372036854775805 + 4"),
    ),
    (dict(kv_offset=2**63 - 6), re.escape("kv_offset + kv_length must be <= 2**63 - 1")),
]


def _call(overrides, device=None, fake_mode=None):
    args = dict(batch_size=2, q_length=4, kv_length=6)
    args.update(overrides)
    if device is not None:
        args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        args["device"] = device
    if fake_mode is not None:
        args = {k: (fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return safeattn.sdpa_mask(**args)


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_eager(overrides, message):
    with pytest.raises(RuntimeError, match=message):
        _call(overrides)


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
@pytest.mark.parametrize("mode", ["meta", "fake"])
def test_bad_input_fake(overrides, message, mode):
    """The fake raises the same message: it runs the op's C++ checks (safeattn::_sdpa_mask_check),
    on meta tensors ("meta") and under FakeTensorMode as torch.compile runs it ("fake")."""
    with pytest.raises(RuntimeError, match=message):
        if mode == "meta":
            _call(overrides, device="meta")
        else:
            with torch._subclasses.FakeTensorMode() as fake_mode:
                _call(overrides, fake_mode=fake_mode)


def test_fake_output_matches_kernel():
    """The fake's output (shape, dtype, strides, device) is the CPU kernel's."""
    cases = [
        dict(),
        dict(dtype=torch.float16),
        dict(padding_mask=torch.ones(2, 6, dtype=torch.bool), device="cpu"),
        dict(q_positions=torch.arange(4), packed_ids=torch.zeros(2, 6, dtype=torch.long)),
    ]
    for overrides in cases:
        real = _call(overrides)
        with torch._subclasses.FakeTensorMode() as fake_mode:
            fake = _call(overrides, fake_mode=fake_mode)
        got = (fake.shape, fake.dtype, fake.stride(), fake.device)
        want = (real.shape, real.dtype, real.stride(), real.device)
        assert got == want, f"fake {got} != kernel {want} for {overrides}"


def test_device_mismatch():
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=re.escape("padding_mask is on cpu, expected cuda")):
            safeattn.sdpa_mask(1, 2, 2, padding_mask=torch.ones(1, 2, dtype=torch.bool), device="cuda")
    with pytest.raises(
        RuntimeError, match=re.escape("padding_mask is on meta, expected cpu (from q_positions)")
    ):
        safeattn.sdpa_mask(
            1,
            2,
            2,
            q_positions=torch.tensor(0),
            padding_mask=torch.ones(1, 2, dtype=torch.bool, device="meta"),
        )
    # The fake checks devices too: FakeTensorMode runs the checks on the fake tensors themselves.
    with torch._subclasses.FakeTensorMode() as fake_mode:
        with pytest.raises(
            RuntimeError, match=re.escape("padding_mask is on meta, expected cpu (from q_positions)")
        ):
            safeattn.sdpa_mask(
                1,
                2,
                2,
                q_positions=fake_mode.from_tensor(torch.tensor(0)),
                padding_mask=fake_mode.from_tensor(torch.ones(1, 2, dtype=torch.bool, device="meta")),
            )


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 16 * 2**30,
    reason="needs a CUDA GPU with 16 GiB",
)
def test_more_than_2_pow_31_elements_cuda():
    """B=8, Q=KV=16384: 2^31 elements, so every offset must be 64-bit. Sampled rows are checked
    against the reference (which builds only those rows, through q_positions)."""
    batch, length = 8, 16384
    pad = torch.rand(batch, length, device="cuda") > 0.05
    pad[:, :100] = False  # left padding: fully masked rows at the start
    ids = (torch.arange(length, device="cuda") * 3 // length).expand(batch, length).contiguous()
    got = safeattn.sdpa_mask(batch, length, length, sliding_window=5000, padding_mask=pad, packed_ids=ids)
    assert got.numel() >= 2**31, "the case must cross 2^31 elements"
    rows = torch.tensor([0, 1, 99, 100, 5000, 10922, 10923, length - 2, length - 1], device="cuda")
    expected = reference.sdpa_mask(
        batch, len(rows), length, q_positions=rows, sliding_window=5000, padding_mask=pad, packed_ids=ids
    )
    assert torch.equal(got[:, :, rows].cpu(), expected.cpu()), "sampled rows differ from the reference"
    assert got[-1, 0, -1].sum().item() > 0, "the last row must have been written"


# --------------------------------------------------------------------------- int64 limits

INT64_MAX = 2**63 - 1
_NEAR_LIMITS = [
    # (description, sizes and keywords)
    (
        "kv_offset 2**62, bidirectional",
        dict(batch_size=1, q_length=2, kv_length=3, kv_offset=2**62, causal=False),
    ),
    (
        "both offsets past 2**62",
        dict(batch_size=1, q_length=2, kv_length=3, q_offset=2**62 + 5, kv_offset=2**62 + 1),
    ),
    ("q_offset at the end", dict(batch_size=1, q_length=2, kv_length=4, q_offset=INT64_MAX - 2)),
    (
        "both at the end",
        dict(batch_size=1, q_length=3, kv_length=3, q_offset=INT64_MAX - 3, kv_offset=INT64_MAX - 4),
    ),
    ("window 2**63 - 1", dict(batch_size=1, q_length=3, kv_length=5, q_offset=2, sliding_window=INT64_MAX)),
    (
        "window 2**63 - 1, bidirectional, keys at the end",
        dict(
            batch_size=1,
            q_length=3,
            kv_length=5,
            kv_offset=INT64_MAX - 5,
            causal=False,
            sliding_window=INT64_MAX,
        ),
    ),
    (
        "chunk 2**63 - 1 with left padding",
        dict(
            batch_size=3,
            q_length=3,
            kv_length=6,
            q_offset=3,
            chunk_size=INT64_MAX,
            chunk_left_padding=torch.tensor([0, 5, -3]),
        ),
    ),
    (
        "chunk 2**62 with left padding, positions past 2**62",
        dict(
            batch_size=2,
            q_length=3,
            kv_length=4,
            q_offset=2**62 - 1,
            kv_offset=2**62 - 2,
            chunk_size=2**62,
            chunk_left_padding=torch.tensor([0, 2]),
        ),
    ),
    (
        "start position 2**63 - 1",
        dict(batch_size=1, q_length=3, kv_length=3, q_positions=torch.tensor(INT64_MAX)),
    ),
    (
        "start position 2**63 - 1, sliding",
        dict(
            batch_size=1,
            q_length=3,
            kv_length=3,
            kv_offset=INT64_MAX - 3,
            q_positions=torch.tensor(INT64_MAX),
            sliding_window=2,
        ),
    ),
    (
        "per-batch positions at both ends",
        dict(
            batch_size=2,
            q_length=2,
            kv_length=3,
            q_positions=torch.tensor([[-(2**63), 1], [INT64_MAX, 2]]),
            sliding_window=3,
        ),
    ),
    (
        "padding mask far before the keys",
        dict(
            batch_size=2,
            q_length=2,
            kv_length=3,
            kv_offset=2**62,
            causal=False,
            padding_mask=torch.ones(2, 5, dtype=torch.bool),
        ),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", _NEAR_LIMITS, ids=[d for d, _ in _NEAR_LIMITS])
def test_positions_near_int64_limits(device, case):
    """Offsets, windows, chunks and positions near the int64 limits give the exact rule (the
    reference computes these cases in Python integers), never a wrapped sum."""
    _, kwargs = case
    want = reference.sdpa_mask(**kwargs)
    on_device = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    got = safeattn.sdpa_mask(**on_device, device=device)
    assert torch.equal(got.cpu(), want), f"{case[0]}: got {got.int().tolist()}, want {want.int().tolist()}"


@pytest.mark.parametrize("device", DEVICES)
def test_positions_near_int64_limits_fuzzed(device):
    """Random combinations of extreme offsets, windows, chunks and positions against the exact reference."""
    rng = random.Random(7)
    extremes = [0, 1, 5, 2**31, 2**62 - 3, 2**62, INT64_MAX - 40, INT64_MAX - 9]
    for _ in range(60):
        q_length, kv_length = rng.choice([1, 2, 5]), rng.choice([1, 3, 6])
        kwargs = dict(batch_size=2, q_length=q_length, kv_length=kv_length, causal=rng.random() < 0.6)
        kwargs["kv_offset"] = min(rng.choice(extremes), INT64_MAX - kv_length)
        if rng.random() < 0.3:
            kwargs["q_positions"] = torch.tensor(
                [[rng.choice(extremes + [-(2**63), -7]) for _ in range(q_length)] for _ in range(2)]
            )
        else:
            kwargs["q_offset"] = min(rng.choice(extremes), INT64_MAX - q_length)
        if rng.random() < 0.5:
            kwargs["sliding_window"] = rng.choice([1, 2, 7, 2**62, INT64_MAX])
        if rng.random() < 0.4:
            kwargs["chunk_size"] = rng.choice([1, 3, 2**62 + 1, INT64_MAX])
            kwargs["chunk_left_padding"] = torch.tensor(
                [rng.choice([0, 3, -(2**62), 2**62]) for _ in range(2)]
            )
        want = reference.sdpa_mask(**kwargs)
        on_device = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        got = safeattn.sdpa_mask(**on_device, device=device)
        assert torch.equal(got.cpu(), want), f"{kwargs}: got {got.int().tolist()}, want {want.int().tolist()}"
