"""Uneven data parallelism (parallel.dp_weights, issue #51) with the other dimensions: context
parallelism, expert parallelism and MTP under padding, pipeline parallelism. Each row's losses, gradient
norms, routing metrics and MTP loss equal one process's (fp32, 1e-5 per step); the harness is
tests/test_dp_weights.py's `check_uneven_row`."""
import pytest
from harness import rows
from test_dp_weights import check_resume, check_uneven_row

from meshlm.parallel.dims.pipeline.runtime import sync_points
from meshlm.core.schedule.replay import p2p_batches
from meshlm.core.schedule.schedules import SCHEDULES, TAKES_VIRTUAL, V_SHAPED, build_schedule

CASES = [
    # a cp group lies inside one replica: its ranks run the replica's count; gradients meet over dp × cp
    ("dp2-cp2-zero1-3-1", 4, {"parallel__dp": 2, "parallel__cp": 2, "parallel__zero": 1,
                              "parallel__dp_weights": [3, 1]}, {}),
    # an ep group spans replicas: the lighter one pads (loss × 0) to join every all-to-all, and its
    # padding passes count in no routing statistic (the aux loss's gradient included)
    ("moe-dp2-ep2-3-1", 2, {"parallel__dp": 2, "parallel__ep": 2, "parallel__dp_weights": [3, 1]},
     {"model__preset": "moe-debug"}),
    ("moe-zero3-3-1", 2, {"parallel__zero": 3, "parallel__dp_weights": [3, 1]}, {"model__preset": "moe-debug"}),
    # MTP (and DeepSeek-V3's bias update and sequence-wise loss) under ZeRO-2's padding
    ("dsv3-zero2-3-1", 2, {"parallel__zero": 2, "parallel__dp_weights": [3, 1]}, {"model__preset": "dsv3-debug"}),
    # each replica's pipeline runs its own count (3 and 1 micro-batches); replicas meet at the step end
    ("dp2-pp2-1f1b-3-1", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__pp_schedule": "1f1b",
                             "parallel__dp_weights": [3, 1]}, {}),
    ("dp2-pp2-1f1b-zero1-3-1", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__pp_schedule": "1f1b",
                                   "parallel__zero": 1, "parallel__dp_weights": [3, 1]}, {}),
    # ZeRO-3 gathers per micro-batch over replicas: the lighter pipeline pads its schedule to 3
    ("dp2-pp2-1f1b-zero3-3-1", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__pp_schedule": "1f1b",
                                   "parallel__zero": 3, "parallel__dp_weights": [3, 1]}, {}),
    # two chunks per rank: the reductions of both chunks meet in one order whatever the count
    # (4 stages: four blocks, where TINY trains two)
    ("dp2-pp2-zbv-3-1", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__pp_schedule": "zbv",
                            "parallel__pp_virtual": 2, "parallel__dp_weights": [3, 1]}, {"model__n_layers": 4}),
    ("dp2-pp2-interleaved-1-3", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__pp_schedule": "interleaved",
                                    "parallel__pp_virtual": 2, "parallel__dp_weights": [1, 3]},
     {"training__global_batch": 16, "model__n_layers": 4}),
    # EP inside a pipeline: the lighter pipeline pads so every all-to-all is met
    ("moe-dp2-pp2-ep2-3-1", 4, {"parallel__dp": 2, "parallel__pp": 2, "parallel__pp_schedule": "1f1b",
                                "parallel__ep": 2, "parallel__dp_weights": [3, 1]}, {"model__preset": "moe-debug"}),
]


@pytest.mark.parametrize("name,world,layout,single", rows(CASES, slowest=[
    "dp2-pp2-1f1b-zero3-3-1", "dp2-pp2-zbv-3-1", "dp2-pp2-interleaved-1-3", "moe-dp2-pp2-ep2-3-1"]))
def test_uneven_dims_match_one_process(pools, name, world, layout, single):
    check_uneven_row(pools, world, layout, single)


def test_pipeline_checkpoint_under_weights_resumes_evenly_and_in_one_process(pools):
    """dp2 × pp2 saved under 3:1, resumed under 1:1 (the same layout) and in one process."""
    pp = {"parallel__dp": 2, "parallel__pp": 2, "parallel__pp_schedule": "1f1b"}
    check_resume(pools, 4, pp, pp)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_reductions_meet_in_one_order_whatever_the_count(schedule):
    """Under DDP / ZeRO-1 replicas with different pipeline counts meet only in the step's reductions,
    which fire on each chunk's last weight-gradient backward: their chunk order on every rank must not
    depend on the count, or a replica running 1 micro-batch would enter another collective than one
    running 3."""
    for p in (2, 4):
        v = 2 if schedule in TAKES_VIRTUAL | V_SHAPED else 1
        counts = [m for m in range(1, 13) if schedule not in TAKES_VIRTUAL or m % p == 0]
        orders = set()
        for m in counts:
            acts = build_schedule(schedule, p, m, v)
            items = [p2p_batches(acts[r]) for r in range(p)]
            orders.add(tuple(tuple(its[i].chunk for i in sync_points(its)) for its in items))
        assert len(orders) == 1 and all(len(o) == v for o in next(iter(orders))), (schedule, p, orders)
