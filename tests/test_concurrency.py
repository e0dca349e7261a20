"""The ops called from 8 Python threads at once give exactly the results of sequential calls.

Each thread runs one op (forward and backward) on its own inputs several times, all threads
released together by a barrier; every result must be bitwise what a sequential call on the same
inputs gave (NaN where NaN). Sizes are large enough that the CPU kernels split their work with
at::parallel_for, so each call from a Python thread runs its own parallel region next to the
others. On CUDA each thread launches on its own stream (the kernels must use the current stream).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _op_cases import CASE_PARAMS, clone_inputs, make_inputs, run
from conftest import DEVICES

THREADS = 8
REPEATS = 3
LENGTH = 160  # softmax scores [2, 3, 160, 160], masks [2, 1, 160, 160]: several parallel_for tasks each


def _flatten(result):
    outs, grads = result
    return [t.detach() for t in (*outs, *(grads or ())) if t is not None]


def _assert_identical(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} tensors, sequential gave {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            g, w, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"{what} tensor {i}: {m}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.slow
def test_threads_match_sequential(case, device):
    inputs = [make_inputs(case, LENGTH, device, seed=t) for t in range(THREADS)]
    sequential = [_flatten(run(case.fn, clone_inputs(args))) for args in inputs]
    barrier = threading.Barrier(THREADS)

    def worker(t):
        results = []
        stream = torch.cuda.Stream() if device == "cuda" else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        barrier.wait()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for _ in range(REPEATS):
                results.append(_flatten(run(case.fn, clone_inputs(inputs[t]))))
        if stream is not None:
            stream.synchronize()
        return results

    with ThreadPoolExecutor(THREADS) as pool:
        per_thread = list(pool.map(worker, range(THREADS)))
    for t, results in enumerate(per_thread):
        for r, got in enumerate(results):
            _assert_identical(got, sequential[t], f"{case.name} thread {t} repeat {r}")
