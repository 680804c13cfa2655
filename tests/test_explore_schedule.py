"""The explorer's schedule and mixed clusters through its API (explore/api.py, explore/course.py): the
sampled learning rate is the trainer's `lr_at`, the batch `BatchRamp`'s, the corners are there, the
number of points does not grow with the run, the run total is `meshlm estimate`'s; a mixed cluster's plan
rows load back into the same estimate, with the comparison against the fastest type alone."""
import json
import tracemalloc

import pytest

from meshlm.core import config as C
from meshlm.cli import main
from meshlm.core.facts.ramp import BatchRamp
from meshlm.explore import api
from meshlm.explore.course import MAX_POINTS, sample_course
from meshlm.core.facts.course import lr_at

BASE = {"model.preset": "llama3-8b", "gpu": "h100-sxm-80gb", "gpus": 8, "data.seq_len": 4096,
        "global_batch_tokens": 4096 * 512, "training.micro_batch": 1, "parallel.zero": 3}
CORNER_KEYS = {"cosine": {"warmup_end", "decay_start"}, "linear": {"warmup_end", "decay_start"},
               "constant": {"warmup_end"}, "wsd": {"warmup_end", "decay_start"}}


def course_cfg(steps: int, **keys) -> C.Config:
    cfg = C.Config()
    for k, v in dict({"training.steps": steps, "training.global_batch": 512}, **keys).items():
        C.apply(cfg, k, v)
    return cfg


@pytest.mark.parametrize("schedule,decay_type", [("cosine", "linear"), ("linear", "linear"), ("constant", "linear"),
                                                 ("wsd", "sqrt"), ("wsd", "cosine")])
def test_sampled_points_are_lr_at_and_batch_ramp_with_every_corner(schedule, decay_type):
    ramp = [32, 32, 300_000]
    body = dict(BASE, **{"training.steps": 10_000, "optim.schedule": schedule, "optim.decay_type": decay_type,
                         "optim.warmup": 100, "optim.lr": 3e-4, "optim.min_lr_ratio": 0.05,
                         "training.batch_rampup": "32, 32, 300000"})
    if schedule == "wsd":
        body["optim.decay_steps"] = 0.15
    res = api.run_estimate(body)
    c = res["course"]
    cfg, _, _, _, _ = api.parse(body)
    steps = c["step"]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == 9_999
    for s, lr in zip(steps, c["lr"]):
        assert lr == lr_at(s, cfg.optim, 10_000)
    r = BatchRamp(512, ramp)
    assert c["batch"] == [r.batch(s) for s in steps] and c["batch"][0] == 32 and c["batch"][-1] == 512
    want = {"warmup_end": 99, "ramp_end": r.ramp_steps} | \
        ({"decay_start": 8_500 if schedule == "wsd" else 100} if schedule != "constant" else {})
    assert set(c["corners"]) == CORNER_KEYS[schedule] | {"ramp_end"} and c["corners"] == want
    for step in want.values():  # the corner and the step before it: the straight segments bend there
        assert step in steps and step - 1 in steps
    peak = steps.index(99)
    assert c["lr"][peak] == 3e-4 and c["lr"][peak - 1] < 3e-4
    if schedule == "wsd":  # flat until the decay, at the floor on the last step
        assert c["lr"][steps.index(8_499)] == 3e-4 > c["lr"][steps.index(8_500)]
        assert c["lr"][-1] == pytest.approx(3e-4 * 0.05)


def test_a_million_steps_give_as_few_points_as_a_thousand():
    """≤ MAX_POINTS evenly spaced samples + the corners (and each corner's step before), for 10³ and 10⁶
    steps alike; sampling 10⁶ steps holds no per-step list."""
    counts, peaks = [], []
    for steps in (1_000, 1_000_000):
        cfg = course_cfg(steps, **{"optim.schedule": "wsd", "optim.warmup": 37, "training.batch_rampup": "64,64,9000"})
        tracemalloc.start()
        c = sample_course(cfg)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert len(c["step"]) == len(c["lr"]) == len(c["batch"])
        assert c["step"][-1] == steps - 1 and set(c["corners"]) == {"warmup_end", "decay_start", "ramp_end"}
        counts.append(len(c["step"]))
    bound = MAX_POINTS + 2 * 3 + len(BatchRamp(512, [64, 64, 9000]).levels) * 2
    assert MAX_POINTS <= counts[0] <= bound and MAX_POINTS <= counts[1] <= bound
    assert abs(counts[0] - counts[1]) <= 6, counts
    assert max(peaks) < 256 * 1024, peaks  # a list of a million steps alone is ~8 MB


def test_run_total_is_meshlm_estimates(capsys):
    """The run beside the step time is `meshlm estimate`'s (plan/cost/estimate.py run_time): its --json `run`
    under a ramp, steps × step without one."""
    keys = {"training.steps": 20_000, "training.batch_rampup": "64, 64, 1000000", "optim.schedule": "wsd"}
    res = api.run_estimate(dict(BASE, **keys))
    capsys.readouterr()
    assert main(["estimate", "--json", "--gpu", "h100-sxm-80gb", "--gpus", "8", "--model.preset", "llama3-8b",
                 "--data.seq_len", "4096", "--training.global_batch", "512", "--training.micro_batch", "1",
                 "--parallel.zero", "3", "--training.steps", "20000", "--training.batch_rampup", "64,64,1000000",
                 "--optim.schedule", "wsd"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert res["run"] == cli["run"] and res["estimate"]["step_s"] == cli["step_s"]
    assert res["run"]["ramp_steps"] == res["course"]["corners"]["ramp_end"] > 0
    flat = api.run_estimate(dict(BASE, **{"training.steps": 20_000}))
    assert flat["run"]["ramp_steps"] == 0 and flat["course"]["batch"] is None
    assert flat["run"]["seconds"] == pytest.approx(20_000 * flat["estimate"]["step_s"], rel=1e-12)
    assert res["run"]["seconds"] > flat["run"]["seconds"] * res["run"]["tokens"] / flat["run"]["tokens"]


@pytest.mark.parametrize("keys,key,words", [
    ({"optim.schedule": "cosinus"}, "optim.schedule", "cosinus"),
    ({"optim.decay_type": "exp", "optim.schedule": "wsd"}, "optim.decay_type", "exp"),
    ({"optim.decay_steps": 500}, "optim.decay_steps", "only optim.schedule = wsd"),
    ({"optim.schedule": "wsd", "optim.decay_steps": 5000, "training.steps": 1000}, "optim.decay_steps", "longer"),
    ({"optim.warmup": -5}, "optim.warmup", ">= 0"),
    ({"training.steps": 0}, "training.steps", ">= 1 step"),
    ({"training.batch_rampup": "64, 60, 1000"}, "training.batch_rampup", "does not divide"),
    ({"training.batch_rampup": "64, 64"}, "training.batch_rampup", "expected [start"),
    ({"training.batch_rampup": "64, x, 9"}, "training.batch_rampup", "list of integers"),
    ({"training.batch_rampup": "4, 4, 1000"}, "training.batch_rampup", "whole micro-batches"),  # 4 < dp 8
])
def test_a_bad_schedule_value_is_one_line_naming_its_key(keys, key, words):
    with pytest.raises(api.BadRequest) as e:
        api.run_estimate(dict(BASE, **keys))
    assert e.value.key == key and str(e.value).startswith(key + ":") and words in str(e.value)
    assert "\n" not in str(e.value)


def test_options_offer_the_schedule_inputs_at_the_config_defaults():
    o = api.options()
    assert o["choices"]["optim.schedule"] == ["cosine", "wsd", "constant", "linear"]
    assert o["choices"]["optim.decay_type"] == ["linear", "sqrt", "cosine"]
    d = C.Config()
    assert o["course_defaults"] == {"training.steps": d.training.steps, "optim.schedule": d.optim.schedule,
                                    "optim.lr": d.optim.lr, "optim.warmup": d.optim.warmup,
                                    "optim.min_lr_ratio": d.optim.min_lr_ratio, "optim.decay_steps": 0.0,
                                    "optim.decay_type": "linear", "training.batch_rampup": []}


# ---------------------------------------------------------------------------------- mixed clusters

MIXED = {"model.preset": "llama3-8b", "gpu": "h100:8,a100-80gb:8", "data.seq_len": 4096,
         "global_batch_tokens": 4096 * 256}


def test_mixed_plan_rows_load_into_the_same_estimate_with_the_comparison():
    res = api.run_plan(dict(MIXED, top=3))
    assert res["mixed"] and 0 < len(res["ranked"]) <= 3
    c = res["comparison"]
    best = res["ranked"][0]
    assert c["alone_gpu"] == "H100-SXM-80GB" and c["alone_gpus"] == 8 and c["mixed_step_s"] == best["step_s"]
    assert c["pays"] == (c["alone_step_s"] is None or best["step_s"] < c["alone_step_s"])
    if c["alone_step_s"] is not None:
        assert c["gain"] == pytest.approx(c["alone_step_s"] / best["step_s"] - 1)
    for r in res["ranked"]:  # the row's inputs: its layout keys, the speed split (pp_layers / dp_weights) included
        split = "parallel.pp_layers" if r["spans"] == "pp" else "parallel.dp_weights"
        assert r["inputs"][split] == r["layout"][split.split(".")[1]] != []
        est = api.run_estimate(dict(MIXED, **r["inputs"]))
        assert est["mixed"]["step_s"] == r["step_s"] and est["mixed"]["per_type"] == r["per_type"]
        assert [t["gpu"] for t in est["mixed"]["per_type"]] == ["H100-SXM-80GB", "A100-80GB"]
        assert est["run"]["seconds"] == pytest.approx(est["run"]["steps"] * r["step_s"], rel=1e-12)
        assert 'devices = ["h100:8", "a100-80gb:8"]' in est["toml"]


def test_mixed_cluster_errors_name_the_gpu_input_and_one_type_is_the_plain_estimate():
    for gpu, words in (("h100:8,a100-80gb:x", "is not TYPE:COUNT"), ("h100:8,tpu:8", "unknown GPU")):
        with pytest.raises(api.BadRequest) as e:
            api.run_estimate(dict(MIXED, gpu=gpu))
        assert e.value.key == "gpu" and words in str(e.value)
    with pytest.raises(api.BadRequest) as e:
        api.run_estimate(dict(MIXED, **{"training.batch_rampup": "8,8,100", "parallel.dp_weights": "2,2,2,2,1,1,1,1",
                                        "parallel.dp": 8, "parallel.tp": 2, "parallel.zero": 3}))
    assert e.value.key == "training.batch_rampup" and "dp_weights" in str(e.value)
    one = api.run_estimate(dict({k: v for k, v in BASE.items() if k != "gpus"}, gpu="h100-sxm-80gb:16"))
    plain = api.run_estimate(dict(BASE, gpus=16))
    assert one["estimate"] == plain["estimate"] and one["derived"]["gpus"] == 16 and one["run"] == plain["run"]
