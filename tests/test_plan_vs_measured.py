"""Issue 6 item 6: the planner's per-rank params/grads/optimizer bytes equal what the trainer measures
from live tensors (metrics.jsonl `mem`, rank 0) within 2%, for every layout that can run here."""
import pytest

from harness import make_config, run_layout, run_local
from meshlm.plan.estimate import estimate
from meshlm.plan.memory import stage_memory
from meshlm.plan.spec import shape_from_config, spec_from_config

CASES = [
    ("one-process-fp32", 1, {}),
    ("one-process-bf16", 1, {"training__precision": "bf16"}),
    ("dp2-fp16", 2, {"parallel__dp": 2, "training__precision": "fp16"}),
]


def predicted(cfg, world: int) -> dict:
    shape, spec = shape_from_config(cfg), spec_from_config(cfg, world)
    if spec.pp > 1:  # rank 0 holds the first stage
        return stage_memory(shape, spec, "first", True, 4)
    return estimate(shape, spec)["per_gpu"]


@pytest.mark.parametrize("name,world,overrides", CASES, ids=[c[0] for c in CASES])
def test_predicted_state_bytes_match_measured(pools, name, world, overrides):
    cfg = make_config(training__steps=2, **overrides)
    recs = run_local(cfg) if world == 1 else run_layout(pools, cfg, world)
    measured = recs[-1]["mem"]
    pred = predicted(cfg, world)
    for key in ("params", "grads", "optim"):
        assert measured[key] == pytest.approx(pred[key], rel=0.02), (key, measured[key], pred[key])
