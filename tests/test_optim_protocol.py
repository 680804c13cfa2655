"""One optimizer interface (parallel/optim/adamw.py `Optimizer`) for the three AdamW wrappers the layouts build."""
import inspect

import pytest

from meshlm.parallel.optim.adamw import Optimizer
from meshlm.parallel.optim.muon import MuonAdamW
from meshlm.parallel.optim.nvme import NvmeOptimizer
from meshlm.parallel.optim.zero_adamw import ZeroOptimizer
from meshlm.parallel.optim.master import MasterOptimizer

MEMBERS = [n for n, v in vars(Optimizer).items() if callable(v) and not n.startswith("_")]


def test_protocol_names_what_the_trainer_calls():
    assert set(MEMBERS) == {"set_lr", "step", "param_tensors", "state_bytes", "step_count", "state_storage",
                            "loaded", "backing", "close"}


@pytest.mark.parametrize("cls", [MasterOptimizer, ZeroOptimizer, NvmeOptimizer, MuonAdamW], ids=lambda c: c.__name__)
def test_every_optimizer_has_the_protocol_methods(cls):
    for name in MEMBERS:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        want = list(inspect.signature(getattr(Optimizer, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} differs from Optimizer.{name}{want}"
