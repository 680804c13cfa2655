"""layout.Layout is the one description of a run's degrees: `meshlm train` (layout.build_layout) and the
planner (plan.spec.spec_from_config) read the same Layout from a config through layout.from_config, and
the predicates, world size and mesh view the code branches on are the Layout's."""
import dataclasses

import pytest

from harness import make_config
from meshlm.core.layout import Layout, from_config, build_layout
from meshlm.plan.spec import priced_on, spec_from_config

CASES = [  # (config keys, world)
    ({}, 1),
    ({"parallel__tp": 2, "parallel__sp": True}, 4),
    ({"parallel__dp": 4, "parallel__zero": 3, "parallel__zero_group": 2}, 4),
    ({"parallel__pp": 2, "parallel__cp": 2, "parallel__zero": 1}, 8),
    ({"parallel__zero": 3, "parallel__hpz_group": 2, "parallel__quantize_weights": True}, 4),
    ({"model__preset": "moe-debug", "parallel__ep": 2, "parallel__zero": 3, "model__moe__capacity_factor": 0}, 4),
]


@pytest.mark.parametrize("keys,world", CASES)
def test_trainer_and_planner_read_one_layout(keys, world):
    cfg = make_config(**keys)
    trainer = build_layout(cfg, world)
    spec = spec_from_config(priced_on(cfg, gpu=False), world)
    assert isinstance(spec, Layout)
    assert {f.name: getattr(spec, f.name) for f in dataclasses.fields(Layout)} == dataclasses.asdict(trainer)
    assert trainer.world_size == spec.world_size == world
    assert from_config(cfg, world) == trainer


def test_the_layout_owns_the_mesh_view_and_the_predicates():
    hsdp = Layout(dp=8, tp=2, pp=2, cp=2, zero=3, zero_group=4, sp=True, micro_batch=2, accum=4)
    assert hsdp.world_size == 64 and hsdp.global_batch == 64 and hsdp.microbatches == 4
    assert (hsdp.dp_shard, hsdp.dp_replicate, hsdp.shard_group) == (4, 2, 8)
    assert hsdp.shape() == {"pp": 2, "dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 2, "ep": 1}
    assert all((hsdp.tp_enabled, hsdp.sp_enabled, hsdp.pp_enabled, hsdp.cp_enabled, hsdp.dp_enabled,
                hsdp.dp_replicate_enabled, hsdp.dp_shard_enabled, hsdp.dp_cp_enabled, hsdp.zero_enabled))
    assert not (hsdp.ep_enabled or hsdp.zeropp_enabled) and hsdp.zpp_group == 0
    one = Layout(sp=True)  # sp without tp is a no-op; nothing is reduced or sharded on one rank
    assert one.world_size == 1 and not any((one.sp_enabled, one.tp_enabled, one.dp_cp_enabled, one.zero_enabled))
    plain = Layout(dp=4, cp=2)  # without ZeRO every dp rank holds everything: one replica per rank
    assert (plain.dp_shard, plain.dp_replicate, plain.shard_group) == (1, 4, 1) and plain.dp_cp_enabled
    hpz = Layout(dp=8, zero=3, zero_group=8, hpz_group=2)
    assert hpz.zeropp_enabled and hpz.zpp_group == 2 and hpz.shape()["zpp"] == 2
    assert Layout(dp=8, zero=3, zero_group=8, quantize_grads=True).zpp_group == 8  # qgZ alone: the shard group


def test_from_config_without_a_world_counts_the_degrees():
    assert from_config(make_config(parallel__dp=2, parallel__tp=2, parallel__pp=2)).world_size == 8
    assert from_config(make_config(parallel__tp=2)).world_size == 2  # dp = -1: one replica
