"""safeattn under torch.distributed: DTensor sharding rules, Transformers tensor parallelism and
context-parallel attention, each compared with the single-process result (float64, so the
comparison is tight) and, for context parallelism, with reference.py.

The ranks are worker processes of one process group (gloo on CPU; NCCL on CUDA, one GPU a rank,
where the machine has enough GPUs), started once per (world size, device) for this module and
reused by its tests: a test sends a case (a function of this module, by name) to every rank and
fails with the ranks' tracebacks if any raises. Every rank builds the same global data and
asserts on what every rank sees alike (full tensors, placements), so the ranks fail together
rather than one leaving the others waiting in a collective; a rank that does not answer within
the timeout fails the test, and the world is started afresh for the next one.

On a machine with 2 GPUs (NCCL): ``NCCL_NVLS_ENABLE=0 python -m pytest tests/test_distributed.py -k cuda``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import safeattn
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safeattn import distributed as sd
from safeattn import reference

if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_TIMEOUT_S = 120  # one case on every rank; a collective waits at most this long for a peer
_CUDA_KERNELS = all(
    torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    for op in ("safeattn::attention", "safeattn::_attention_backward")
)


def _worlds(*sizes: int) -> list:
    """(world size, device) parameters: CPU always; CUDA where there is a GPU per rank."""
    params = [pytest.param(size, "cpu", id=f"{size}xcpu") for size in sizes]
    for size in sizes:
        ok = _CUDA_KERNELS and torch.cuda.is_available() and torch.cuda.device_count() >= size
        params.append(
            pytest.param(
                size,
                "cuda",
                id=f"{size}xcuda",
                marks=pytest.mark.skipif(
                    not ok, reason=f"needs {size} CUDA GPUs and safeattn's CUDA kernels"
                ),
            )
        )
    return params


# ---- the worker processes ------------------------------------------------------------------------


def _worker(rank: int, world: int, device: str, init_file: str, tasks, results) -> None:
    # Transformers reads LOCAL_RANK to pick a rank's accelerator.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        _BACKENDS[device],
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=_TIMEOUT_S),
    )
    while (task := tasks.get()) is not None:
        case, params = task
        try:
            torch.manual_seed(0)
            results.put((rank, None, case(rank, world, device, **params)))
        except BaseException:  # noqa: BLE001  reported to the test, which fails with it
            results.put((rank, traceback.format_exc(), None))
    dist.destroy_process_group()
    # Every result has been read by the test process: skip the interpreter's teardown, which
    # took about 6 s here.
    os._exit(0)


@contextlib.contextmanager
def _environ(**values: str):
    """os.environ with `values` set (inherited by the processes started meanwhile), then restored."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _World:
    """`world` worker processes in one process group, running cases on request."""

    def __init__(self, world: int, device: str):
        ctx = mp.get_context("spawn")
        self.world, self.device = world, device
        self._init_file = tempfile.mktemp(prefix="safeattn-dist-")
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world, device, self._init_file, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world)
        ]
        # The CPU ranks see no GPU, as on a machine without one: from_pretrained(tp_plan="auto")
        # puts each rank's weights on the machine's accelerator (Transformers' tensor-parallel
        # setup asks torch._C._get_accelerator()), so on a GPU host a gloo world's weights went to
        # cuda and its inputs stayed on the CPU. Set before the start: a spawned rank's CUDA
        # initialises while it imports this module, before _worker runs.
        with _environ(CUDA_VISIBLE_DEVICES="") if device == "cpu" else contextlib.nullcontext():
            for proc in self._procs:
                proc.start()
        self.alive = True

    def run(self, case, **params) -> list:
        """Run case(rank, world, device, **params) on every rank; each rank's return value."""
        for tasks in self._tasks:
            tasks.put((case, params))
        outcomes: dict[int, tuple] = {}
        deadline = time.monotonic() + 2 * _TIMEOUT_S
        while len(outcomes) < self.world:
            try:
                rank, error, value = self._results.get(timeout=1)
                outcomes[rank] = (error, value)
                continue
            except queue.Empty:
                pass
            dead = [rank for rank, proc in enumerate(self._procs) if not proc.is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                missing = sorted(set(range(self.world)) - set(outcomes))
                why = (
                    f"ranks {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})"
                    if dead
                    else "timed out"
                )
                pytest.fail(f"{case.__name__}: no result from ranks {missing}: {why}", pytrace=False)
        errors = [f"rank {rank}:\n{error}" for rank, (error, _) in sorted(outcomes.items()) if error]
        if errors:
            pytest.fail(f"{case.__name__} failed\n" + "\n".join(errors), pytrace=False)
        return [outcomes[rank][1] for rank in range(self.world)]

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for tasks in self._tasks:
            with contextlib.suppress(Exception):
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._init_file)


@pytest.fixture(scope="module")
def worlds():
    made: dict[tuple[int, str], _World] = {}

    def get(world: int, device: str, fresh: bool = False) -> _World:
        """The processes of (world, device), reused across tests; `fresh`: new ones."""
        key = (world, device)
        if fresh and key in made and made[key].alive:
            made[key].close()
        if key not in made or not made[key].alive:
            made[key] = _World(world, device)
        return made[key]

    yield get
    for world in made.values():
        world.close()


# ---- helpers used inside the ranks ---------------------------------------------------------------

# Tolerances against the single-process result: float64 runs the same arithmetic on other
# shapes (other blockings), so only rounding differs.
_TOL = {torch.float64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=2e-5, rtol=2e-4)}
# Lower precisions, FlashAttention's rule (tests/test_attention.py): the error against the float64
# reference at most 2x (3x for gradients) that of the single-process op in the same dtype, plus a
# floor. The ring also rounds each block's gradient share to the input dtype before summing them
# (torch's ring attention does the same: the backward kernels return the input dtype), about one
# rounding of the gradient's size more: the gradients' floor scales with their largest value.
_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 4e-3}


def _randn(*shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _assert_close(got, want, ref, what: str, dtype=torch.float64, gradient=False) -> None:
    """got (distributed) against want (single process) for inputs of `dtype`; in low precision
    both against ref (float64)."""
    got, want = got.detach(), want.detach()
    assert not got.isnan().any(), f"{what}: NaN in the distributed result"
    if dtype in _TOL:
        torch.testing.assert_close(got, want.to(got.dtype), **_TOL[dtype], msg=lambda m: f"{what}: {m}")
        return
    ref = ref.detach().double()

    def err(t):
        diff = (t.double() - ref).abs()
        return diff.masked_fill(t.double() == ref, 0).max().item()  # matching infinities count as equal

    allowed = 2 * err(want) + _FLOOR[dtype]
    if gradient:
        allowed = 3 * err(want) + _FLOOR[dtype] * max(1.0, ref.abs().max().item())
    assert (
        err(got) <= allowed
    ), f"{what}: error {err(got):.3g} against the float64 reference, single process {err(want):.3g}"


def _float64_copy(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64, copy=True)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows with no key) as 0, so a loss can use it: the gradient there is 0."""
    return lse.masked_fill(lse == float("-inf"), 0)


# ---- DTensor --------------------------------------------------------------------------------------


def _case_dtensor_attention(rank, world, device, shard_dim):
    """attention batch- or head-sharded: DTensor outputs and gradients, no communication, the
    single-process values. Then a sequence-sharded input, which must be redistributed (correctly)."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh(device, (world,))
    gen = torch.Generator().manual_seed(1)
    f64 = dict(dtype=torch.float64, device=device, gen=gen)
    # batch world+1: uneven batch shards; heads 2*world over world kv heads: GQA groups split evenly.
    batch, heads, kv_heads, q_len, kv_len, dim = world + 1, 2 * world, world, 7, 9, 16
    q = _randn(batch, heads, q_len, dim, **f64)
    k, v = (_randn(batch, kv_heads, kv_len, dim, **f64) for _ in range(2))
    bool_mask = torch.rand(batch, 1, q_len, kv_len, generator=gen).to(device) > 0.3
    bool_mask[0, :, 2] = False  # a fully masked row: out 0, lse -inf, gradient 0
    masks = {
        "none": None,
        "bool [B,1,Q,KV]": bool_mask,
        "bias [1,H,Q,KV], learnable": _randn(1, heads, q_len, kv_len, **f64),
        "bias [Q,KV], learnable": _randn(q_len, kv_len, **f64),
    }
    grad_out, grad_lse = _randn(batch, heads, q_len, dim, **f64), _randn(batch, heads, q_len, **f64)
    sinks = _randn(heads, **f64)

    def placement_of(t, full_dim_from_end, full_size):
        dim_ = t.dim() - full_dim_from_end
        return Shard(dim_) if dim_ >= 0 and t.shape[dim_] == full_size else Replicate()

    report = []
    for mask_name, mask in masks.items():
        for with_sinks in (False, True):
            kwargs = dict(is_causal=True, enable_gqa=True, q_offset=kv_len - q_len)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            learnable = mask is not None and mask.is_floating_point()
            m = mask.clone().requires_grad_(learnable) if mask is not None else None
            s = sinks.clone().requires_grad_() if with_sinks else None
            out, lse = safeattn.attention(*leaves, m, sinks=s, **kwargs)
            ((out * grad_out).sum() + (_finite(lse) * grad_lse).sum()).backward()

            shard = Shard(shard_dim)
            full = batch if shard_dim == 0 else heads
            d_leaves = [distribute_tensor(t, mesh, [shard]).requires_grad_() for t in (q, k, v)]
            d_m = None
            if mask is not None:
                d_m = distribute_tensor(mask, mesh, [placement_of(mask, 4 - shard_dim, full)]).requires_grad_(
                    learnable
                )
            d_s = None
            if with_sinks:
                d_s = distribute_tensor(
                    sinks, mesh, [Shard(0) if shard_dim == 1 else Replicate()]
                ).requires_grad_()
            d_grad_out, d_grad_lse = (distribute_tensor(t, mesh, [shard]) for t in (grad_out, grad_lse))
            with CommDebugMode() as comm:
                d_out, d_lse = safeattn.attention(*d_leaves, d_m, sinks=d_s, **kwargs)
                ((d_out * d_grad_out).sum() + (_finite(d_lse) * d_grad_lse).sum()).backward()
            case = f"shard dim {shard_dim}, mask {mask_name}, sinks {with_sinks}"
            report.append((case, comm.get_total_counts(), d_out.placements, d_lse.placements))
            # Forward and backward (from a Partial loss) without a single collective.
            assert comm.get_total_counts() == 0, f"{case}: communication {dict(comm.get_comm_counts())}"
            assert d_out.placements == (shard,) and d_lse.placements == (
                shard,
            ), f"{case}: {d_out.placements}"
            pairs = [("out", d_out, out), ("lse", d_lse, lse)]
            pairs += [(f"grad {n}", d.grad, t.grad) for n, d, t in zip("qkv", d_leaves, leaves, strict=True)]
            if learnable:
                want = Partial() if d_m.placements == (Replicate(),) else d_m.placements[0]
                assert d_m.grad.placements == (want,), f"{case}: mask grad placement {d_m.grad.placements}"
                pairs.append(("grad mask", d_m.grad, m.grad))
            if with_sinks:
                want = Partial() if shard_dim == 0 else Shard(0)
                assert d_s.grad.placements == (want,), f"{case}: sinks grad placement {d_s.grad.placements}"
                pairs.append(("grad sinks", d_s.grad, s.grad))
            for name, got, expected in pairs:
                _assert_close(got.full_tensor(), expected, expected, f"{case}: {name}")

    # Sharded on the query length: no rule runs that locally, so DTensor redistributes first.
    d_q, d_k, d_v = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
    d_out, _ = safeattn.attention(d_q, d_k, d_v, is_causal=True, enable_gqa=True)
    want, _ = safeattn.attention(q, k, v, is_causal=True, enable_gqa=True)
    _assert_close(d_out.full_tensor(), want, want, "sequence-sharded input, redistributed")
    return report


@pytest.mark.parametrize("shard_dim", [0, 1], ids=["batch", "heads"])
@pytest.mark.parametrize(("world", "device"), _worlds(2))
def test_dtensor_attention_sharded_without_communication(worlds, world, device, shard_dim):
    worlds(world, device).run(_case_dtensor_attention, shard_dim=shard_dim)


def _case_dtensor_softmax(rank, world, device):
    """safe_softmax and masked_softmax sharded on every dim but the softmax dim."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh(device, (world,))
    gen = torch.Generator().manual_seed(2)
    f64 = dict(dtype=torch.float64, device=device, gen=gen)
    batch, heads, q_len, kv_len = world + 1, 2 * world, 5, 6
    scores = _randn(batch, heads, q_len, kv_len, **f64)
    scores[0, 1, 3] = float("-inf")  # an all -inf row: 0, gradient 0
    bias = _randn(heads, 1, kv_len, **f64)  # broadcast over batch and queries, learnable
    keep = torch.rand(batch, 1, q_len, kv_len, generator=gen).to(device) > 0.2
    grad = _randn(batch, heads, q_len, kv_len, **f64)
    for softmax_dim in (3, 1):
        for shard_dim in (d for d in range(4) if d != softmax_dim):
            for op, mask in (("safe_softmax", None), ("masked_softmax", bias), ("masked_softmax", keep)):
                learnable = mask is not None and mask.is_floating_point()
                x = scores.clone().requires_grad_()
                m = None if mask is None else mask.clone().requires_grad_(learnable)
                if op == "safe_softmax":
                    out = safeattn.safe_softmax(x, softmax_dim)
                else:
                    out = safeattn.masked_softmax(x, m, 0.5, softmax_dim)
                (out * grad).sum().backward()

                d_x = distribute_tensor(scores, mesh, [Shard(shard_dim)]).requires_grad_()
                d_m = None
                if mask is not None:
                    mask_dim = mask.dim() - (4 - shard_dim)
                    sharded = mask_dim >= 0 and mask.shape[mask_dim] == scores.shape[shard_dim]
                    d_m = distribute_tensor(mask, mesh, [Shard(mask_dim) if sharded else Replicate()])
                    d_m.requires_grad_(learnable)
                d_grad = distribute_tensor(grad, mesh, [Shard(shard_dim)])
                with CommDebugMode() as comm:
                    if op == "safe_softmax":
                        d_out = safeattn.safe_softmax(d_x, softmax_dim)
                    else:
                        d_out = safeattn.masked_softmax(d_x, d_m, 0.5, softmax_dim)
                    (d_out * d_grad).sum().backward()
                case = f"{op}, softmax dim {softmax_dim}, shard dim {shard_dim}, mask {None if m is None else m.dtype}"
                assert comm.get_total_counts() == 0, f"{case}: communication {dict(comm.get_comm_counts())}"
                assert d_out.placements == (Shard(shard_dim),), f"{case}: {d_out.placements}"
                _assert_close(d_out.full_tensor(), out, out, f"{case}: out")
                _assert_close(d_x.grad.full_tensor(), x.grad, x.grad, f"{case}: grad")
                if learnable:
                    want = Partial() if d_m.placements == (Replicate(),) else d_m.placements[0]
                    assert d_m.grad.placements == (
                        want,
                    ), f"{case}: mask grad placement {d_m.grad.placements}"
                    _assert_close(d_m.grad.full_tensor(), m.grad, m.grad, f"{case}: mask grad")


@pytest.mark.parametrize(("world", "device"), _worlds(2))
def test_dtensor_softmax_sharded_off_the_softmax_dim(worlds, world, device):
    worlds(world, device).run(_case_dtensor_softmax)


def _case_dtensor_sdpa_mask(rank, world, device):
    """sdpa_mask: replicated inputs give a replicated mask, batch-sharded ones a batch-sharded one."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh(device, (world,))
    batch, length = 2 * world + 1, 11
    gen = torch.Generator().manual_seed(3)
    padding = (torch.rand(batch, length, generator=gen) > 0.3).to(device)
    packed = torch.randint(0, 3, (batch, length), generator=gen).sort(-1).values.to(device)
    left = torch.randint(0, 3, (batch,), generator=gen).to(device)
    want = safeattn.sdpa_mask(
        batch, length, length, sliding_window=4, padding_mask=padding, packed_ids=packed
    )
    want_chunked = safeattn.sdpa_mask(
        batch, length, length, chunk_size=3, chunk_left_padding=left, padding_mask=padding
    )
    for placement in (Replicate(), Shard(0)):
        d_padding, d_packed = (distribute_tensor(t, mesh, [placement]) for t in (padding, packed))
        d_left = distribute_tensor(left, mesh, [Replicate()])  # cut locally where the mask is sharded
        with CommDebugMode() as comm:
            got = safeattn.sdpa_mask(
                batch, length, length, sliding_window=4, padding_mask=d_padding, packed_ids=d_packed
            )
            got_chunked = safeattn.sdpa_mask(
                batch, length, length, chunk_size=3, chunk_left_padding=d_left, padding_mask=d_padding
            )
        assert comm.get_total_counts() == 0, f"{placement}: communication {dict(comm.get_comm_counts())}"
        for name, mask, expected in (("window+packed", got, want), ("chunked", got_chunked, want_chunked)):
            assert mask.placements == (placement,), f"{name}, inputs {placement}: mask {mask.placements}"
            assert mask.shape == expected.shape, f"{name}: global shape {mask.shape}"
            assert torch.equal(mask.full_tensor(), expected), f"{name}, inputs {placement}: mask differs"


@pytest.mark.parametrize(("world", "device"), _worlds(2))
def test_dtensor_sdpa_mask_replicated_or_batch_sharded(worlds, world, device):
    worlds(world, device).run(_case_dtensor_sdpa_mask)


# ---- Transformers tensor parallelism ----------------------------------------------------------------

_TP_MODELS = ["llama", "mistral", "qwen3", "gemma2"]  # GQA; sliding window; hybrid layers; softcap


@contextlib.contextmanager
def _recording_attention(seen: list):
    """Wrap the registered "safeattn" attention to record the head counts it is called with."""
    import safeattn.transformers as st
    from transformers import AttentionInterface

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((type(query).__name__, query.shape[1], key.shape[1]))
        return st.attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(st.NAME, recording)
    try:
        yield
    finally:
        AttentionInterface.register(st.NAME, st.attention_forward)


def _tp_compare(world, device, single, parallel, name) -> None:
    """Logits and a training step's gradients of a tensor-parallel model against the single model."""
    import _transformers_models as tm

    # Left padding: fully masked query rows.
    input_ids, attention_mask = (t.to(device) for t in tm.padded_batch("left"))
    seen: list = []
    with _recording_attention(seen):
        want = single(input_ids=input_ids, attention_mask=attention_mask).logits
        seen.clear()
        got = parallel(input_ids=input_ids, attention_mask=attention_mask).logits
    heads, kv_heads = tm.COMMON["num_attention_heads"], tm.COMMON["num_key_value_heads"]
    assert seen and all(
        s == ("Tensor", heads // world, kv_heads // world) for s in seen
    ), f"{name}: the attention should see this rank's heads as plain tensors, saw {seen}"
    real = attention_mask.bool()
    torch.testing.assert_close(
        got[real], want[real], atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} logits: {m}"
    )
    want[real].square().mean().backward()
    got[real].square().mean().backward()
    for param_name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        want_grad = single.get_parameter(param_name).grad
        got_grad = parallel.get_parameter(param_name).grad
        got_grad = got_grad.full_tensor() if hasattr(got_grad, "full_tensor") else got_grad
        torch.testing.assert_close(
            got_grad, want_grad, atol=1e-6, rtol=1e-4, msg=lambda m, p=param_name: f"{name} {p}: {m}"
        )


def _case_tensor_parallel_plan(rank, world, device, name):
    """Transformers' own tp_plan="auto" machinery (apply_tensor_parallelism, what from_pretrained
    runs after building the model) on a model built from its config: every rank builds the same
    weights from the same seed, and each keeps its shard."""
    import _transformers_models as tm
    import safeattn.transformers  # noqa: F401  registers "safeattn"
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = tm.make_config(name)
    single = tm.make_model(config, "safeattn").to(device)
    parallel = tm.make_model(config, "safeattn").to(device)
    parallel = apply_tensor_parallelism(parallel, init_device_mesh(device, (world,)))
    weight = parallel.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert (
        type(weight.data).__name__ == "DTensor"
    ), f"{name}: q_proj is not sharded ({type(weight.data).__name__})"
    _tp_compare(world, device, single, parallel, name)


@pytest.mark.parametrize("name", _TP_MODELS)
@pytest.mark.parametrize(("world", "device"), _worlds(2))
def test_tensor_parallel_plan_same_logits_and_gradients(worlds, world, device, name):
    pytest.importorskip("transformers.distributed.tensor_parallel", reason="Transformers without DTensor TP")
    worlds(world, device).run(_case_tensor_parallel_plan, name=name)


def _case_tensor_parallel_from_pretrained(rank, world, device, path):
    """from_pretrained(tp_plan="auto", attn_implementation="safeattn"), the documented way."""
    import _transformers_models as tm
    import safeattn.transformers  # noqa: F401  registers "safeattn"
    import transformers

    if rank == 0:
        tm.make_model(tm.make_config("llama"), "safeattn").save_pretrained(path)
    dist.barrier()
    try:
        from transformers.distributed import DistributedConfig

        tp_kwargs = dict(distributed_config=DistributedConfig(tp_plan="auto"))
    except ImportError:  # before Transformers 5.17: the tp_plan keyword
        tp_kwargs = dict(tp_plan="auto")
    load = transformers.AutoModelForCausalLM.from_pretrained
    single = load(path, attn_implementation="safeattn").to(device).eval()
    parallel = load(path, attn_implementation="safeattn", **tp_kwargs).eval()
    _tp_compare(world, device, single, parallel, "llama from_pretrained")


@pytest.mark.parametrize(("world", "device"), _worlds(2))
def test_tensor_parallel_from_pretrained_tp_plan_auto(worlds, world, device, tmp_path):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip(
            'needs accelerate: without it Transformers raises "Using a `device_map`, `tp_plan`, `torch.device` '
            'context manager or setting `torch.set_default_device(device)` requires `accelerate`"'
        )
    # Fresh processes: on 2 H100s (NCCL, Transformers 5.17) this case failed inside Transformers'
    # embedding (input_ids on the CPU, the weight on cuda:1) when it ran after the other cases in
    # the same processes, and passed when it ran alone: from_pretrained(tp_plan=...) depends on
    # state an earlier case leaves behind, which is not what this test is about.
    worlds(world, device, fresh=True).run(_case_tensor_parallel_from_pretrained, path=str(tmp_path / "llama"))


# ---- context parallelism ----------------------------------------------------------------------------

# (name, is_causal, sliding_window, padding, extras): every mask kind the ring builds from positions.
_CP_CASES = [
    ("full", False, None, False, {}),
    ("causal", True, None, False, {}),
    ("causal + padding", True, None, True, {}),
    ("causal window + padding", True, 5, True, {}),
    ("bidirectional window + padding", False, 3, True, {}),
    ("causal + padding, softcap, sinks, scale", True, None, True, dict(softcap=2.0, sinks=True, scale=0.3)),
]


def _case_context_parallel(rank, world, device, layouts, dtype_name, head_dim):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, length = 2, 4, 2, 8 * world
    q = _randn(batch, heads, length, head_dim, dtype=dtype, device=device, gen=gen)
    k, v = (_randn(batch, kv_heads, length, head_dim, dtype=dtype, device=device, gen=gen) for _ in range(2))
    padding = torch.ones(batch, length, dtype=torch.bool, device=device)
    padding[0, :6] = False  # left padding: with a causal mask the first 6 queries see no key
    padding[1, -3:] = False  # right padding
    grad_out = _randn(batch, heads, length, head_dim, dtype=dtype, device=device, gen=gen)
    grad_lse = _randn(batch, heads, length, dtype=torch.float64, device=device, gen=gen)
    sinks_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    sinks = _randn(heads, dtype=sinks_dtype, device=device, gen=gen)

    def loss(out, lse, g_out, g_lse):
        return (out.double() * g_out.double()).sum() + (_finite(lse).double() * g_lse).sum()

    def whole_sequence(attention, cast, mask, is_causal, with_sinks, extras):
        """(out, lse, [grad q, k, v], grad sinks) of one process over the whole sequence."""
        leaves = [cast(t).requires_grad_() for t in (q, k, v)]
        s = cast(sinks).requires_grad_() if with_sinks else None
        out, lse = attention(*leaves, mask, is_causal=is_causal, enable_gqa=True, sinks=s, **extras)
        loss(out, lse, grad_out, grad_lse).backward()
        return out, lse, [t.grad for t in leaves], None if s is None else s.grad

    results = []
    for name, is_causal, window, padded, extras in _CP_CASES:
        extras = dict(extras)
        with_sinks = extras.pop("sinks", False)
        mask = None
        if padded or window is not None:
            mask = safeattn.sdpa_mask(
                batch,
                length,
                length,
                causal=is_causal,
                sliding_window=window,
                padding_mask=padding if padded else None,
                device=device,
            )
        op_causal = is_causal and mask is None
        # One process, the mask built: safeattn in the inputs' dtype, and the float64 reference.
        single = whole_sequence(safeattn.attention, torch.clone, mask, op_causal, with_sinks, extras)
        ref = whole_sequence(reference.attention, _float64_copy, mask, op_causal, with_sinks, extras)

        for layout in layouts:
            # The ring: each rank its part of the sequence; no mask built.
            def shard(t, dim, layout=layout):
                return sd.shard_sequence(t, dim, layout=layout)

            def gather(t, dim, layout=layout):
                return sd.unshard_sequence(t.detach(), dim, layout=layout)

            leaves = [shard(t, 2).clone().requires_grad_() for t in (q, k, v)]
            s = sinks.clone().requires_grad_() if with_sinks else None
            out, lse = sd.context_parallel_attention(
                *leaves,
                group=mesh if layout == "contiguous" else None,  # a 1-D DeviceMesh or the default group
                layout=layout,
                is_causal=is_causal,
                enable_gqa=True,
                sliding_window=window,
                padding_mask=shard(padding, 1) if padded else None,
                sinks=s,
                **extras,
            )
            loss(out, lse, shard(grad_out, 2), shard(grad_lse, 2)).backward()
            grad_sinks = None
            if with_sinks:
                grad_sinks = s.grad.clone()
                dist.all_reduce(grad_sinks)  # each rank's share of a replicated parameter's gradient
            got = (gather(out, 2), gather(lse, 2), [gather(t.grad, 2) for t in leaves], grad_sinks)
            results.append((f"{layout}, {dtype_name}, {name}", got, single, ref))

    # Every collective is done: assert.
    for case, got, single, ref in results:
        for what, g, want, r in zip(("out", "lse"), got[:2], single[:2], ref[:2], strict=True):
            _assert_close(g, want, r, f"{case}: {what}", dtype)
        for n, g, want, r in zip("qkv", got[2], single[2], ref[2], strict=True):
            _assert_close(g, want, r, f"{case}: grad {n}", dtype, gradient=True)
        if got[3] is not None:
            _assert_close(got[3], single[3], ref[3], f"{case}: grad sinks", dtype, gradient=True)
        empty = ref[1] == float("-inf")
        if empty.any():  # rows that see no key: exactly 0, lse -inf, gradient 0
            assert (got[0][empty] == 0).all(), f"{case}: fully masked rows not 0"
            assert (got[1][empty] == float("-inf")).all(), f"{case}: fully masked rows' lse not -inf"
            assert (got[2][0][empty] == 0).all(), f"{case}: fully masked rows' grad q not 0"
    return [case for case, *_ in results]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("world", "device"), _worlds(2))
def test_context_parallel_matches_one_process(worlds, world, device, layout):
    """Forward and backward, every mask kind, float64: the ring equals the whole-sequence op."""
    worlds(world, device).run(_case_context_parallel, layouts=(layout,), dtype_name="float64", head_dim=16)


def _case_four_ranks(rank, world, device):
    dtensor = [_case_dtensor_attention(rank, world, device, shard_dim=dim) for dim in (0, 1)]
    ring = _case_context_parallel(rank, world, device, ("contiguous", "zigzag"), "float64", 16)
    return dtensor, ring


@pytest.mark.parametrize(("world", "device"), _worlds(4))
def test_four_ranks_dtensor_attention_and_context_parallel(worlds, world, device):
    """The DTensor attention and context-parallel cases above on 4 ranks (heads 8 over 4 kv heads:
    grouped-query pairs stay together). One test, so that one pytest worker pays the start of a
    4-process world (about 12 s of CPU here), not each."""
    worlds(world, device).run(_case_four_ranks)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize(("world", "device"), _worlds(2))
def test_context_parallel_low_precision(worlds, world, device, dtype_name):
    """float32 against the one-process op; bfloat16 within 2x (3x for gradients) its error
    against float64."""
    worlds(world, device).run(_case_context_parallel, layouts=("zigzag",), dtype_name=dtype_name, head_dim=64)


def _case_torch_context_parallel(rank, world, device):
    """Causal attention without a mask, the case torch's context_parallel (SDPA, head-tail load
    balancing: the zigzag layout) supports: both rings against the float64 reference."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(device, (world,))
    gen = torch.Generator().manual_seed(5)
    dtype, batch, heads, length, head_dim = torch.bfloat16, 2, 8, 128 * world, 64
    q, k, v, grad_out = (
        _randn(batch, heads, length, head_dim, dtype=dtype, device=device, gen=gen) for _ in range(4)
    )

    def shard(t):
        return sd.shard_sequence(t, 2, layout="zigzag")

    def gather(t):
        return sd.unshard_sequence(t.detach(), 2, layout="zigzag")

    ref_leaves = [_float64_copy(t).requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention(*ref_leaves, is_causal=True)
    (ref_out * grad_out.double()).sum().backward()

    buffers = [t.clone() for t in (q, k, v)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers)):
        same_layout = torch.equal(buffers[0], shard(q))
        leaves = [b.requires_grad_() for b in buffers]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        (out.float() * shard(grad_out).float()).sum().backward()
    theirs = [gather(out)] + [gather(t.grad) for t in leaves]

    leaves = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    out, _ = sd.context_parallel_attention(*leaves, layout="zigzag", is_causal=True)
    (out.float() * shard(grad_out).float()).sum().backward()
    ours = [gather(out)] + [gather(t.grad) for t in leaves]

    assert same_layout, "torch's head-tail sharding is not safeattn's zigzag layout"
    errors = {}
    for name, mine, torch_cp, ref in zip(
        ("out", "grad q", "grad k", "grad v"),
        ours,
        theirs,
        [ref_out] + [t.grad for t in ref_leaves],
        strict=True,
    ):
        err_mine, err_torch = ((t.double() - ref).abs().max().item() for t in (mine, torch_cp))
        errors[name] = (err_mine, err_torch)
        factor = 2 if name == "out" else 3
        assert (
            err_mine <= factor * err_torch + _FLOOR[dtype]
        ), f"{name}: error against float64 {err_mine:.3g}, torch's context_parallel {err_torch:.3g}"
    return errors


@pytest.mark.parametrize(("world", "device"), [p for p in _worlds(2) if p.values[1] == "cuda"])
def test_context_parallel_as_accurate_as_torch_context_parallel(worlds, world, device):
    """torch's context_parallel has no CPU path (gloo): aten._scaled_dot_product_flash_attention_for_cpu
    has no DTensor sharding strategy, and the math backend fails on mixed Tensor and DTensor."""
    worlds(world, device).run(_case_torch_context_parallel)


def test_context_parallel_rejects_bad_arguments():
    q = torch.randn(1, 2, 8, 16)
    cases = [
        (dict(query=q[0]), "query must be 4-D"),
        (dict(key=q[:, :, :4]), "must hold the same positions"),
        (dict(padding_mask=torch.ones(1, 7, dtype=torch.bool)), r"padding_mask must be \[batch, S_local\]"),
        (dict(sliding_window=0), "sliding_window must be > 0"),
        (dict(layout="ring"), "layout must be one of"),
        (dict(layout="zigzag", query=q[:, :, :7], key=q[:, :, :7], value=q[:, :, :7]), "even length"),
    ]
    for overrides, message in cases:
        args = dict(query=q, key=q, value=q)
        args.update(overrides)
        query, key, value = args.pop("query"), args.pop("key"), args.pop("value")
        with pytest.raises(ValueError, match=message):
            sd.context_parallel_attention(query, key, value, **args)


def test_dtensor_rules_registered_when_torch_distributed_tensor_is_imported():
    """`import safeattn` leaves torch.distributed.tensor unimported (about 0.5 s); importing it
    later registers the rules. A fresh interpreter: this one has imported both already."""
    code = (
        "import sys, safeattn, torch\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'import safeattn imported DTensor'\n"
        "from torch.distributed.tensor import DTensor\n"
        "rules = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "ops = torch.ops.safeattn\n"
        "missing = [str(op) for op in (ops.attention.default, ops._attention_backward.default,\n"
        "    ops.safe_softmax.default, ops.masked_softmax.default) if op not in rules]\n"
        "assert not missing, missing\n"
        "assert ops.sdpa_mask.default in DTensor._op_dispatcher._custom_op_handlers\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
