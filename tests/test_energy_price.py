"""Predicted energy (docs/energy.md, "Predicted energy and the Pareto front"): the card figures, J/step
and J/token, the run's kWh, cost and emissions, the flags' bad input, the calibration's fit, the
objectives' ranking and Pareto front, and the clock plan."""
from __future__ import annotations

import argparse
import json

import pytest

from meshlm.core.facts.power import CARD_POWER, VOLTAGE_FLOOR, Power, clock_power
from meshlm.plan import cli as cli_cmds
from meshlm.plan.calibrate.power import fit_power, measured_watts
from meshlm.plan.cost.clocks import clock_plan
from meshlm.plan.cost.energy import Site, power_of, price
from meshlm.plan.cost.estimate import Options, estimate
from meshlm.plan.hardware import PROFILES, get_gpu
from meshlm.plan.search.objective import ordering, pareto_front, price_rows
from meshlm.plan.search.ranked import plan
from meshlm.plan.spec import Shape, Spec, presets

CONFIG_70B = "configs/llama3-70b-32xh100.toml"


def _run(argv):
    p = argparse.ArgumentParser(prog="meshlm")
    cli_cmds.add_parsers(p.add_subparsers(dest="command", required=True))
    args, extra = p.parse_known_args(argv)
    return args.func(args, extra)


def test_every_card_has_ordered_power_figures():
    for key, gpu in PROFILES.items():
        p = CARD_POWER[key]
        assert power_of(gpu) == p
        assert 0 < p.idle_w < p.comm_w < p.memory_w < p.busy_w
    assert clock_power(CARD_POWER["h100-sxm-80gb"], 1.0) == 700.0
    p = Power(700, 500, 300, 100)
    assert clock_power(p, 0.8) == pytest.approx(100 + 600 * 0.8 ** 3)
    assert clock_power(p, VOLTAGE_FLOOR / 2) == pytest.approx(100 + 600 * VOLTAGE_FLOOR / 2 * VOLTAGE_FLOOR ** 2)


def test_estimate_prices_energy_consistently(capsys):
    assert _run(["estimate", "--config", CONFIG_70B, "--gpu", "h100", "--gpus", "32", "--energy-price", "0.12",
                 "--carbon-intensity", "350", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    e, run = r["energy"], r["energy"]["run"]
    tokens = r["tokens_per_s_per_gpu"] * r["step_s"] * r["gpus"]
    assert e["j_per_token"] == pytest.approx(e["j_per_step"] / tokens)
    assert sum(e["by_category_j"].values()) == pytest.approx(e["gpu_j"] * e["pue"])
    assert e["j_per_step"] == pytest.approx((e["gpu_j"] + e["host_j"]) * 1.2)
    assert run["cost"] == pytest.approx(run["kwh"] * 0.12)
    assert run["kg_co2e"] == pytest.approx(run["kwh"] * 350 / 1000)
    steps = 10_000  # the config's training.steps, no ramp: kWh = J/step × steps
    assert run["kwh"] == pytest.approx(e["j_per_step"] * steps / 3.6e6, rel=1e-9)
    assert 75 < e["gpu_w"] < 700
    assert _run(["estimate", "--config", CONFIG_70B, "--gpu", "h100", "--gpus", "32", "--energy-price", "0.12",
                 "--carbon-intensity", "350"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("energy:")][0]
    assert "J/token" in line and "kWh" in line and f"cost {run['cost']:,.2f}" in line and "kgCO2e" in line


def test_pue_scales_and_hosts_add():
    shape = Shape(presets()["llama3-8b"], "llama3-8b")
    gpu = get_gpu("h100")
    r = estimate(shape, Spec(dp=8, zero=1, micro_batch=1, accum=8, seq_len=4096), gpu)
    a = price(r, power_of(gpu), 8, Site(host_w=0, pue=1.0))
    b = price(r, power_of(gpu), 8, Site(host_w=0, pue=1.5))
    c = price(r, power_of(gpu), 8, Site(host_w=1000, pue=1.0))
    assert b["j_per_step"] == pytest.approx(1.5 * a["j_per_step"])
    assert c["j_per_step"] == pytest.approx(a["j_per_step"] + 1000 * r["step_s"])


@pytest.mark.parametrize("flags, says", [
    (["--pue", "0.9"], "--pue"), (["--energy-price", "-1"], "--energy-price"),
    (["--carbon-intensity", "-5"], "--carbon-intensity")])
def test_estimate_bad_energy_input(capsys, flags, says):
    assert _run(["estimate", "--config", CONFIG_70B, "--gpu", "h100", "--gpus", "32", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_plan_unknown_objective(capsys):
    assert _run(["plan", "--model", "debug", "--gpu", "h100", "--gpus", "8", "--objective", "cheap"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--objective" in err and len(err.splitlines()) == 1


def _metrics(path, watts_per_gpu: float, world: int = 8, n: int = 6, step_s: float = 2.0):
    with open(path / "metrics.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"step": i + 1, "step_s": step_s, "world": world, "time": 1000.0 + i * step_s,
                                "energy_j": None if i == 0 else watts_per_gpu * world * step_s,
                                "power_w": None if i == 0 else watts_per_gpu * world}) + "\n")


def test_calibration_fits_the_figures_above_idle(tmp_path):
    _metrics(tmp_path, 450.0)
    assert measured_watts(str(tmp_path)) == pytest.approx(450.0)
    base = CARD_POWER["h100-sxm-80gb"]
    fitted, note = fit_power(str(tmp_path), base, predicted_gpu_w=500.0)
    assert fitted.idle_w == base.idle_w and "fitted" in note
    k = (450 - 75) / (500 - 75)
    assert fitted.busy_w == pytest.approx(75 + k * 625)
    # a run without energy keeps the card's figures; a machine without figures gets the measured one
    (tmp_path / "none").mkdir()
    _metrics(tmp_path / "none", 0.0)
    with open(tmp_path / "none" / "metrics.jsonl", "w") as f:
        f.write("\n".join(json.dumps({"step": i, "step_s": 1.0, "energy_j": None, "power_w": None})
                          for i in range(5)))
    assert fit_power(str(tmp_path / "none"), base, 500.0)[0] is base
    flat, _ = fit_power(str(tmp_path), None, None)
    assert flat == Power(450.0, 450.0, 450.0, 450.0)


@pytest.fixture(scope="module")
def searched():
    """One small search, its kept layouts priced in full by time and again under each objective."""
    shape, gpu = Shape(presets()["llama3-8b"], "llama3-8b"), get_gpu("h100")
    power, site, keep = power_of(gpu), Site(), 40
    args = (shape, gpu, 32, 4096, 2 ** 21)
    every = plan(*args, top=keep, keep=keep).ranked
    price_rows(every, power, gpu, site)
    got = {o: plan(*args, top=keep, keep=keep, order=ordering(o, power, gpu, site)).ranked for o in ("energy", "pareto")}
    return every, got


def test_pareto_front_is_not_dominated(searched):
    every, got = searched
    front = got["pareto"]
    assert len(front) >= 2
    assert [r["step_s"] for r in front] == sorted(r["step_s"] for r in front)
    points = [(r["step_s"], r["j_per_token"]) for r in every]
    for r in front:
        mine = (r["step_s"], r["j_per_token"])
        assert not any(q[0] <= mine[0] and q[1] <= mine[1] and q != mine for q in points)
    assert len({(r["step_s"], r["j_per_token"]) for r in front}) == len(front)
    assert pareto_front([{"step_s": 1, "j_per_token": 2}, {"step_s": 1, "j_per_token": 2},
                         {"step_s": 2, "j_per_token": 1}, {"step_s": 3, "j_per_token": 1}]) == [0, 2]


def test_energy_objective_ranks_by_j_per_token(searched):
    every, got = searched
    js = [r["j_per_token"] for r in got["energy"]]
    assert js == sorted(js) and js[0] == pytest.approx(min(r["j_per_token"] for r in every))


def test_clock_plan_within_its_bound():
    shape, gpu = Shape(presets()["llama3-8b"], "llama3-8b"), get_gpu("h100")
    s = Spec(dp=2, pp=4, pp_schedule="1f1b", micro_batch=1, accum=16, seq_len=4096, pp_layers=(6, 10, 10, 6))
    got = clock_plan(shape, s, gpu, Options(), power_of(gpu), 0.01)
    assert len(got["clocks"]) == 4 and all(VOLTAGE_FLOOR <= c <= 1 for c in got["clocks"])
    assert got["slowdown"] <= 0.01 + 1e-9 and got["saving"] > 0
    assert min(got["clocks"]) < 1  # the lighter end stages have slack to slow into
    none = clock_plan(shape, s, gpu, Options(), power_of(gpu), 0.0)
    assert none["slowdown"] <= 1e-9 and none["saving"] >= 0
    assert clock_plan(shape, Spec(dp=8, micro_batch=1, accum=2, seq_len=4096), gpu, Options(), power_of(gpu), 0.01) is None


def test_plan_emits_the_clock_plan_as_data(capsys, tmp_path):
    out = tmp_path / "best.toml"
    assert _run(["plan", "--model", "llama3-1b", "--gpu", "h100", "--gpus", "8", "--fix", "pp=4", "--fix", "tp=1",
                 "--fix", "zero=1", "--fix", "ac=none", "--fix", "pp_schedule=1f1b", "--seq-len", "2048",
                 "--global-batch-tokens", str(2 ** 18), "--top", "2", "--objective", "energy", "--emit-config", str(out)]) == 0
    text = capsys.readouterr().out
    assert "J/token" in text and "clock plan" in text
    from meshlm.core import config as C
    clocks = C.load(str(out)).training.energy.clocks  # the key itself (core/config/energy.py), read back
    assert len(clocks) == 4 and all(0.5 <= c <= 1.0 for c in clocks) and max(clocks) == 1.0


def test_estimate_calibrated_on_a_run_with_energy_reproduces_its_draw(tmp_path, capsys):
    """The H100 run's config and metrics (tests/data), with 500 W per GPU of energy written in: the fitted
    figures price the run's own layout at 500 W, and say they were fitted."""
    import os
    import shutil
    run = os.path.join(os.path.dirname(__file__), "data", "h100-run-llama3-1b")  # as tests/test_plan_calibrate.py
    shutil.copy(os.path.join(run, "config.toml"), tmp_path / "config.toml")
    with open(os.path.join(run, "metrics.jsonl")) as f, open(tmp_path / "metrics.jsonl", "w") as out:
        for i, line in enumerate(x for x in f if x.strip()):
            r = json.loads(line)
            if "step_s" in r:
                r.update(time=1.0e9 + 10.0 * i, energy_j=500.0 * (r.get("world") or 1) * 10.0)
            out.write(json.dumps(r) + "\n")
    assert _run(["estimate", "--calibrate", str(tmp_path), "--config", str(tmp_path / "config.toml"), "--gpus", "1",
                 "--json"]) == 0
    e = json.loads(capsys.readouterr().out)["energy"]
    assert e["gpu_w"] == pytest.approx(500.0, rel=1e-6) and "fitted" in e["source"]
