"""How a dimension gives a model module its parallel form: `swap_in` builds a new instance of a
documented subclass (ParallelMoE, ReplicatedKVLinear, GatheredLinear, SumGradLinear, LossHead, the
summed-gain norms) from the module the model built and seats it where that module was. The new module holds the
same parameters, buffers, children and hooks under the same names, so state_dict keys, placement
records, checkpoints and Hugging Face conversion see no difference; the subclass adds fields and
overrides the seam methods only (docs/architecture.md, "The two buildings")."""
from __future__ import annotations

from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def swap_in(root: nn.Module, mod: nn.Module, cls: type[M], **fields) -> M:
    """Seat a `cls` made from `mod`, with `fields` set, wherever `mod` is a child below `root`."""
    if not issubclass(cls, type(mod)):
        raise TypeError(f"{cls.__name__} does not extend {type(mod).__name__}")
    new = cls.__new__(cls)
    new.__dict__.update(mod.__dict__)  # the same Parameter objects and children, under the same names
    for key, value in fields.items():
        setattr(new, key, value)
    seated = False
    for parent in root.modules():
        for name, child in parent._modules.items():
            if child is mod:
                parent._modules[name] = new
                seated = True
    if not seated:
        raise ValueError(f"{type(mod).__name__} is not held below {type(root).__name__}")
    return new
