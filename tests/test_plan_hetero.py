"""The planner over a mixed cluster (issue 51; docs/heterogeneous.md, "Planning a mixed cluster"):
the cluster flags and parallel.devices, stages split by speed and memory, weights by speed, the search
and its comparison with the fastest type alone, and the one-line refusals. Single-process."""
import contextlib
import io
import json

import pytest

from meshlm.core import config as C
from meshlm.cli import main
from meshlm.plan.cluster import parse_cluster
from meshlm.plan.hardware import get_gpu
from meshlm.plan.mixed.search import plan_mixed
from meshlm.plan.mixed.cli import comparison, format_mixed, row
from meshlm.plan.mixed.price import dp_split, speed_split, weights_of
from meshlm.plan.cost.memory import stage_memory
from meshlm.plan.cost.options import Options
from meshlm.plan.spec import Spec, code_options, priced_on, search_knobs, shape_from_config
from meshlm.core.schedule import build_schedule, simulate

MIXED = ["plan", "--gpu", "h100:8,a100-80gb:8", "--model", "llama3-8b"]


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _shape(preset):
    cfg = priced_on(C.Config(), gpu=True)
    cfg.model.preset = preset
    return shape_from_config(cfg), Options(**code_options(cfg)), search_knobs(cfg)


@pytest.fixture(scope="module")
def mixed_8b():
    shape, o, knobs = _shape("llama3-8b")
    cluster = parse_cluster(["h100:8", "a100-80gb:8"])
    return shape, cluster, plan_mixed(shape, cluster, 8192, 2 ** 22, "bf16", 5, {}, o, knobs=knobs)


def test_one_type_as_a_list_prints_what_the_one_type_flags_print():
    def table(argv):
        code, out, _ = run(argv)
        assert code == 0
        return [ln for ln in out.splitlines() if not ln.startswith("searched ")]  # the line with the search's time
    old = table(["plan", "--gpu", "h100", "--gpus", "16", "--model", "llama3-1b", "--top", "4"])
    assert len(old) >= 6 and "16 × H100-SXM-80GB" in old[0]
    assert table(["plan", "--gpu", "h100:16", "--model", "llama3-1b", "--top", "4"]) == old
    assert table(["plan", "--gpu", "h100:16/8", "--gpus", "16", "--model", "llama3-1b", "--top", "4"]) == old
    four = table(["plan", "--gpu", "h100", "--gpus", "16", "--gpus-per-node", "4", "--model", "llama3-1b", "--top", "4"])
    assert table(["plan", "--gpu", "h100:16/4", "--model", "llama3-1b", "--top", "4"]) == four != old


def test_mixed_plan_prints_layout_memory_per_type_and_the_comparison():
    code, out, err = run(MIXED)
    assert code == 0, err
    lines = out.splitlines()
    assert "8 × H100-SXM-80GB (ranks 0-7, 8/node) + 8 × A100-80GB (ranks 8-15, 8/node)" in lines[0]
    first = next(ln for ln in lines if ln.strip().startswith("1 "))
    assert "pp_layers" in first or "dp_weights" in first
    per_type = [ln for ln in lines if "GiB of" in ln and "usable, compute" in ln]
    assert [ln.split()[0] for ln in per_type] == ["H100-SXM-80GB", "A100-80GB"]
    assert any(ln.startswith("fastest type alone: 8 × H100-SXM-80GB") for ln in lines)
    verdict = next(ln for ln in lines if ln.startswith("adding 8 × A100-80GB"))
    assert "(they pay)" in verdict or "does not pay" in verdict


def test_mixed_search_gives_slower_stages_fewer_blocks_and_fits_every_type(mixed_8b):
    shape, cluster, res = mixed_8b
    best = res.ranked[0]
    assert [p.step_s for p in res.ranked] == sorted(p.step_s for p in res.ranked)
    for t in best.per_type:
        assert 0 < t["bytes"] <= t["usable"] and 0 < t["busy_s"] <= best.step_s
    if best.spans == "pp":
        h100, a100 = (t["layers"] for t in best.per_type)
        assert sum(h100) + sum(a100) == 32 and min(h100) > max(a100)
    else:
        h100, a100 = (t["sequences"] for t in best.per_type)
        assert min(h100) > max(a100)
    cmp = comparison(res)
    assert cmp["alone_gpus"] == 8 and cmp["alone_step_s"] > 0
    assert cmp["gain"] == pytest.approx(cmp["alone_step_s"] / best.step_s - 1)
    assert cmp["pays"] == (best.step_s < cmp["alone_step_s"])
    r = row(best, shape, cluster)
    assert r["layout"]["devices"] == ["h100:8", "a100-80gb:8"]
    assert r["tokens_per_s"] == pytest.approx(2 ** 22 / best.step_s)
    assert "fastest type alone" in format_mixed(res, shape)


def test_slow_cards_that_do_not_pay_are_called_so():
    # 8 H100 + 8 A100-40GB with a TF32-only peak cut to a hundredth: the old cards only slow the job
    shape, o, knobs = _shape("llama3-1b")
    cluster = parse_cluster(["h100:8", "a100-40gb:8"])
    slow = get_gpu("a100-40gb", peak_tflops=3, hbm_tbps=0.02)
    cluster = type(cluster)((cluster.groups[0], type(cluster.groups[1])("a100-40gb", slow, 8)))
    res = plan_mixed(shape, cluster, 2048, 2 ** 20, "bf16", 3, {}, o, knobs=knobs)
    text = format_mixed(res, shape)
    assert not comparison(res)["pays"]
    assert "does not pay" in text and "train on the H100-SXM-80GBs alone" in text


def test_speed_split_follows_speed_and_memory():
    shape, o, _ = _shape("llama3-8b")
    h100, a100 = parse_cluster(["h100:8", "a100-80gb:8"]).groups
    s = Spec(dp=1, tp=1, pp=4, micro_batch=1, accum=8, seq_len=4096, pp_schedule="1f1b")
    split = speed_split(shape, s, [h100, h100, a100, a100], o)
    assert sum(split) == 32 and min(split[:2]) > max(split[2:])
    # the same speed with a third of the memory: the small cards' stages hold fewer blocks, and fit
    small = type(h100)("h100-small", get_gpu("h100", hbm_gb=30), 8)
    even = speed_split(shape, s, [h100, h100, h100, h100], o)
    uneven = speed_split(shape, s, [h100, h100, small, small], o)
    assert max(even) - min(even) <= 3 and uneven[2] < even[2] and sum(uneven) == 32
    s2 = Spec(dp=1, tp=1, pp=4, micro_batch=1, accum=8, seq_len=4096, pp_schedule="1f1b", pp_layers=uneven)
    assert stage_memory(shape, s2, "rank2", o).total() <= o.usable(small.gpu)
    assert stage_memory(shape, Spec(**{**s2.__dict__, "pp_layers": even}), "rank2", o).total() > o.usable(small.gpu)


def test_dp_split_weights_by_speed_into_whole_micro_batches():
    assert dp_split(512, [8, 8], [1.0, 3.0]) == (48, 16)
    a = dp_split(100, [2, 3], [1.0, 2.0])  # 2a + 3b = 100, a ≈ 2b
    assert 2 * a[0] + 3 * a[1] == 100 and abs(a[0] / a[1] - 2) < 0.3
    assert dp_split(3, [2, 2], [1.0, 1.0]) is None
    assert weights_of([48] * 8 + [16] * 8) == [3] * 8 + [1] * 8


def test_simulator_uses_each_ranks_own_costs():
    acts = build_schedule("1f1b", 2, 4)
    same = simulate(acts, 2, 4, cost_f=1.0, cost_b=2.0)
    assert simulate(acts, 2, 4, cost_f=1.0, cost_b=2.0, rank_costs=[(1.0, 2.0, 1.0)] * 2).makespan == same.makespan
    slow = simulate(acts, 2, 4, cost_f=1.0, cost_b=2.0, rank_costs=[(1.0, 2.0, 1.0), (2.0, 4.0, 2.0)])
    # the slow rank is busy 4 × 6 and waits only for the first forward: 1 + 24, then rank 0's last backward
    assert slow.makespan == pytest.approx(1 + 24 + 2) and slow.busy == pytest.approx([12.0, 24.0])


def test_emitted_mixed_config_estimates_to_the_plans_row(tmp_path):
    path = tmp_path / "mixed.toml"
    code, out, err = run(["plan", "--gpu", "h100:4,a100-80gb:4", "--model", "llama3-1b", "--top", "2",
                          "--global-batch-tokens", str(2 ** 19), "--json", "--emit-config", str(path)])
    assert code == 0, err
    plan = json.loads(out)
    best = plan["ranked"][0]
    cfg = C.load(str(path))
    assert cfg.parallel.devices == ["h100:4", "a100-80gb:4"]
    assert cfg.parallel.pp_layers == best["layout"]["pp_layers"] and cfg.parallel.dp_weights == best["layout"]["dp_weights"]
    code, out, err = run(["estimate", "--config", str(path), "--json"])  # the cluster from parallel.devices
    assert code == 0, err
    est = json.loads(out)
    assert est["step_s"] == pytest.approx(best["step_s"], rel=1e-9)
    assert est["per_gpu"]["total"] == pytest.approx(best["per_gpu"]["total"], rel=1e-9)


@pytest.mark.parametrize("argv, line", [
    (["plan", "--gpu", "h100:8,mi300x:8", "--model", "llama3-8b"], "meshlm: --gpu: unknown GPU 'mi300x'"),
    (["plan", "--gpu", "h100:8,a100-80gb:8", "--gpus", "12", "--model", "llama3-8b"],
     "meshlm: --gpus: 12 ranks, but the device groups h100:8,a100-80gb:8 add up to 16"),
    (["plan", "--gpu", "h100:8,a100-80gb:x", "--model", "llama3-8b"], "meshlm: --gpu: 'a100-80gb:x' is not TYPE:COUNT"),
    (["plan", "--gpu", "h100:12,a100-80gb:4", "--model", "llama3-8b"], "meshlm: --gpu: h100:12 is not whole nodes"),
    (["plan", "--gpu", "h100:4/4,a100-80gb:4/4", "--model", "llama3-8b", "--fix", "tp=8"],
     "meshlm: --fix tp: the TP group of ranks 0-7 spans h100 and a100-80gb"),
    (["estimate", "--gpu", "h100:4/4,a100-80gb:4/4", "--model.preset", "llama3-8b", "--parallel.tp", "8"],
     "meshlm: parallel.tp: the TP group of ranks 0-7 spans h100 and a100-80gb"),
    (["plan", "--gpu", "h100", "--model", "llama3-8b"], "meshlm: --gpus: give the number of GPUs"),
    (["plan", "--gpu", "h100:8,a100-80gb:8", "--model", "llama3-8b", "--islands", "2"],
     "meshlm: --islands: not with a mixed cluster"),
    (["estimate", "--gpu", "h100:8,a100-80gb:8", "--model.preset", "llama3-8b", "--parallel.islands", "2"],
     "meshlm: --islands: not with a mixed cluster"),
])
def test_bad_cluster_is_one_line_exit_2(argv, line):
    code, out, err = run(argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(line), err


@pytest.mark.parametrize("devices, line", [
    ("h100", "meshlm: parallel.devices: 'h100' is not TYPE:COUNT"),
    ("h100:1,tpu-v5:1", "meshlm: parallel.devices: unknown GPU 'tpu-v5'"),
    ("h100:4", "meshlm: parallel.devices: h100:4 adds up to 4 GPUs, the world size is 2"),
    ("h100:1,a100-80gb:1", "meshlm: parallel.tp: the TP group of ranks 0-1 spans h100 and a100-80gb"),
    ("h100:2 --parallel.auto true", "meshlm: parallel.devices: not with parallel.auto"),
    ("h100:2 --parallel.islands 2", "meshlm: parallel.devices: not with parallel.islands > 1"),
])
def test_bad_devices_refused_before_any_worker(devices, line, tmp_path):
    devices, *more = devices.split()
    code, out, err = run(["train", "--model.preset", "debug", "--parallel.devices", devices, "--parallel.tp", "2",
                          "--nproc", "2", "--run-dir", str(tmp_path / "run"), *more])
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.startswith(line), err


def test_explorer_api_takes_a_mixed_cluster():
    from meshlm.explore.api import BadRequest, run_estimate, run_plan
    body = {"model.preset": "llama3-1b", "gpu": "h100:4,a100-80gb:4", "global_batch_tokens": 2 ** 19, "top": 2}
    out = run_plan(body)
    assert out["mixed"] and 1 <= len(out["ranked"]) <= 2 and out["comparison"]["alone_gpus"] == 4
    best = out["ranked"][0]
    assert [t["card"] for t in best["per_type"]] == ["h100", "a100-80gb"]
    assert 'devices = ["h100:4", "a100-80gb:4"]' in best["toml"]
    est = run_estimate({**body, "parallel.pp": 2, "gpus": 8})
    assert est["mixed"]["per_type"][1]["gpu"] == "A100-80GB" and est["mixed"]["step_s"] > 0
    assert 'devices = ["h100:4", "a100-80gb:4"]' in est["toml"]
    with pytest.raises(BadRequest) as e:
        run_plan({**body, "gpus": 6})
    assert e.value.key == "gpus" and str(e.value).startswith("gpus: 6 ranks, but the device groups")
    with pytest.raises(BadRequest) as e:
        run_estimate({**body, "parallel.tp": 8, "gpu": "h100:4/4,a100-80gb:4/4"})
    assert e.value.key == "parallel.tp"


def test_mixed_recipe_is_the_planners_pick_and_passes_the_devices_check():
    from meshlm.plan.search.auto import layout_for_run
    cfg = C.load("configs/llama3-8b-h100-a100.toml")
    shape, o, knobs = _shape("llama3-8b")
    cluster = parse_cluster(cfg.parallel.devices)
    res = plan_mixed(shape, cluster, cfg.data.seq_len, cfg.training.global_batch * cfg.data.seq_len, "bf16", 1, {}, o,
                     knobs=knobs)
    best = res.ranked[0].spec
    p = cfg.parallel
    assert (best.pp, best.pp_schedule, list(best.pp_layers), best.zero, best.tp) == \
        (p.pp, p.pp_schedule, p.pp_layers, p.zero, p.tp)
    assert (best.micro_batch, best.ac) == (cfg.training.micro_batch, cfg.training.ac)
    assert layout_for_run(cfg, 16)[0].pp == 4  # parallel.devices adds up to the world and no TP group spans two types
    with pytest.raises(C.ConfigError, match="parallel.devices: h100:8,a100-80gb:8 adds up to 16 GPUs"):
        layout_for_run(cfg, 8)


def test_mixed_estimate_prints_each_type():
    code, out, err = run(["estimate", "--config", "configs/llama3-8b-h100-a100.toml", "--gpu", "h100:8,a100-80gb:8"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("16 GPUs: 8 × H100-SXM-80GB") and "pp_layers=[13, 13, 4, 2]" in lines[1]
    assert lines[2].startswith("fits: yes; step ") and "pipeline makespan: simulator" in lines[2]
    assert [ln.split()[0] for ln in lines[3:]] == ["H100-SXM-80GB", "A100-80GB"]
    code, _, err = run(["estimate", "--config", "configs/llama3-8b-h100-a100.toml", "--gpu", "h100:8,a100-40gb:8"])
    assert code == 2 and err.startswith("meshlm: parallel.devices: h100:8,a100-80gb:8 is not the --gpu cluster")
