"""--calibrate RUN_DIR: the rate, link bandwidth and other programs' load fitted from a run's metrics and
config, and the predictions they give for other layouts (plan/calibrate/fit.py). The live CPU demo
(calibrate on 2 ranks, predict 4) is bench/calibrate.py: its timings depend on the shared machine."""
from __future__ import annotations

import json
import os

import pytest
from harness import make_config, train_in

from meshlm.core import config as C
from meshlm.cli import main
from meshlm.plan.calibrate import fit as K
from meshlm.plan.calibrate import trace as T
from meshlm.plan.cost.estimate import estimate
from meshlm.plan.hardware import get_gpu
from meshlm.plan.cost.ops import unit_rates
from meshlm.plan.spec import PlanError, shape_from_config, spec_from_config

RATE, LINK, CORES = 3e10, 4e8, 2  # the machine the synthetic runs were "measured" on


def _write_run(path, cfg, world, load=0.0, noise=(1.0,), log_world=True, cal=None):
    """A run directory whose metrics are what the planner predicts for `world` ranks of one thread on
    the known machine beside `load` other runnable threads. Like a real run, config.toml keeps
    parallel.dp = -1 and metrics.jsonl says the world size (unless `log_world` is off)."""
    cal = cal or K.Calibration(RATE, LINK, CORES, load=load)
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


# ---------------------------------------------------------------------- a profiler trace (metrics.profile_step)

TRUE = dict(gemm_flops=2e10, attn_flops=5e9, ew_bytes_s=3e9, dispatch_s=2e-5, overhead_s=0.05)


def _truth(load=0.0):
    return K.Calibration(RATE, LINK, CORES, load=load, **TRUE)


def _category_seconds(cal, cfg, world):
    """Seconds per step of each trace category when `cfg` runs on `world` ranks of the known machine:
    the model's work of the category at that rank's rate (what a profiler would have split)."""
    gpu, o = K.device_and_options(cal, world, threads=1)
    shape, spec = shape_from_config(cfg), spec_from_config(cfg, world)

    def secs(cat):
        rates = getattr(o.rates, {"gemm": "gemm_flops_s", "attention": "attn_flops_s", "bytes": "ew_bytes_s",
                                  "dispatch": "dispatch_s"}[cat])
        t = estimate(shape, spec, gpu, K._rated(unit_rates(cat), False))["time"]
        work = t["forward_s"] + t["backward_s"] + t["recompute_s"] + t["optimizer_s"]
        return work * rates if cat == "dispatch" else work / rates
    return {c: secs(c) for c in ("gemm", "attention", "bytes", "dispatch")}, o.rates.step_overhead_s


def _write_traced_run(path, cfg, world, c=1e-5, beta=2e-9, profiled=4):
    """A run measured on the known machine with a profile.json of step `profiled` whose op names split
    into the categories the model gives: element-wise ops whose seconds are c·calls + β·elements
    exactly (a view: calls only), the rest in GEMM, attention and comm ops, the overhead outside."""
    est = _write_run(path, cfg, world, cal=_truth())
    secs, overhead = _category_seconds(_truth(), cfg, world)
    calls, elems = secs["dispatch"] / c, secs["bytes"] / beta
    ew = {"aten::mul": (calls / 4, elems / 3), "aten::add_": (calls / 4, 2 * elems / 3), "aten::view": (calls / 2, 0)}
    ops = {n: {"calls": k, "self_s": c * k + beta * x, "device_s": 0.0, "elems": x, "flops": 0}
           for n, (k, x) in ew.items()}
    ops["aten::view"]["elems"] = 1e9  # a view's elements are not data it moves
    comm = est["step_s"] - sum(secs.values()) - overhead  # the model's exposed communication
    assert comm > -1e-12
    comm = max(comm, 0.0)
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    for name, s in (("aten::mm", secs["gemm"]), (sdpa, secs["attention"]),
                    ("c10d::allreduce_", comm)):
        ops[name] = {"calls": 10, "self_s": s, "device_s": 0.0, "elems": 1000, "flops": 0}
    with open(os.path.join(path, "metrics.jsonl"), "a") as f:  # the profiled step ran slower: not in the median
        f.write(json.dumps({"step": profiled, "step_s": 50 * est["step_s"], "world": world, "threads": 1,
                            "cores": CORES, "comm": {}}) + "\n")
    for o in ops.values():  # the profiler's cost per op doubles every op's time; the shares stay
        o["self_s"] *= 2
    with open(os.path.join(path, T.PROFILE), "w") as f:
        json.dump({"step": profiled, "rank": 0, "device": "cpu", "wall_s": 2 * est["step_s"], "threads": 1,
                   "ops": ops}, f)
    return est


def test_trace_fit_recovers_every_rate_and_prices_tp_per_category(tmp_path):
    """From a 2-rank dp run with a trace the per-category rates come back exactly; priced with them,
    tp 2 halves the GEMMs but not the dispatch or the per-step overhead, and tp 2 × dp 2 on 4 ranks is
    predicted as the known machine runs it. Without the trace the fit is the flat one."""
    a = tmp_path / "dp2"
    a.mkdir()
    _write_traced_run(a, _cfg(), 2)
    assert T.dispatch_and_bytes(K.read_profile(str(a))["ops"]) == (pytest.approx(2e-5), pytest.approx(4e-9))
    cal = K.fit(str(a))
    for k, v in TRUE.items():
        assert getattr(cal, k) == pytest.approx(v, rel=1e-6), k
    cfg4 = _cfg(parallel__tp=2)
    assert K.predict(cal, cfg4, 4)["step_s"] == pytest.approx(K.predict(_truth(), cfg4, 4)["step_s"], rel=1e-6)
    flat = K.fit(str(a), trace=False)
    assert flat.gemm_flops is None and flat.rate_flops == pytest.approx(cal.rate_flops)
    assert K.predict(flat, cfg4, 4)["ops"] is None
    # same tokens per rank on 2 ranks: dp 2 (global batch 8) against tp 2 (global batch 4)
    dp, tp = (K.predict(cal, c, 2, threads=1) for c in (_cfg(), _cfg(parallel__tp=2, training__global_batch=4)))
    g = lambda e: e["ops"]["gemm_s"] + e["ops"]["head_s"]  # noqa: E731
    assert g(tp) == pytest.approx(g(dp) / 2, rel=0.02)
    assert tp["time"]["overhead_s"] == dp["time"]["overhead_s"] > 0
    assert dp["ops"]["elementwise_s"] / 2 < tp["ops"]["elementwise_s"] < dp["ops"]["elementwise_s"]


def test_trace_errors(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_traced_run(run, _cfg(), 2)
    (run / T.PROFILE).write_text('{"step": 4}')
    with pytest.raises(PlanError, match="profile.json is not a profile meshlm wrote"):
        K.fit(str(run))
    with pytest.raises(C.ConfigError, match=r"metrics.profile_step: expected 0 \(off\) or a step in 1..4, got 9"):
        train_in(None, _tiny(metrics__profile_step=9, training__steps=4), 1, str(tmp_path / "bad"))
    assert not os.path.exists(tmp_path / "bad" / "metrics.jsonl")


def _tiny(**kw):
    return make_config(**{"training__steps": 6, "training__global_batch": 8, "training__micro_batch": 2, **kw})


def test_a_real_two_rank_run_with_a_trace(pools, tmp_path):
    """A real 2-rank CPU run profiles its step 4 (rank 0) and --calibrate prices another layout per category."""
    cfg = _tiny(metrics__profile_step=4)
    train_in(pools, cfg, 2, str(tmp_path))
    (tmp_path / "config.toml").write_text(C.to_toml(cfg))
    prof = K.read_profile(str(tmp_path))
    assert prof["step"] == 4 and prof["ops"]["aten::mm"]["calls"] > 0
    cats = {T.op_category(n) for n in prof["ops"]}
    assert {"gemm", "attention", "elementwise", "comm"} <= cats
    assert 4 not in [r["step"] for r in K._records(str(tmp_path), 4)]
    cal = K.fit(str(tmp_path))
    assert all(getattr(cal, k) > 0 for k in ("gemm_flops", "attn_flops", "ew_bytes_s", "dispatch_s"))
    assert cal.split["gemm"] > 0 and cal.overhead_s >= 0
    est = K.predict(cal, _tiny(parallel__tp=2), 4)
    assert est["step_s"] > 0 and all(est["ops"][k] > 0 for k in ("gemm_s", "attention_s", "elementwise_s"))


def test_estimate_text_says_which_rates_came_from_the_run(tmp_path, capsys):
    """`meshlm estimate --calibrate` without --json prints the step by category, each priced at the rate
    the run fitted (named with its value), the core share of the layout, and what stayed the model's."""
    a, flat = tmp_path / "dp2", tmp_path / "flat"
    a.mkdir(), flat.mkdir()
    _write_traced_run(a, _cfg(), 2)
    _write_run(flat, _cfg(), 2)
    argv = ["estimate", "--gpus", "4", "--model.preset", "small", "--data.seq_len", "128",
            "--training.global_batch", "8", "--training.micro_batch", "2", "--parallel.tp", "2"]
    assert main(argv + ["--calibrate", str(a)]) == 0
    text = capsys.readouterr().out
    cal = K.fit(str(a))
    rows = {x[4:28].strip(): x[28:] for x in text.splitlines() if x.startswith("    ")}
    assert f"{cal.gemm_flops / 1e9:.3g} GFLOP/s per core, fitted" in rows["GEMM"]
    assert f"{cal.attn_flops / 1e9:.3g} GFLOP/s per core, fitted" in rows["attention"]
    assert f"{cal.ew_bytes_s / 1e9:.3g} GB/s per core, fitted" in rows["element-wise"]
    assert f"{cal.dispatch_s * 1e6:.3g} µs per kernel per core, fitted" in rows["launch / dispatch"]
    assert f"{cal.overhead_s:.3g} s per step per core, fitted" in rows["per-step overhead"]
    assert f"link {cal.link_bytes_s / 1e9:.3g} GB/s per core" in rows["communication exposed"]
    assert "not fitted" in rows["bubble"]
    est = K.predict(cal, _cfg(parallel__tp=2), 4)
    assert float(rows["step"].split()[0]) == pytest.approx(est["step_s"], abs=1e-4)
    assert float(rows["GEMM"].split()[0]) == pytest.approx(est["ops"]["gemm_s"] + est["ops"]["head_s"], abs=1e-4)
    assert f"calibrated from {a}: 2 cores shared by 4 ranks: 0.50 of a core each" in text
    assert "rates fitted per category from its profiler trace" in text
    assert main(argv + ["--calibrate", str(flat)]) == 0  # no trace: one flat rate
    text = capsys.readouterr().out
    rows = {x[4:28].strip(): x[28:] for x in text.splitlines() if x.startswith("    ")}
    assert f"{K.fit(str(flat)).rate_flops / 1e9:.3g} GFLOP/s per core, fitted to its step" in rows["compute (flat)"]
    assert "GEMM" not in rows and "one flat compute rate (the run has no profile.json)" in text


def test_functions_that_block_in_a_collective_are_comm():
    """Every autograd function of meshlm that runs a collective is booked as comm in a trace (its self
    time is the wait for the peers), not as element-wise dispatch; the list follows the code."""
    import re
    src = os.path.join(os.path.dirname(K.__file__), "..", "..")
    names = set()
    for f in ("distributed/functional.py", "parallel/dims/vocab_parallel.py", "parallel/dims/context_parallel.py",
              "parallel/dims/zero/sync.py", "parallel/dims/expert_parallel.py"):
        with open(os.path.join(src, f)) as fh:
            names |= set(re.findall(r"^class (\w+)\((?:torch\.autograd\.)?(?:Function|AllToAll)\)", fh.read(), re.M))
    assert len(names) >= 9 and names == set(T.COLLECTIVE_FUNCTIONS)
    for n in names:
        assert T.op_category(n) == T.op_category(n + "Backward") == "comm", n
    assert T.op_category("_RMSNormBackward") == T.op_category("aten::mul") == "elementwise"
    assert T.op_category("autograd::engine::evaluate_function: _CopyToBackward") == "elementwise"


def test_a_link_probe_gives_the_cost_per_collective_call(tmp_path):
    """link_probe.json beside a run: the intercepts of its all-reduce sizes are the per-call cost (wall,
    and on a core). A call then takes its wall time, or its core work at the rank's core share when
    ranks outnumber cores, whichever is longer; the link bandwidth is fitted net of them."""
    wall, core = 1.5e-3, 1.0e-3
    truth = K.Calibration(RATE, LINK, CORES, latency_s=wall, latency_core_s=core)
    a = tmp_path / "dp2"
    a.mkdir()
    _write_run(a, _cfg(), 2, cal=truth)
    sizes = [4096 * 4 ** k for k in range(4)]
    (a / K.PROBE).write_text(json.dumps({"bytes": sizes, "wall_s": [wall + 7e-10 * x for x in sizes],
                                         "core_s": [core + 4e-10 * x for x in sizes]}))
    cal = K.fit(str(a))
    assert (cal.latency_s, cal.latency_core_s) == (pytest.approx(wall), pytest.approx(core))
    assert cal.link_bytes_s == pytest.approx(LINK, rel=1e-6) and cal.rate_flops == pytest.approx(RATE, rel=1e-6)
    cfg4 = _cfg(parallel__tp=2)
    tp = lambda est: next(c for c in est["comm"] if c["group"] == "tp")  # noqa: E731
    four, two = K.predict(cal, cfg4, 4), K.predict(cal, _cfg(parallel__tp=2, training__global_batch=4), 2)
    assert four["step_s"] == pytest.approx(K.predict(truth, cfg4, 4)["step_s"], rel=1e-6)
    share = K.core_share(4, CORES, 1)  # 0.5: the core work of a call (1 ms) stretches to 2 ms > its wall
    for est, link, per_call in ((four, LINK * share, core / share), (two, LINK, wall)):
        c = tp(est)
        assert c["seconds"] == pytest.approx(c["bytes"] / link + c["calls"] * per_call)
    (a / K.PROBE).unlink()  # without a probe: the model's 10 µs per call, the bandwidth absorbs the rest
    bare = K.fit(str(a))
    c = tp(K.predict(bare, cfg4, 4))
    assert bare.latency_s is None and bare.link_bytes_s < LINK
    assert c["seconds"] == pytest.approx(c["bytes"] / (bare.link_bytes_s * share) + c["calls"] * 10e-6)
    (a / K.PROBE).write_text('{"bytes": [4096, 4096], "wall_s": [1, 1], "core_s": [1, 1]}')
    with pytest.raises(PlanError, match="link_probe.json is not a link probe .*two sizes"):
        K.fit(str(a))


def test_fit_on_core_seconds(tmp_path):
    """on_core: the rates of the core time the run got (its median cpu_s as the step of a rank with a
    core to itself), which is what the bench's seconds-on-a-core check prices; a run without cpu_s
    is a one-line error."""
    a = tmp_path / "dp2"
    a.mkdir()
    _write_run(a, _cfg(), 2, load=2.5)  # cpu_s 0.5 × the share a rank got
    cpu = K.measured(str(a)).cpu_s
    assert cpu == pytest.approx(0.5 * CORES / (2 + 2.5))
    cal = K.fit(str(a), on_core=True)
    assert cal.cores == 0 and K.predict(cal, _cfg(), 2)["step_s"] == pytest.approx(cpu, rel=1e-6)
    lines = (a / "metrics.jsonl").read_text().splitlines()
    (a / "metrics.jsonl").write_text("\n".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "cpu_s"})
                                               for x in lines) + "\n")
    with pytest.raises(PlanError, match="has no cpu_s"):
        K.fit(str(a), on_core=True)


# ---------------------------------------------------------------- a real GPU run (shared H100, 2026-11-25)
H100_RUN = os.path.join(os.path.dirname(__file__), "data", "h100-run-llama3-1b")


def _median_tokens_s(run_dir: str) -> float:
    """The run's tokens/s per GPU over its logged steps after warm-up, less the profiled one."""
    import statistics
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    prof = K.read_profile(run_dir)
    return statistics.median(r["tokens_per_s"] for r in recs[K.WARMUP_RECORDS:] if r["step"] != prof["step"])


def test_gpu_trace_counts_kernels_only():
    """Device time comes from kernels: compiled-graph wrappers, "Command Buffer Full", aten ops and
    annotations launch kernels the trace also lists, and an Inductor kernel's launch shares its name."""
    from meshlm.plan.calibrate.gpu import kernel_category, kernel_seconds
    prof = K.read_profile(H100_RUN)
    for host in ("## Call CompiledFxGraph None ##", "Command Buffer Full", "aten::mm", "Optimizer.step#AdamW.step",
                 "cudaLaunchKernel", "meshlm::swiglu_down", "CompiledFunctionBackward"):
        assert kernel_category(host) is None
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "gemm"
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert kernel_category("triton_poi_fused__unsafe_view_mul_silu_silu_backward_0") == "elementwise"
    k = kernel_seconds(prof["ops"])
    # the GEMM kernels are aten::mm's device time, and all kernels fit in the profiled step's wall time
    assert k["gemm"] == pytest.approx(prof["ops"]["aten::mm"]["device_s"], rel=0.01)
    assert 0.9 * prof["wall_s"] < sum(k.values()) < prof["wall_s"]


def test_gpu_calibration_predicts_its_run_and_says_it_fits():
    cal = K.fit(H100_RUN)
    assert cal.card is not None and cal.card.peak_flops == 989e12  # the run's own peak (metrics peak_flops)
    assert cal.card.hbm_bytes == get_gpu("h100").hbm_bytes           # and the card's HBM
    pred = K.predict(cal, K.run_config(H100_RUN), 1)
    measured = _median_tokens_s(H100_RUN)
    print(f"calibrated {pred['tokens_per_s_per_gpu']:,.0f} tok/s against the run's median {measured:,.0f}")
    assert abs(pred["tokens_per_s_per_gpu"] / measured - 1) <= 0.10
    assert pred["fits"] is True
    # the fitted efficiencies are physical: no category runs above the card's datasheet
    assert 0 < cal.card.gemm_ceiling < 1 and 0 < cal.card.hbm_eff < 1 and cal.card.attn_scale < 1.5


def test_gpu_run_without_a_trace_keeps_the_card(tmp_path):
    """Without profile.json a GPU run still prices on its card (peak, HBM): one factor on the three
    efficiencies, and its own step comes back."""
    import shutil
    for f in ("config.toml", "metrics.jsonl"):
        shutil.copy(os.path.join(H100_RUN, f), tmp_path / f)
    cal = K.fit(str(tmp_path))
    assert cal.card is not None and cal.card.hbm_bytes == get_gpu("h100").hbm_bytes
    pred = K.predict(cal, K.run_config(str(tmp_path)), 1)
    assert pred["fits"] is True and pred["step_s"] == pytest.approx(K.measured(str(tmp_path)).step_s, rel=0.01)


def test_gpu_calibration_prices_another_layout_and_prints_its_rates(capsys):
    cfg = os.path.join(H100_RUN, "config.toml")
    assert main(["estimate", "--calibrate", H100_RUN, "--config", cfg, "--gpus", "1", "--model.preset", "llama3-3b",
                 "--data.seq_len", "8192", "--training.micro_batch", "1", "--training.global_batch", "4"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "llama3-3b" in out and "seq_len=8192" in out and "fits: yes" in out
    assert "ceiling 7" in out and "TFLOP/s" in out and "of HBM" in out and "ms per step" in out
