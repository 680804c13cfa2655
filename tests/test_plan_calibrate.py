"""--calibrate RUN_DIR: the rate, link bandwidth and other programs' load fitted from a run's metrics and
config, and the predictions they give for other layouts (plan/calibrate.py). The live CPU demo
(calibrate on 2 ranks, predict 4) is bench/calibrate.py: its timings depend on the shared machine."""
from __future__ import annotations

import json
import os

import pytest

from harness import make_config
from meshlm import config as C
from meshlm.cli import main
from meshlm.plan import calibrate as K
from meshlm.plan.spec import PlanError

RATE, LINK, CORES = 3e10, 4e8, 2  # the machine the synthetic runs were "measured" on


def _write_run(path, cfg, world, load=0.0, noise=(1.0,), log_world=True):
    """A run directory whose metrics are what the planner predicts for `world` ranks of one thread on
    the known machine beside `load` other runnable threads. Like a real run, config.toml keeps
    parallel.dp = -1 and metrics.jsonl says the world size (unless `log_world` is off)."""
    cal = K.Calibration(RATE, LINK, CORES, load=load)
    est = K.predict(cal, cfg, world, threads=1)
    comm = {c["kind"]: {"calls": c["calls"], "bytes": c["bytes"], "seconds": c["seconds"]} for c in est["comm"]}
    avail = min(1.0, CORES / (world + load))  # seconds on a core / seconds runnable, per thread
    with open(os.path.join(path, "config.toml"), "w") as f:
        f.write(C.to_toml(cfg))
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for i, x in enumerate([5.0, 3.0] + list(noise) * 3):  # two warm-up steps, then the noise pattern
            rec = {"step": i + 1, "loss": 1.0, "step_s": est["step_s"] * x, "comm": comm,
                   "cpu_s": 0.5 * avail, "wait_s": 0.5 * (1 - avail)}
            if log_world:
                rec.update(world=world, threads=1, cores=CORES)
            f.write(json.dumps(rec) + "\n")
    return est


def _cfg(**kw):
    base = dict(model__preset="small", data__seq_len=128, training__global_batch=8, training__micro_batch=2)
    return make_config(**{**base, **kw})


@pytest.mark.parametrize("load", [0.0, 2.5])
def test_fit_recovers_the_machine_and_predicts_another_layout(tmp_path, load):
    """Rate, link and load come back exactly from a 2-rank dp run; the 4-rank tp 2 × dp 2 run on the
    same machine (4 ranks on 2 cores: each gets cores / (ranks + load) of one) is then predicted exactly."""
    a, b = tmp_path / "dp2", tmp_path / "tp2dp2"
    a.mkdir(), b.mkdir()
    _write_run(a, _cfg(), 2, load, noise=(0.9, 1.0, 1.3))  # medians after warm-up: outliers do not move the fit
    cal = K.fit(str(a), load=None)  # the load implied by the schedstat seconds
    assert cal.rate_flops == pytest.approx(RATE, rel=1e-6) and cal.link_bytes_s == pytest.approx(LINK, rel=1e-6)
    assert cal.cores == CORES and cal.load == pytest.approx(load, abs=1e-9)
    cfg4 = _cfg(parallel__tp=2)
    truth = _write_run(b, cfg4, 4, load)
    pred = K.predict(cal, cfg4, 4)
    assert pred["step_s"] == pytest.approx(truth["step_s"], rel=1e-6)
    # the core share: 4 ranks on 2 cores get half a core each on a quiet machine; under load the
    # 4-rank run loses less than twice what the 2-rank run did (the ranks compete per thread)
    assert K.core_share(4, CORES, 1) == 0.5 and K.core_share(2, CORES, 1) == 1.0
    assert K.core_share(4, CORES, 1, load) / K.core_share(2, CORES, 1, load) == pytest.approx(
        (2 + load) / (4 + load) if load else 0.5)
    assert K.core_share(1, 8, 4) == 4.0 and K.core_share(4, 0) == 1.0  # threads; a GPU per rank


def test_assumptions_matter(tmp_path):
    """What the calibration assumes changes its prediction: pricing the load measured during the
    calibration run per thread (not the default), or letting every rank have a core to itself."""
    a = tmp_path / "dp2"
    a.mkdir()
    _write_run(a, _cfg(), 2, load=2.5)
    cfg4 = _cfg(parallel__tp=2)
    loaded, quiet = K.predict(K.fit(str(a), load=None), cfg4, 4), K.predict(K.fit(str(a)), cfg4, 4)
    assert quiet["step_s"] > 1.2 * loaded["step_s"]  # per-thread sharing: 4 ranks win more of a loaded machine
    own_core = K.predict(K.Calibration(RATE, LINK, 0), cfg4, 4)
    assert own_core["step_s"] < 0.6 * K.predict(K.Calibration(RATE, LINK, CORES), cfg4, 4)["step_s"]


def test_calibrate_cli_and_errors(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _write_run(run, _cfg(training__micro_batch=4), 2)
    code = main(["estimate", "--calibrate", str(run), "--gpus", "4", "--json", "--model.preset", "small",
                 "--data.seq_len", "128", "--training.global_batch", "8", "--training.micro_batch", "4",
                 "--parallel.tp", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["gpu"] == "custom"
    assert out["step_s"] == pytest.approx(K.predict(K.fit(str(run)), _cfg(training__micro_batch=4, parallel__tp=2),
                                                    4)["step_s"], rel=1e-9)
    assert main(["plan", "--model", "small", "--gpus", "2", "--seq-len", "128"]) == 2
    assert "--gpu: give a GPU profile (or --calibrate RUN_DIR)" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PlanError, match="config.toml not found"):
        K.fit(str(empty))
    old = tmp_path / "old"  # a run logged before metrics carried the world size, dp not resolved
    old.mkdir()
    _write_run(old, _cfg(), 2, log_world=False)
    with pytest.raises(PlanError, match=r"does not record the world size .* parallel.dp = -1"):
        K.fit(str(old))
    (old / "metrics.jsonl").write_text('{"step": 1, "step_s": 1.0}\n' * 2)
    with pytest.raises(PlanError, match="has 2 logged steps; need more than 2"):
        K.fit(str(old))
