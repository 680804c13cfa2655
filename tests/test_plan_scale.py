"""What grows with the number of ranks (plan/cost/scale.py; docs/planner.md, "What grows with the number of
ranks"): the jitter the planner uses is the one our GPU rows measured (recomputed here from the
files, not copied), the wait for the slowest rank is zero on one rank and grows as sqrt(2 ln N)
through the whole estimate, a ring's latency grows with its n − 1 hops and a tree all-reduce's with
log2 n, and `meshlm estimate` prints both terms."""
import argparse
import json
import math
import os

import pytest

from meshlm.plan import cli as cli_cmds
from meshlm.plan.cost.estimate import Options, estimate, step_categories
from meshlm.plan.hardware import get_gpu
from meshlm.plan.cost.scale import STEP_JITTER_S, jitter_of_rows
from meshlm.plan.spec import Shape, Spec, presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = get_gpu("h100")


def test_step_jitter_is_what_our_gpu_rows_measured():
    with open(os.path.join(ROOT, "tests/data/h100-run-llama3-1b/metrics.jsonl")) as f:
        run = [json.loads(x) for x in f if x.strip()]
    with open(os.path.join(ROOT, "bench/results/2026-11-26-nvidia-h200/headline/headline.json")) as f:
        rows = [r.get("result") for r in json.load(f)["rows"].values()]
    series = [[r["step_s"] for r in run if r["step"] >= 3 and r["step"] != 8]]  # start-up and profiled step out
    ranges = [(r["step_s_min"], r["step_s_max"], r["steps"]) for r in rows if isinstance(r, dict) and "step_s_min" in r]
    assert len(ranges) >= 5
    assert jitter_of_rows(series, ranges) == pytest.approx(STEP_JITTER_S, rel=0.01)


def _est(shape: Shape, spec: Spec, **o) -> dict:
    return estimate(shape, spec, H100, Options(**o), validate=False)


@pytest.mark.parametrize("n", [2, 8, 64, 8192])
def test_straggler_wait_is_zero_on_one_rank_and_grows_as_sqrt_2_ln_n(n):
    shape = Shape(presets()["llama3-8b"], "llama3-8b")
    one = _est(shape, Spec(dp=1, zero=0, micro_batch=1, accum=8, seq_len=8192))
    assert one["time"]["straggler_s"] == 0.0
    spec = Spec(dp=n, zero=1, zero_group=n, micro_batch=1, accum=8, seq_len=8192)
    est, none = _est(shape, spec), _est(shape, spec, step_jitter_s=0.0)
    wait = est["time"]["straggler_s"]
    assert wait == pytest.approx(STEP_JITTER_S * math.sqrt(2 * math.log(n)), rel=1e-9)
    assert est["step_s"] - none["step_s"] == pytest.approx(wait, rel=1e-6)  # a term of the step, nothing else
    assert step_categories(est)["straggler"] == wait
    assert sum(step_categories(est).values()) == pytest.approx(est["step_s"], rel=1e-9)


def _depth_s(n: int, zero: int, kind: str) -> float:
    """The latency beyond a two-rank call's of the data-parallel collective `kind` over `n` ranks, each
    on its own node (tp 8 fills the node): all on InfiniBand."""
    shape = Shape(presets()["llama3-8b"], "llama3-8b")
    spec = Spec(tp=8, sp=True, dp=n, zero=zero, zero_group=n if zero else 1, micro_batch=1, accum=4, seq_len=8192)
    for c in _est(shape, spec)["comm"]:
        if c["group"].startswith("dp") and c["kind"] == kind:
            assert c["link"] == "ib"
            return c["latency_depth_s"] / c["calls"]
    raise AssertionError(f"no dp {kind} at dp {n}")


def test_ring_latency_grows_with_its_hops_and_a_tree_with_log2_n():
    assert _depth_s(2, 3, "all_gather") == 0.0  # a two-rank call is what the per-call latency is
    unit = _depth_s(4, 3, "all_gather") / 2   # n − 1 hops: 2 beyond the two-rank call's 1
    assert unit > 0
    for n in (16, 128, 1024):
        assert _depth_s(n, 3, "all_gather") == pytest.approx(unit * (n - 2), rel=1e-9)
    # plain DP's all-reduce: the tree's 2·log2 n hops (fewer than the ring's 2(n − 1)), 2 at two ranks
    for n in (16, 128, 1024):
        assert _depth_s(n, 0, "all_reduce") == pytest.approx(unit * (math.log2(n) - 1), rel=1e-9)


def test_estimate_prints_both_terms(capsys):
    p = argparse.ArgumentParser(prog="meshlm")
    cli_cmds.add_parsers(p.add_subparsers(dest="command", required=True))
    args, extra = p.parse_known_args(["estimate", "--config", os.path.join(ROOT, "configs/llama3-70b-32xh100.toml"),
                                      "--gpu", "h100", "--gpus", "32"])
    assert args.func(args, extra) == 0
    lines = {ln.strip().rsplit(" s ", 1)[0].rsplit(None, 1)[0]: ln for ln in capsys.readouterr().out.splitlines()
             if " s " in ln}
    for name in ("comm latency depth", "slowest of N ranks"):
        assert name in lines and float(lines[name].split()[-3]) > 0, lines.get(name)

