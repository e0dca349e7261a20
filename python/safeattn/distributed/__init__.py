"""safeattn under ``torch.distributed``: DTensor sharding rules and context-parallel attention.

- **DTensor.** Every public op accepts DTensors and returns DTensors, with no implicit
  all-gather: ``attention`` batch- or head-sharded, the softmax ops sharded on any dim but the
  softmax dim, ``sdpa_mask`` replicated or batch-sharded (rules in ``_dtensor.py``). They are
  registered as soon as ``torch.distributed.tensor`` is imported (``import safeattn`` does not
  import it: it takes about 0.5 s); :func:`register_dtensor_sharding` does it at once.
- **Tensor parallelism** (Transformers' ``tp_plan="auto"``) needs nothing more: the attention
  function sees each rank's local heads as plain tensors.
- **Context parallelism**: :func:`context_parallel_attention` runs attention over a sequence
  split across the ranks of a process group (K/V passed around a ring), with causal, sliding
  window and key-padding masks given by positions, forward and backward;
  :func:`shard_sequence` / :func:`unshard_sequence` split and gather a sequence in the layout it
  expects.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

import torch

__all__ = ["register_dtensor_sharding"]
# `import safeattn` imports this package: it must not fail in a torch built without distributed.
if torch.distributed.is_available():
    from ._context_parallel import context_parallel_attention, shard_sequence, unshard_sequence

    __all__ += ["context_parallel_attention", "shard_sequence", "unshard_sequence"]

_DTENSOR_MODULE = "torch.distributed.tensor"


def register_dtensor_sharding() -> None:
    """Register the safeattn ops' DTensor sharding rules now (idempotent). Imports
    ``torch.distributed.tensor``; raises ImportError where DTensor or its ``register_sharding``
    (torch >= 2.5) is missing."""
    from . import _dtensor

    _dtensor.register()


class _RegisterAfterDTensorImport(importlib.abc.MetaPathFinder):
    """A one-shot finder: when ``torch.distributed.tensor`` is first imported, let the normal
    import run and then register the sharding rules, and take itself off ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_quietly()

        spec.loader.exec_module = exec_then_register
        return spec


def _register_quietly() -> None:
    # Runs inside the user's import of torch.distributed.tensor, which must not fail because of
    # safeattn: a torch without register_sharding (< 2.5) goes on without the rules, any other
    # failure is a warning.
    try:
        register_dtensor_sharding()
    except ImportError:
        pass
    except Exception as error:  # noqa: BLE001
        warnings.warn(
            f"safeattn: DTensor sharding rules not registered: {error!r}", RuntimeWarning, stacklevel=2
        )


def _register_when_dtensor_loads() -> None:
    if not torch.distributed.is_available():
        return
    if _DTENSOR_MODULE in sys.modules:
        _register_quietly()
    elif not any(isinstance(finder, _RegisterAfterDTensorImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterDTensorImport())


_register_when_dtensor_loads()
