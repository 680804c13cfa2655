"""--calibrate RUN_DIR: the rate and link bandwidth fitted from a run's metrics and config, and the
predictions they give for other layouts (plan/calibrate.py)."""
from __future__ import annotations

import json
import os

import pytest

from harness import make_config
from meshlm import config as C
from meshlm.cli import main
from meshlm.plan import calibrate as K
from meshlm.plan.estimate import estimate
from meshlm.plan.spec import PlanError, shape_from_config, spec_from_config

RATE, LINK, CORES = 3e10, 4e8, 2  # the machine the synthetic run was "measured" on


def _write_run(path, cfg, world, noise=(1.0,)):
    """A run directory whose step times are what the planner predicts on the known machine."""
    cfg.parallel.dp = world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    gpu, o = K.device_and_options(K.Calibration(RATE, LINK, CORES), world)
    est = estimate(shape_from_config(cfg), spec_from_config(cfg, world), gpu, o)
    comm = {c["kind"]: {"calls": c["calls"], "bytes": c["bytes"], "seconds": c["seconds"]} for c in est["comm"]}
    with open(os.path.join(path, "config.toml"), "w") as f:
        f.write(C.to_toml(cfg))
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for i, x in enumerate([5.0, 3.0] + list(noise) * 3):  # two warm-up steps, then the noise pattern
            f.write(json.dumps({"step": i + 1, "loss": 1.0, "step_s": est["step_s"] * x, "comm": comm}) + "\n")
    return est


def test_fit_recovers_the_machine_and_predicts_another_layout(tmp_path):
    a, b = tmp_path / "dp4", tmp_path / "tp2dp2"
    a.mkdir(), b.mkdir()
    cfg2 = make_config(model__preset="small", data__seq_len=128, training__global_batch=8, training__micro_batch=2)
    _write_run(a, cfg2, 4, noise=(0.9, 1.0, 1.3))  # medians after warm-up: outliers do not move the fit
    cal = K.fit(str(a), cores=CORES)
    assert cal.rate_flops == pytest.approx(RATE, rel=1e-6) and cal.link_bytes_s == pytest.approx(LINK, rel=1e-6)
    cfg4 = make_config(model__preset="small", data__seq_len=128, training__global_batch=8, training__micro_batch=4,
                       parallel__tp=2)
    truth = _write_run(b, cfg4, 4)
    gpu, o = K.device_and_options(cal, 4)
    pred = estimate(shape_from_config(cfg4), spec_from_config(cfg4, 4), gpu, o)
    assert pred["step_s"] == pytest.approx(truth["step_s"], rel=1e-6)
    # four ranks on two cores: each gets half a core's rate, so the same work per rank takes longer
    gpu2, _ = K.device_and_options(cal, 2)
    assert gpu.peak_flops == pytest.approx(gpu2.peak_flops / 2)


def test_calibrate_cli_and_errors(tmp_path, capsys):
    cfg = make_config(model__preset="small", data__seq_len=128, training__global_batch=8, training__micro_batch=4)
    _write_run(tmp_path, cfg, 2)
    code = main(["estimate", "--calibrate", str(tmp_path), "--gpus", "4", "--json", "--model.preset", "small",
                 "--data.seq_len", "128", "--training.global_batch", "8", "--training.micro_batch", "4",
                 "--parallel.tp", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["step_s"] > 0 and out["gpu"] == "custom"
    assert main(["plan", "--model", "small", "--gpus", "2", "--seq-len", "128"]) == 2
    assert "--gpu: give a GPU profile (or --calibrate RUN_DIR)" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PlanError, match="config.toml not found"):
        K.fit(str(empty))
