"""The planner's speed model against two unequal CPU ranks (dp2 and pp2) (issue 51, item 5; docs/heterogeneous.md,
"The speed model on two CPU ranks"): rank 1 is made a 2.5× slower card by the fault plugin's delay per
FLOP (tests/fault_plugin.py `SlowCard`: it sleeps for the planner's FLOPs of its micro-batches), the
planner plans the two ranks as two card profiles of those speeds, and dp2 runs with the planner's
weights and with equal ones. The weighted step is shorter, and the waiting rank's idle time (its
seconds in the step runner less its own compute: the wait for the other replica in the gradient
all-reduce) is within 20% of the planner's prediction (step minus that rank's busy time). The CPU's own compute per micro-batch
(measured on the rank that never waits) is part of both cards' profiles. pp2: the speed split of the
blocks has the shorter step, and every rank's idle in both splits is within 20% of the planner's."""
import dataclasses
import json
import os
import tempfile

import pytest
from harness import make_config, train_hooked

from meshlm.core.cards import FP32_RATIO
from meshlm.plan.cluster import Cluster, Group
from meshlm.plan.cost.estimate import _fwd_flops
from meshlm.plan.hardware import get_gpu
from meshlm.plan.mixed.search import plan_mixed
from meshlm.plan.mixed.price import price_data, price_pipeline, speed_split, weights_of
from meshlm.plan.cost.options import Options
from meshlm.plan.spec import Spec, search_knobs, shape_from_config

SLOWER = 2.5         # rank 1 against rank 0
FAST_MB_S = 0.2      # rank 0's delay per micro-batch: far above the debug model's real compute (~ms)
STEPS = 3            # the first step (start-up) is left out of the comparison


def _card(name: str, seconds_per_flop: float) -> Group:
    """A profile whose fp32 rate is 1 / seconds_per_flop, with links and memory that cost nothing."""
    gpu = get_gpu("custom", peak_tflops=1 / (seconds_per_flop * FP32_RATIO) / 1e12, hbm_gb=1000, hbm_tbps=1e6,
                   nvlink_gbps=1e6, ib_gbps=1e6)
    return Group(name, gpu, 1)


def _measured(run_dir: str) -> tuple[float, list[float]]:
    """(mean step, each rank's mean seconds in the step runner: its own compute and its wait for the other
    replica in the gradient all-reduce) over the steps after the first."""
    ranks = []
    for r in (0, 1):
        with open(os.path.join(run_dir, f"card_times_rank{r}.jsonl")) as f:
            ranks.append([json.loads(x) for x in f][1:])
    steps = [max(a["sleep_s"] + a["run_s"], b["sleep_s"] + b["run_s"]) for a, b in zip(*ranks)]
    return sum(steps) / len(steps), [sum(x["run_s"] for x in rs) / len(rs) for rs in ranks]


def _train(pools, weights: list[int], per_flop: list[float]) -> tuple[float, list[float]]:
    run_dir = tempfile.mkdtemp(prefix="hetero-cpu-")
    cfg = make_config(parallel__dp=2, training__global_batch=8, training__micro_batch=1, training__steps=STEPS,
                      parallel__dp_weights=weights)
    train_hooked(pools, cfg, 2, run_dir, {"MESHLM_TEST_SECONDS_PER_FLOP": ",".join(map(repr, per_flop))})
    return _measured(run_dir)


def _cluster(per_flop: list[float], own_mb_s: float, flops_mb: float) -> Cluster:
    """The two ranks as cards: the injected delay plus the CPU's own compute per FLOP."""
    own = own_mb_s / flops_mb
    return Cluster((_card("cpu-fast", per_flop[0] + own), _card("cpu-slow", per_flop[1] + own)))


def _idle(run_s: list[float], accums: tuple) -> tuple[int, float, float]:
    """(the rank that waits: the one with less delay to sleep, its measured idle, the CPU's own compute
    per micro-batch in this run): the other rank never waits, so its runner seconds over its
    micro-batches are the CPU's own compute, which the waiting rank's runner seconds also hold."""
    waiting = min(range(2), key=lambda r: accums[r] * (SLOWER if r else 1.0))
    own_mb = run_s[1 - waiting] / accums[1 - waiting]
    return waiting, run_s[waiting] - accums[waiting] * own_mb, own_mb


@pytest.mark.slowest
def test_planner_weights_shorten_the_step_and_predict_idle_time(pools):
    cfg = make_config(parallel__dp=2, training__global_batch=8, training__micro_batch=1, training__steps=STEPS)
    shape, seq = shape_from_config(cfg), cfg.data.seq_len
    flops_mb = 3 * seq * _fwd_flops(shape, 1, seq, shape.args.n_layers, True)[0]
    per_flop = [FAST_MB_S / flops_mb, SLOWER * FAST_MB_S / flops_mb]
    o = Options(efficiency=1.0, block_overhead_s=0.0)  # the flat model: FLOPs at the card's rate

    def price(accums: tuple, own_mb_s: float):
        spec = dataclasses.replace(base, dp_accums=accums, accum=max(accums))
        return price_data(shape, spec, _cluster(per_flop, own_mb_s, flops_mb), o)

    # equal weights first: the slow rank never waits there, so its runner seconds are the CPU's own
    # compute of its 4 micro-batches, which each card's profile adds to the injected delay (a calibration)
    e_step, e_run = _train(pools, [], per_flop)
    fixed = {"pp": 1, "tp": 1, "zero": 0, "micro_batch": 1, "ac": "none", "offload": "none"}
    plan = plan_mixed(shape, _cluster(per_flop, e_run[1] / 4, flops_mb), seq, 8 * seq, "fp32", 1, fixed, o,
                      knobs=search_knobs(cfg))
    base = plan.ranked[0].spec
    accums = base.dp_accums
    assert plan.ranked[0].spans == "dp" and sum(accums) == 8 and accums[0] > accums[1]  # [3, 1] unless loaded
    w_step, w_run = _train(pools, weights_of(list(accums)), per_flop)
    for name, run_s, acc, step in (("equal", e_run, (4, 4), e_step), ("weighted", w_run, accums, w_step)):
        waiting, idle, own_mb = _idle(run_s, acc)
        priced = price(acc, own_mb)  # the planner's prediction with this run's CPU compute in the profiles
        pred = [priced.step_s - t["busy_s"] for t in priced.per_type]
        assert pred[1 - waiting] < 0.01 and pred[waiting] > 0.1, (name, pred)
        assert abs(idle - pred[waiting]) <= 0.2 * pred[waiting], (name, run_s, pred)
        assert step == pytest.approx(priced.step_s, rel=0.2), (name, step, priced.step_s)
        if name == "equal":
            e_planned, e_waiting = priced.step_s, waiting
        else:
            w_planned = priced.step_s
    assert e_waiting == 0  # under equal weights the fast rank waits for the slow one
    assert w_step < e_step and w_planned < e_planned


# rank 0's forward delay per block and micro-batch (8 blocks of the debug model): large enough that the
# fill and drain idles (about one second) dwarf what no profile holds (the CPU's compute, gloo's p2p)
BLOCK_FWD_S = 0.1


@pytest.mark.slowest
def test_speed_split_pipeline_shortens_the_step_and_predicts_idle_time(pools):
    overrides = dict(model__n_layers=8, parallel__pp=2, parallel__dp=1, parallel__pp_schedule="1f1b",
                     training__global_batch=4, training__micro_batch=1, training__steps=STEPS)
    cfg = make_config(**overrides)
    shape, seq = shape_from_config(cfg), cfg.data.seq_len
    block = seq * _fwd_flops(shape, 1, seq, 1, False)[0]
    per_flop = [BLOCK_FWD_S / block, SLOWER * BLOCK_FWD_S / block]
    cluster = _cluster(per_flop, 0.0, block)
    o = Options(efficiency=1.0, block_overhead_s=0.0)
    base = Spec(pp=2, micro_batch=1, accum=4, seq_len=seq, precision="fp32", pp_schedule="1f1b")
    split = speed_split(shape, base, list(cluster.groups), o)
    assert sum(split) == 8 and split[0] > split[1]  # the slower card's stage holds fewer blocks
    results = {}
    for name, layers in (("speed", list(split)), ("even", [4, 4])):
        run_dir = tempfile.mkdtemp(prefix=f"hetero-pp-{name}-")
        train_hooked(pools, make_config(**overrides, parallel__pp_layers=layers), 2, run_dir,
                     {"MESHLM_TEST_SECONDS_PER_BLOCK_FLOP": ",".join(map(repr, per_flop))})
        ranks = []
        for r in (0, 1):
            with open(os.path.join(run_dir, f"card_times_rank{r}.jsonl")) as f:
                ranks.append([json.loads(x) for x in f][1:])
        steps = [max(a["run_s"], b["run_s"]) for a, b in zip(*ranks)]  # the ranks meet at every step's end
        step = sum(steps) / len(steps)
        idle = [sum(t - x["sleep_s"] for t, x in zip(steps, rs)) / len(rs) for rs in ranks]
        priced = price_pipeline(shape, dataclasses.replace(base, pp_layers=tuple(layers)), cluster, o, simulate=True)
        pred = [priced.step_s - t["busy_s"] for t in priced.per_type]
        results[name] = (step, idle, priced.step_s, pred)
        assert step == pytest.approx(priced.step_s, rel=0.2), (name, results[name])
    (s_step, _, s_planned, _), (e_step, e_idle, e_planned, e_pred) = results["speed"], results["even"]
    assert s_step < e_step and s_planned < e_planned
    # every rank's idle (the even split's fast first stage waits most of the step; the speed split's ranks
    # only in the fill and drain) within 20% of the planner's: the CPU's own compute and gloo's p2p (~0.1 s
    # a step here, in no card profile) stay small beside idles of one second and more at this delay
    assert e_pred[0] > 5 and min(min(r[3]) for r in results.values()) > 1.0, results
    for step, idle, planned, pred in results.values():
        assert idle == pytest.approx(pred, rel=0.2), results
