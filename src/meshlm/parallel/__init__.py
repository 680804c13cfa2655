"""Parallel dimensions, applied to a plain model from outside (docs/architecture.md): one module per
dimension under dims/ (data_parallel, zero/, tensor_parallel and vocab_parallel, context_parallel,
expert_parallel, pipeline/, islands), the optimizers under optim/, the features that are not dimensions
under features/ (activation checkpointing, float8, the chunked loss, MTP, z-loss) and the model's names
under model_plans/, composed by compose.py `parallelize`.

`parallelize` and `Parallelized` load on first use (PEP 562), so importing one dimension's module does
not import the composition and everything it builds.
"""
from importlib import import_module

_LAZY = {"parallelize": ".compose", "Parallelized": ".compose", "cross_entropy": ".compose",
         "named_params": ".compose", "slices": ".compose"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
