"""Parallel dimensions, applied to a plain model from outside: one module per dimension
(data_parallel, zero, tensor_parallel, pipeline/, activation_checkpoint), composed by `compose.parallelize`.

`parallelize` and `Parallelized` load on first use (PEP 562): the pure-Python parts (pipeline schedules
and simulator) stay importable without torch, which the planner relies on.
"""
from importlib import import_module

_LAZY = {"parallelize": ".compose", "Parallelized": ".compose", "cross_entropy": ".compose",
         "named_params": ".compose", "slices": ".compose"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
