"""A dimension's module swap (parallel/swap.py) builds a new instance of a documented subclass and seats
it where the model's module was: same parameters under the same names, the model's object untouched."""
import pathlib
import re

import pytest
import torch
from torch import nn

from meshlm.model import PRESETS, build_model
from meshlm.model.moe import MoE
from meshlm.parallel.dims.expert_parallel import ParallelMoE, parallel_moe
from meshlm.parallel.dims.tensor_parallel import ReplicatedKVLinear, SumGradLinear, sum_gain_grad
from meshlm.parallel.swap import swap_in


def test_swaps_keep_names_parameters_and_hooks():
    with torch.device("meta"):
        model = build_model(PRESETS["moe-debug"])
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    wk, norm = model.layers["0"].attention.wk, model.norm
    moe.register_forward_hook(lambda *a: None)

    new = parallel_moe(model, moe)
    swap_in(model, new.router, SumGradLinear, tp_comm=None)
    swap_in(model, wk, ReplicatedKVLinear, tp_comm=None, tp_rep=2)
    sum_gain_grad(model, norm, None)

    assert type(moe) is MoE and type(wk) is nn.Linear  # the model's own objects keep their class
    assert isinstance(new, ParallelMoE) and new is not moe and new.ep_comm is None
    assert parallel_moe(model, new) is new  # the second dimension finds it in place
    assert type(new.router) is SumGradLinear and type(model.layers["0"].attention.wk) is ReplicatedKVLinear
    assert model.layers["0"].attention.wk.tp_rep == 2
    assert type(model.norm).__name__ == "SummedGainRMSNorm" and model.norm.tp_comm is None
    assert new in list(model.modules()) and moe not in list(model.modules())
    assert len(new._forward_hooks) == 1
    assert list(model.state_dict()) == keys
    assert all(p is before[n] for n, p in model.named_parameters())


def test_swap_refuses_a_class_that_does_not_extend_the_module():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="does not extend Linear"):
        swap_in(model, model[0], ParallelMoE)
    with pytest.raises(ValueError, match="not held below"):
        swap_in(model, nn.Linear(2, 2), SumGradLinear, tp_comm=None)


def test_no_class_is_reassigned_in_the_product():
    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "meshlm"
    hits = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.__class__\s*=(?!=)", line)]
    assert not hits, hits
