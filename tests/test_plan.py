"""Tests for meshlm.plan: textbook formulas, estimate/plan CLIs, search speed, emitted configs, and the
activation model against what autograd really saves for one Block (saved-tensor hooks)."""

import argparse
import json
import subprocess
import sys
import time

import pytest

from meshlm.core import config as C
from meshlm.core.model_args import padded_vocab
from meshlm.plan import cli as cli_cmds
from meshlm.plan.cost.estimate import Options, bubble_formula, bubble_simulated, estimate
from meshlm.plan.hardware import GIB, get_gpu
from meshlm.plan.cost.activations import block_activation_bytes, korthikanti_block_bytes
from meshlm.plan.cost.memory import stage_memory, zero_state_bytes
from meshlm.plan.cost.stages import inflight, stage_params
from meshlm.plan.spec import PlanError, Shape, Spec, check, presets

GB = 1e9


def _run(argv):
    """Parse like `meshlm` does and call the subcommand; returns (code, stdout, stderr) via capsys."""
    p = argparse.ArgumentParser(prog="meshlm")
    cli_cmds.add_parsers(p.add_subparsers(dest="command", required=True))
    args, extra = p.parse_known_args(argv)
    return args.func(args, extra)


def _shape(name):
    return Shape(presets()[name], name)


# ---------------------------------------------------------------- textbook formulas

def test_zero_stages_seed_numbers():
    # ZeRO paper / seed 001: 7.5B params, 64 GPUs, fp16 params and grads + K = 12 (2 + 2 + 12 bytes)
    got = [zero_state_bytes(7.5e9, 64, z)["total"] / GB for z in range(4)]
    assert [round(x, 1) for x in got] == [120.0, 31.4, 16.6, 1.9]
    # meshlm's convention (bf16): 2 + 4 + 12 bytes per parameter, same sharding rules
    assert zero_state_bytes(1.0, 8, 0, 2, 4, 12)["total"] == 18
    assert zero_state_bytes(8.0, 8, 3, 2, 4, 12)["total"] == 18


def test_korthikanti_formulas():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    none = korthikanti_block_bytes(s, b, h, a)
    assert none == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_block_bytes(s, b, h, a, t, sp=True) == pytest.approx(none / t)
    assert korthikanti_block_bytes(s, b, h, a, t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_block_bytes(s, b, h, a, t, True, "selective") == pytest.approx(34 * s * b * h / t)
    assert korthikanti_block_bytes(s, b, h, a, recompute="full") == 2 * s * b * h


@pytest.mark.parametrize("precision,per", [("fp32", (4, 4, 8)), ("bf16", (2, 4, 12))])
def test_model_states_follow_the_trainer_convention(precision, per):
    sh = _shape("small")
    psi = sh.num_params()
    m = stage_memory(sh, Spec(dp=4, precision=precision, zero_group=4, seq_len=64), "only").breakdown()
    assert (m["params"], m["grads"], m["optim"]) == (per[0] * psi, per[1] * psi, per[2] * psi)
    for zero, div in ((1, (1, 1, 4)), (2, (1, 4, 4)), (3, (4, 4, 4))):
        m = stage_memory(sh, Spec(dp=4, zero=zero, zero_group=4, precision=precision, seq_len=64), "only").breakdown()
        assert (m["params"], m["grads"], m["optim"]) == pytest.approx(
            tuple(per[i] * psi / div[i] for i in range(3)))
    m = stage_memory(sh, Spec(dp=4, zero=1, zero_group=4, offload="optimizer", precision=precision, seq_len=64),
                     "only").breakdown()
    # offload: separate fp32 master + m + v + fp32 gradient staging on the host, 16 bytes per parameter
    assert m["optim"] == 0 and m["cpu_optim"] == pytest.approx(16 * psi / 4)


def test_parameter_split_over_stages_and_tp():
    sh = _shape("llama3-8b")  # untied, 32 layers, 8 kv heads
    psi = sh.num_params()
    assert stage_params(sh, Spec(), "only").dense == psi
    first, last = (stage_params(sh, Spec(pp=4), st) for st in ("first", "last"))
    a = sh.args
    # the runtime's split (core/schedule/stage.py): the 128k-row head is worth ~2.4 blocks, so the
    # last stage gets fewer blocks than the first
    from meshlm.core.schedule.stage import estimate_costs, partition
    runtime = partition(a.n_layers, 4, estimate_costs(a))
    assert (first.layers, last.layers) == (len(runtime[0]), len(runtime[-1])) == (9, 6)
    assert first.embed and last.head and not first.head and not last.embed
    block = (psi - 2 * a.vocab_size * a.dim - a.dim) / a.n_layers
    assert first.dense == pytest.approx(9 * block + a.vocab_size * a.dim)
    assert last.dense == pytest.approx(6 * block + a.vocab_size * a.dim + a.dim)
    # interleaved: rank 0 holds stages 0 and 4 of 8
    v2 = partition(a.n_layers, 8, estimate_costs(a))
    assert stage_params(sh, Spec(pp=4, pp_virtual=2), "first").layers == len(v2[0]) + len(v2[4])
    t8 = stage_params(sh, Spec(tp=8), "only").dense
    norms = (2 * a.n_layers + 1) * a.dim
    # 128256 ids pad to 129024 rows at tp=8 (16128 per rank)
    pad = 2 * (padded_vocab(a.vocab_size, a.vocab_multiple, 8) - a.vocab_size) * a.dim / 8  # embedding + head
    assert pad > 0
    assert t8 == pytest.approx((psi - norms) / 8 + norms + pad)
    tied = _shape("llama3-1b")  # tied embeddings: one copy with pp=1, one on each end stage with pp>1
    e = tied.args.vocab_size * tied.args.dim
    assert stage_params(tied, Spec(), "only").dense == tied.num_params()
    assert stage_params(tied, Spec(pp=2), "last").dense > e


def test_pipeline_formulas_match_the_simulator():
    from meshlm.core.schedule import build_schedule as build
    from meshlm.core.schedule import simulate
    for name, p, m, v in [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 32, 1), ("interleaved", 4, 8, 2),
                          ("interleaved", 4, 8, 3), ("zb-h1", 4, 8, 1), ("zb-h1", 6, 3, 1), ("1f1b", 6, 3, 1)]:
        for f, b, w in ((1.0, 2.0, 1.0), (1.2, 2.5, 1.1)):
            sim = bubble_simulated(name, p, m, v, f, b, w)
            assert sim == pytest.approx(bubble_formula(name, p, m, v, f, b, w), abs=1e-9), (name, p, m, v)
        tl = simulate(build(name, p, m, v), p, m, v)
        assert max(tl.peak_inflight) == pytest.approx(inflight(name, p, m, v, 0) * v), name


# ---------------------------------------------------------------- estimate

def test_estimate_json_keys_and_fit(capsys):
    code = _run(["estimate", "--model.preset", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--json",
                 "--data.seq_len", "4096", "--training.global_batch", "64", "--training.micro_batch", "1",
                 "--training.precision", "bf16", "--parallel.zero", "3", "--training.ac", "selective"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["params"] == presets()["llama3-8b"].num_params()
    assert set(out["per_gpu"]) >= {"params", "grads", "optim", "activations", "buffers", "total"}
    pg = out["per_gpu"]
    assert pg["total"] == pytest.approx(sum(pg[k] for k in ("params", "grads", "optim", "activations", "buffers")))
    assert out["fits"] is True and 0 < out["mfu"] < 1 and out["step_s"] > 0
    assert out["tokens_per_s_per_gpu"] == pytest.approx(64 * 4096 / out["step_s"] / 8)
    assert {c["link"] for c in out["comm"]} <= {"nvlink", "ib"}
    # the same model without sharding does not fit on one node
    code = _run(["estimate", "--model.preset", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--json",
                 "--training.global_batch", "8", "--training.micro_batch", "1", "--data.seq_len", "8192"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"] is False and out["per_gpu"]["total"] > 80 * GIB


def test_estimate_memory_only_and_text(capsys, tmp_path):
    cfg = tmp_path / "train.toml"
    cfg.write_text('[model]\npreset = "small"\n[training]\nglobal_batch = 8\nmicro_batch = 4\n')
    assert _run(["estimate", "--config", str(cfg), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is None and "step_s" not in out and out["gpus"] == 1
    assert _run(["estimate", "--config", str(cfg), "--json", "--hbm-gb", "0.01"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert _run(["estimate", "--config", str(cfg), "--gpus", "2", "--gpu", "a100-40gb"]) == 0
    text = capsys.readouterr().out
    assert "fits: yes" in text and "tokens/s per GPU" in text and "dp=2" in text


def _category_rows(text: str) -> dict:
    """The `seconds per step by category` rows of `meshlm estimate`'s text: label -> seconds."""
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if "seconds per step by category" in x) + 1
    rows = {}
    for x in lines[start:]:
        if not x.startswith("    "):
            break
        label, secs = x[4:28].strip(), float(x[28:38])
        rows[label] = secs
    return rows


@pytest.mark.parametrize("extra", [[], ["--efficiency", "0.5"]])
def test_estimate_text_prints_the_step_by_category(capsys, extra):
    """The text output carries --json's breakdown: per-operation seconds (GEMM with the head, attention,
    element-wise, launches, ...) and the time model's terms, adding up to the step; a flat
    --efficiency prints its compute as one row."""
    argv = ["estimate", "--model.preset", "llama3-1b", "--gpus", "8", "--gpu", "h100", "--data.seq_len", "2048",
            "--training.global_batch", "32", "--training.micro_batch", "1", "--parallel.pp", "2",
            "--parallel.tp", "2", "--training.ac", "selective", *extra]
    argv += ["--training.compile", "false"]  # eager: launches outlast some kernels (compiled, they hide)
    assert _run(argv + ["--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert _run(argv) == 0
    rows = _category_rows(capsys.readouterr().out)
    t = js["time"]
    assert rows.pop("step") == pytest.approx(js["step_s"], abs=1e-4)
    assert sum(rows.values()) == pytest.approx(js["step_s"], abs=1e-3)
    assert rows["bubble"] == pytest.approx(t["bubble_s"], abs=1e-4) and rows["bubble"] > 0  # pp 2
    assert rows["communication exposed"] == pytest.approx(
        t["exposed_comm_microbatch_s"] + t["exposed_comm_step_s"], abs=1e-4) and rows["communication exposed"] > 0
    if extra:
        assert "GEMM" not in rows and rows["compute (flat)"] == pytest.approx(
            t["forward_s"] + t["backward_s"] + t["recompute_s"], abs=1e-4)
        return
    ops = js["ops"]
    assert rows["GEMM"] == pytest.approx(ops["gemm_s"] + ops["head_s"], abs=1e-4)
    for label, key in (("attention", "attention_s"), ("element-wise", "elementwise_s"),
                       ("launch / dispatch", "launch_s"), ("recompute", "recompute_s")):
        assert rows[label] == pytest.approx(ops[key], abs=1e-4) and rows[label] > 0, label


@pytest.mark.parametrize("argv,needle", [
    (["--model.preset", "llama3-8b", "--gpus", "6", "--parallel.tp", "3", "--training.micro_batch", "1"],
     "parallel.tp: 3 does not divide model.n_heads"),
    (["--model.preset", "nope"], "model.preset"),
    (["--gpus", "4", "--gpu", "tpu"], "--gpu"),
    (["--gpu", "custom"], "--peak-tflops"),
    (["--bogus", "1"], "unrecognised"),
    (["--gpu", "h100", "--cpu-adam-gparams", "0"], "--cpu-adam-gparams: must be positive"),
    (["--training.global_batch", "6", "--gpus", "4", "--training.micro_batch", "1"], "training.global_batch"),
])
def test_estimate_bad_input_is_one_line(capsys, argv, needle):
    assert _run(["estimate"] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_cpu_adam_rate_sets_the_offload_time(capsys):
    """--cpu-adam-gparams: the host AdamW share of an offloaded step scales as 1/rate."""
    argv = ["estimate", "--json", "--gpu", "h100", "--model.preset", "llama3-1b", "--training.micro_batch", "1",
            "--training.global_batch", "1", "--parallel.zero", "1", "--parallel.offload", "optimizer"]
    times = {}
    for rate in ("1", "4"):
        assert _run(argv + ["--cpu-adam-gparams", rate]) == 0
        times[rate] = json.loads(capsys.readouterr().out)["time"]["offload_s"]
    psi = _shape("llama3-1b").num_params()
    assert times["1"] - times["4"] == pytest.approx(psi / 1e9 - psi / 4e9, rel=1e-6)


def test_checks_without_resolve():
    sh = _shape("llama3-70b")
    check(sh, Spec(dp=8, tp=8, pp=4, zero=3, zero_group=8, accum=8, seq_len=8192))  # build_layout() would refuse
    with pytest.raises(PlanError, match="pp_virtual"):
        check(sh, Spec(pp=4, pp_schedule="1f1b", pp_virtual=2))
    with pytest.raises(PlanError, match="microbatches"):
        check(sh, Spec(pp=4, pp_schedule="interleaved", pp_virtual=2, accum=6))
    with pytest.raises(PlanError, match="parallel.ep"):
        check(sh, Spec(ep=2))


def test_moe_estimate_runs():
    cfg = C.load(None, [("model.preset", "small"), ("model.moe.num_experts", "8"), ("model.moe.top_k", "2"),
                        ("parallel.ep", "2"), ("parallel.zero", "1"), ("training.global_batch", "16"),
                        ("training.micro_batch", "4")])
    from meshlm.plan.spec import priced_on, shape_from_config, spec_from_config
    cfg = priced_on(cfg, gpu=True)
    sh = shape_from_config(cfg)
    out = estimate(sh, spec_from_config(cfg, 4), get_gpu("h100"))
    assert out["params"] > presets()["small"].num_params() and out["fits"]
    assert any(c["group"] == "ep" for c in out["comm"])


# ---------------------------------------------------------------- plan

def test_plan_405b_on_16k_gpus(capsys):
    t0 = time.perf_counter()
    code = _run(["plan", "--model", "llama3-405b", "--gpu", "h100", "--gpus", "16384", "--seq-len", "8192",
                 "--global-batch-tokens", str(16 * 2 ** 20), "--top", "5", "--json"])
    elapsed = time.perf_counter() - t0
    out = json.loads(capsys.readouterr().out)
    print(f"plan llama3-405b on 16384 H100: {elapsed:.2f} s, best {out[0]['tokens_per_s_per_gpu']:.1f} tok/s/GPU, "
          f"MFU {out[0]['mfu']:.3f}")
    assert code == 0 and len(out) == 5  # its time is printed, not asserted: a shared machine is no stopwatch
    for r in out:
        L = r["layout"]
        assert L["tp"] * L["pp"] * L["cp"] * L["dp"] == 16384
        assert r["fits"] and r["per_gpu"]["total"] <= r["usable_bytes"]
        assert L["global_batch"] * L["seq_len"] == 16 * 2 ** 20
        assert {"ac", "offload", "micro_batch", "zero", "pp_schedule"} <= set(L)
    speeds = [r["tokens_per_s_per_gpu"] for r in out]
    assert speeds == sorted(speeds, reverse=True)


def test_plan_emit_config_trains_and_resolves(tmp_path, capsys):
    from harness import build_layout
    out = tmp_path / "best.toml"
    code = _run(["plan", "--model", "small", "--gpu", "h100", "--gpus", "2", "--seq-len", "256",
                 "--global-batch-tokens", str(16 * 256), "--fix", "tp=1", "--fix", "pp=1", "--fix", "cp=1",
                 "--fix", "zero=0", "--emit-config", str(out), "--explain"])
    text = capsys.readouterr().out
    assert code == 0 and "wrote" in text and "discarded" in text
    cfg = C.load(str(out))
    layout = build_layout(cfg, 2)  # every degree here has a runtime today
    assert layout.world_size == 2 and cfg.model.preset == "small" and cfg.data.seq_len == 256
    assert cfg.training.global_batch == 16 and cfg.training.precision == "bf16"
    # a big plan's config is the layout it priced: its estimate is the plan's row, number for number (the
    # winner here is an interleaved pipeline whose cost-balanced split is not the runtime's default)
    big = tmp_path / "big.toml"
    assert _run(["plan", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--seq-len", "8192",
                 "--global-batch-tokens", str(2 ** 21), "--emit-config", str(big), "--json", "--top", "1"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    best = row["layout"]
    cfg = C.load(str(big))
    p = cfg.parallel
    assert (p.tp, p.pp, p.cp, p.dp, p.zero, p.pp_schedule) == (best["tp"], best["pp"], best["cp"], best["dp"],
                                                               best["zero"], best["pp_schedule"])
    assert best["pp_layers"] and p.pp_layers == best["pp_layers"]
    assert cfg.training.micro_batch * p.microbatches * p.dp == cfg.training.global_batch
    assert _run(["estimate", "--config", str(big), "--gpus", "64", "--gpu", "h100", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["layout"] == best and est["per_gpu"] == row["per_gpu"] and est["fits"] is True
    assert est["step_s"] == pytest.approx(row["step_s"])
    from meshlm.plan.spec import shape_from_config, spec_from_config
    check(shape_from_config(cfg), spec_from_config(cfg, 64))


@pytest.mark.parametrize("argv,needle", [
    (["--model", "small", "--gpu", "h100", "--gpus", "0"], "--gpus"),
    (["--model", "small", "--gpu", "h100", "--gpus", "8", "--seq-len", "256", "--global-batch-tokens", "1000"],
     "--global-batch-tokens"),
    (["--model", "small", "--gpu", "h100", "--gpus", "8", "--fix", "tq=2"], "--fix"),
    (["--gpu", "h100", "--gpus", "8"], "--model"),
    (["--model", "small", "--gpu", "h100", "--gpus", "8", "--top", "2", "--emit-rank", "3"], "--emit-rank"),
])
def test_plan_bad_input(capsys, argv, needle):
    assert _run(["plan"] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_plan_counts_every_candidate_once():
    """fit + out of memory + invalid = searched (the explorer's caption adds them up); dominated is part of fit."""
    from meshlm.plan.hardware import get_gpu
    from meshlm.plan.search.ranked import plan
    from meshlm.plan.spec import Shape, presets
    c = plan(Shape(presets()["llama3-8b"], "llama3-8b"), get_gpu("a100-40gb"), 16, 4096, 2 ** 20).counts
    assert c["fit"] + c["oom"] + c["invalid"] == c["candidates"] and 0 < c["dominated"] < c["fit"]
    assert c["oom"] and c["invalid"]


def test_plan_reports_when_nothing_fits(capsys):
    assert _run(["plan", "--model", "llama3-405b", "--gpu", "a100-40gb", "--gpus", "8", "--seq-len", "4096",
                 "--global-batch-tokens", str(2 ** 20), "--explain"]) == 1
    captured = capsys.readouterr()
    assert "out of memory" in captured.out and "no layout fits" in captured.err


def test_plan_package_stays_torch_free():
    code = ("import sys; from meshlm.plan import cli as cli_cmds; from meshlm.plan.search import ranked as search; from meshlm.plan.cost import estimate; from meshlm.plan.spec import presets, Shape;"
            "from meshlm.plan.hardware import get_gpu;"
            "search.plan(Shape(presets()['llama3-8b'], 'llama3-8b'), get_gpu('h100'), 64, 8192, 2**22, top=3);"
            "assert 'torch' not in sys.modules, 'plan imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- activations vs autograd


def _measure_block(torch, ac, dtype, b, s, d, h, kv, ffn, math):
    """Bytes block 0 saves for backward, from saved-tensor hooks: distinct storages, without the
    parameters and the RoPE tables (model-wide, not per block)."""
    from meshlm.core.model_args import ModelArgs
    from meshlm.model.llama import Llama
    from meshlm.parallel.features.activation_checkpoint import apply_ac
    from meshlm.parallel.model_plans.llama import LLAMA_PLAN
    args = ModelArgs(dim=d, n_layers=1, n_heads=h, n_kv_heads=kv, ffn_dim=ffn, vocab_size=64, max_seq_len=s)
    torch.manual_seed(0)
    model = Llama(args).to(dtype)
    apply_ac(model, ac, LLAMA_PLAN)
    cos, sin = model.rope(s, torch.device("cpu"))
    cos, sin = cos[:s], sin[:s]
    from meshlm.train.observe.saved import saved_bytes
    x = torch.randn(b, s, d, dtype=dtype, requires_grad=True)
    out = []
    ctx = torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]) if math else _null()
    with ctx:  # the backward recomputes under the same SDPA backend
        saved = saved_bytes(lambda: out.append(model.layers["0"](x, cos, sin)), skip=list(model.parameters()) + [cos, sin])
        out[0].float().sum().backward()
    scores_saved = any(n == b * h * s * s * (4 if dtype == torch.float32 or math else 2) for n in saved.sizes)
    return saved.total, scores_saved


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


SHAPES = [(2, 64, 64, 4, 2, 160), (1, 128, 96, 6, 6, 256)]  # (micro_batch, seq, dim, heads, kv heads, ffn)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("math", [False, True], ids=["default-sdpa", "math-sdpa"])
def test_activation_model_matches_saved_tensors(precision, ac, math):
    torch = pytest.importorskip("torch")
    from meshlm.core.model_args import ModelArgs
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    worst = 0.0
    for b, s, d, h, kv, ffn in SHAPES:
        measured, scores = _measure_block(torch, ac, dtype, b, s, d, h, kv, ffn, math)
        # CPU SDPA: the default picks the fused (flash) kernel; the math path saves the S×S probabilities
        # and on CPU upcasts bf16 to fp32 (attn_math_bytes=4).
        flash = not scores
        if ac == "none":
            assert flash == (not math)
        sh = Shape(ModelArgs(dim=d, n_layers=1, n_heads=h, n_kv_heads=kv, ffn_dim=ffn, vocab_size=64,
                             max_seq_len=s))
        predicted = block_activation_bytes(sh, b * s, s, 4 if precision == "fp32" else 2, ac=ac, flash=flash,
                                           attn_math_bytes=4)
        err = abs(predicted - measured) / measured
        worst = max(worst, err)
        assert err < 0.10, (precision, ac, math, (b, s, d), predicted, measured)
    print(f"activations {precision} ac={ac} {'math' if math else 'default'}: worst error {worst:.2%}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_whole_model_activations_match_saved_tensors(precision):
    """Blocks + embedding ids + final norm, head input, fp32 log-probs and targets of the loss (pp = 1)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from meshlm.core.model_args import ModelArgs
    from meshlm.model.llama import Llama
    from meshlm.parallel.features.activation_checkpoint import apply_ac
    from meshlm.parallel.model_plans.llama import LLAMA_PLAN
    from meshlm.train.observe.saved import saved_bytes
    b, s = 2, 64
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=300, max_seq_len=s)
    for ac in ("none", "selective", "full"):
        model = Llama(args).to(torch.float32 if precision == "fp32" else torch.bfloat16)
        apply_ac(model, ac, LLAMA_PLAN)
        model.rope(s, torch.device("cpu"))
        x, y = torch.randint(0, 300, (b, s)), torch.randint(0, 300, (b, s))
        saved = saved_bytes(lambda: F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()),  # as the trainer
                            skip=list(model.parameters()) + list(model.rope_cache))
        predicted = stage_memory(Shape(args), Spec(micro_batch=b, seq_len=s, precision=precision, ac=ac),
                                 "only").breakdown()["activations"]
        measured = saved.total
        assert abs(predicted - measured) / measured < 0.01, (ac, predicted, measured)


@pytest.mark.parametrize("bucket_mb", [25.0, 8192.0])
def test_last_gradient_bucket_stays_exposed(bucket_mb):
    """DP reduces one bucket per call and the last bucket fills only when the backward ends
    (parallel/dims/data_parallel.py), so at least one call of the all-reduce is exposed even when the
    backward is long enough to hide the rest; gradients that fit one bucket are exposed whole."""
    from meshlm.plan.spec import Spec
    sh = _shape("llama3-1b")
    s = Spec(dp=8, micro_batch=1, seq_len=2048, accum=4, bucket_mb=bucket_mb, precision="bf16")
    ar = next(c for c in estimate(sh, s, get_gpu("h100"))["comm"] if c["group"] == "dp")
    grad_bytes = 4 * sh.num_params()  # fp32 reduction (Spec's reduce_dtype default)
    assert ar["calls"] == max(1, int(grad_bytes // (bucket_mb * 2 ** 20)))
    one_call = ar["seconds"] / ar["calls"]
    if ar["calls"] == 1:
        assert ar["exposed_s"] == pytest.approx(ar["seconds"])
    else:  # ~190 buckets of a 1B model: the backward hides all but the last
        assert ar["exposed_s"] == pytest.approx(one_call, rel=1e-6) and ar["exposed_s"] < 0.02 * ar["seconds"]
