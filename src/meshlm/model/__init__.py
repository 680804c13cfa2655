"""Plain PyTorch Llama. Nothing here knows it may be distributed (docs/architecture.md, invariant 5).

The modules that need torch load on first use (PEP 562), so torch-free code (the planner, layout
checks) can import the shapes in `model.args` without paying for torch.
"""
from importlib import import_module

from ..core.model_args import PRESETS, ModelArgs

_LAZY = {"Llama": ".llama", "Block": ".llama", "Attention": ".llama", "FeedForward": ".llama",
         "RMSNorm": ".llama", "init_tensor": ".init", "materialize": ".init"}

__all__ = ["PRESETS", "ModelArgs", "build_model", *_LAZY]


def build_model(args: ModelArgs):
    """The model `args` describe, so that code above model/ names no model class (one architecture
    today: Llama, dense or MoE by `args.moe`)."""
    from .llama import Llama

    return Llama(args)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
