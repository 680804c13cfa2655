"""fp8 training (training.precision = "fp8", parallel/features/float8.py) on the CPU through the production path
(torchao's Float8Linear multiplying with torch._scaled_mm, which torch 2.13's CPU build has; each layout row
counts the calls, so an emulated stand-in fails it): which linears convert, losses near bf16 in one process
and in layouts, checkpoints interchangeable with bf16 runs, and the one-line refusals. The emulation
against the production path: tests/test_fp8_production.py."""
import shutil
import sys
import tempfile

import pytest
import torch
from harness import TINY, make_config, read_metrics, reference, run_local, sources_corpus, train_case, twin

from meshlm.core import config as C
from harness import build_layout

FP8 = {"training__precision": "fp8"}  # the production path: torch._scaled_mm on the CPU (docs/fp8.md)
EMULATED = {**FP8, "training__fp8_emulate": True}
# Where fp8 against bf16 means something (issue #45). The comparison used to run 30 steps; from about step 9
# on, the standard library's sources reach batches on which the loss levels off or jumps and any perturbation
# is amplified: two bf16 runs that differ only in accumulation order were 5.7e-4 apart at step 9 and 1.2e-2
# at step 26 with AMX kernels, fp8 against bf16 4.9e-2 (tp2-kv1) there, so the 2% bound held only on the CPU
# it was measured on. Over the first 8 steps (loss 5.51 -> 4.20) the same two bf16 runs agree within 7e-5
# (AMX and AVX2 kernels alike) and fp8 stays within 1.4e-3 of bf16 (one process: 6.4e-4 with AMX kernels,
# 1.4e-3 with AVX2 ones; the tp2-kv1 layouts 9e-4 on both): the 2% is 14x the worst measured, and a
# scale 16x too large (most values saturate) is 2.7-13% off from step 2 on (test_bound_catches_a_saturating_scale).
# Data pinned.
STEPS = {"training__steps": 8, "data__path": sources_corpus()}
WITHIN = 0.02
# the premise, checked in each test: two bf16 runs that differ only in accumulation order (harness.twin:
# micro-batches of 1 instead of 2, the gradients summed in fp32 in another grouping) agree to well under
# the bound on the compared steps, on whatever CPU runs this (measured <= 7e-5; WITHIN / 20 leaves room for
# kernels not seen yet, and a CPU that exceeds it is told "noise floor", not "fp8 broke": over 12 steps
# it was 1.04e-3)
FLOOR = WITHIN / 20


def bf16_reference(**single) -> list[dict]:
    """One process's bf16 losses over STEPS, after checking that the comparison is meaningful on this
    CPU (FLOOR): the bf16 run-to-run spread under another accumulation order is small."""
    ref = reference(training__precision="bf16", **STEPS, **single)
    other = reference(**twin({"training__precision": "bf16", **STEPS, **single}))
    spread = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(ref, other))
    print(f"bf16 spread under another accumulation order {spread:.2e}")
    assert spread <= FLOOR, f"bf16 runs differing only in accumulation order {spread:.2e} apart (> {FLOOR}): " \
                            "on this CPU the fp8-vs-bf16 steps compared are not above bf16's noise floor"
    return ref


def assert_near_bf16(ref: list[dict], got: list[dict]) -> None:
    n = STEPS["training__steps"]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, n + 1))
    worst = 0.0
    for a, b in zip(ref, got):
        rel = abs(a["loss"] - b["loss"]) / a["loss"]
        assert rel <= WITHIN, f"step {a['step']}: fp8 loss {b['loss']} vs bf16 {a['loss']} (rel {rel:.2e})"
        worst = max(worst, rel)
    print(f"worst relative loss difference fp8 vs bf16 {worst:.2e}, last step "
          f"{abs(ref[-1]['loss'] - got[-1]['loss']) / ref[-1]['loss']:.2e}")
    assert ref[-1]["loss"] < ref[0]["loss"] - 1.0  # both trained, not only agreed


def test_block_linears_convert_and_state_dict_keys_stay():
    from torchao.float8.float8_linear import Float8Linear

    from meshlm.core.layout import model_args
    from meshlm.model import build_model
    from meshlm.model.init import materialize
    from meshlm.parallel.features.float8 import convert_to_float8
    from meshlm.parallel.model_plans.moe import model_plan_for

    model = build_model(model_args(make_config()))
    materialize(model, 0, "cpu", torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = convert_to_float8(model, model_plan_for(model), "rowwise", emulate=True)
    assert len(done) == 7 * BLOCKS  # wq wk wv wo w1 w2 w3 in each block
    kinds = {n: type(m) for n, m in model.named_modules()}
    assert all(kinds[n] is Float8Linear for n in done)
    assert not any(issubclass(kinds[n], Float8Linear) for n in ("output", "tok_embeddings"))
    after = model.state_dict()
    assert list(after) == list(before)  # a bf16 run's checkpoint keys, in order
    assert all(torch.equal(after[k], before[k]) for k in before)
    y = model(torch.randint(0, 256, (2, 16)))
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert model.layers["0"].attention.wq.weight.grad is not None


@pytest.mark.isa
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_within_2_percent_of_bf16(recipe):
    got = run_local(make_config(**FP8, **STEPS, training__fp8_recipe=recipe))
    assert_near_bf16(bf16_reference(), got)


@pytest.mark.isa
def test_bound_catches_a_saturating_scale(monkeypatch):
    """The bound is tight enough to see broken quantisation: every float8 scale 16x too large (values above
    1/16 of a tensor's absmax saturate at e4m3's 448) trains 2.7-13% away from bf16 over the same steps."""
    import torchao.float8.float8_scaling_utils as scaling

    right = scaling.tensor_to_scale
    monkeypatch.setattr(scaling, "tensor_to_scale", lambda *a, **k: right(*a, **k) * 16)
    got = run_local(make_config(**FP8, **STEPS))
    with pytest.raises(AssertionError, match="fp8 loss"):
        assert_near_bf16(bf16_reference(), got)


BLOCKS = TINY["model.n_layers"]
ALL = {"Float8Linear": 7 * BLOCKS}  # wq wk wv wo w1 w2 w3 in each block
LAYOUTS = [
    ("dp2-tp2", 4, {"parallel__dp": 2, "parallel__tp": 2}, ALL),
    # one kv head replicated over both TP ranks: wk, wv sum their gradients in a float8 subclass
    ("tp2-gqa-kv1", 2, {"parallel__tp": 2, "model__n_kv_heads": 1},
     {"Float8Linear": 5 * BLOCKS, "Float8ReplicatedKVLinear": 2 * BLOCKS}),
    # SP: the region's entry gathers through a hook, so the column-parallel linears stay nn.Linear
    ("tp2-sp-kv1", 2, {"parallel__tp": 2, "parallel__sp": True, "model__n_kv_heads": 1},
     {"Float8Linear": 5 * BLOCKS, "Float8ReplicatedKVLinear": 2 * BLOCKS}),
    # ZeRO-3 gathers the weights in float8 (training.fp8_comm "zero", tests/test_fp8_comm.py): a subclass takes them
    ("zero3-dp2", 2, {"parallel__dp": 2, "parallel__zero": 3}, {"Float8ZeroLinear": 7 * BLOCKS}),
    ("zero1-dp2-offload", 2, {"parallel__dp": 2, "parallel__zero": 1, "parallel__offload": "optimizer"}, ALL),
    ("pp2", 2, {"parallel__pp": 2}, {"Float8Linear": 7 * BLOCKS // 2}),  # each stage holds half the blocks
    ("cp2-ring-ac-full", 2, {"parallel__cp": 2, "training__ac": "full"}, ALL),
]


def float8_path(trainer):
    """Runs in a pool rank: how many of its modules are of each float8 class (an emulated one is named so),
    then, asked again after training, with the torch._scaled_mm calls its steps made (each float8 linear
    three a micro-batch: output, input and weight gradients; torchao looks the op up on `torch` per call)."""
    kinds: dict[str, int] = {}
    for m in trainer.model.modules():
        if "Float8" in type(m).__name__:
            name = type(m).__name__ + (" (emulated)" if getattr(getattr(m, "config", None), "emulate", False) else "")
            kinds[name] = kinds.get(name, 0) + 1
    real, calls = torch._scaled_mm, [0]

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    def after() -> dict:
        torch._scaled_mm = real  # the pool's worker runs other tests next
        linears = sum(n for k, n in kinds.items() if "Linear" in k)
        return {**kinds, "scaled_mm_per_linear_step": calls[0] / max(1, linears) / trainer.cfg.training.steps}

    torch._scaled_mm = counted
    return after


@pytest.mark.isa
@pytest.mark.parametrize("name,world,overrides,kinds", [pytest.param(*c, id=c[0]) for c in LAYOUTS])
def test_fp8_layout_within_2_percent_of_bf16(pools, name, world, overrides, kinds):
    single = {k: v for k, v in overrides.items() if not k.startswith("parallel__")}
    ref = bf16_reference(**single)
    run_dir = tempfile.mkdtemp(prefix="meshlm-fp8-")
    seen = pools(world).run(train_case, C.to_dict(make_config(**FP8, **STEPS, **overrides)), run_dir, 0,
                            float8_path)
    for got in seen:  # every rank multiplies its block linears in float8, through torch._scaled_mm
        assert got.pop("scaled_mm_per_linear_step") >= 3, "the production path's torch._scaled_mm was not called"
    assert seen == [kinds] * world
    assert_near_bf16(ref, read_metrics(run_dir))


def test_fp8_checkpoints_resume_exactly_and_load_into_bf16(tmp_path):
    from test_train import truncate_run

    every = {"checkpoint__every": 3, "checkpoint__keep": 3, "training__steps": 6}
    ref = run_local(make_config(**FP8, **every), str(tmp_path / "a"))
    truncate_run(str(tmp_path / "a"), 3)
    for name in ("b", "c"):  # the same checkpoint resumed by an fp8 and by a bf16 run
        (tmp_path / name).mkdir()
        shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / name / "checkpoints")
        shutil.copy(tmp_path / "a" / "metrics.jsonl", tmp_path / name / "metrics.jsonl")
    resumed = run_local(make_config(**FP8, **every, checkpoint__resume="auto"), str(tmp_path / "b"))
    assert [r["loss"] for r in resumed[3:]] == [r["loss"] for r in ref[3:]]  # exact
    as_bf16 = run_local(make_config(**every, training__precision="bf16", checkpoint__resume="auto"),
                        str(tmp_path / "c"))
    assert [r["step"] for r in as_bf16] == list(range(1, 7))
    for a, b in zip(ref[3:], as_bf16[3:]):
        assert abs(a["loss"] - b["loss"]) / a["loss"] <= WITHIN
    assert read_metrics(str(tmp_path / "c"))[3]["loss"] != ref[3]["loss"]  # bf16 really computed step 4


REFUSALS = [
    ({**FP8, "training__fp8_recipe": "delayed"}, "training.fp8_recipe: 'delayed' is not one of tensorwise, rowwise"),
    ({**FP8, "training__fp8_comm": ["zero", "tp"]}, "training.fp8_comm: 'tp' is not one of zero, sp, ep"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS, ids=["recipe", "comm"])
def test_fp8_refusals_are_one_line(overrides, message):
    with pytest.raises(C.ConfigError, match=message) as e:
        build_layout(make_config(**overrides), 1)
    assert "\n" not in str(e.value)


def fp8_checked(cfg, world: int = 1):
    """What the entry asks before any worker (preflight.py): the layout, then the device's float8 kernels
    (model/fp8_kernels.py `check_fp8_device`)."""
    from meshlm.core.config.model import model_args
    from meshlm.model.fp8_kernels import check_fp8_device
    layout = build_layout(cfg, world)
    check_fp8_device(cfg.training, model_args(cfg).moe)
    return layout



@pytest.fixture
def no_cpu_scaled_mm(monkeypatch):
    """A torch whose CPU build has no torch._scaled_mm: the op raises as an unregistered one does."""
    from meshlm.model.fp8_kernels import cpu_scaled_mm_missing

    def unregistered(*a, **k):
        raise NotImplementedError("Could not run 'aten::_scaled_mm' with arguments from the 'CPU' backend.")

    monkeypatch.setattr(torch, "_scaled_mm", unregistered)
    cpu_scaled_mm_missing.cache_clear()
    yield
    cpu_scaled_mm_missing.cache_clear()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cpu_without_scaled_mm_is_refused_in_one_line(no_cpu_scaled_mm, recipe):
    with pytest.raises(C.ConfigError, match=rf"fp8 on the CPU needs a {recipe} torch._scaled_mm on the CPU .*"
                                            r"Could not run 'aten::_scaled_mm'.*fp8_emulate = true") as e:
        fp8_checked(make_config(**FP8, training__fp8_recipe=recipe), 1)
    assert "\n" not in str(e.value)
    fp8_checked(make_config(**EMULATED, training__fp8_recipe=recipe), 1)  # the way to run anyway


def test_cpu_with_scaled_mm_runs_both_recipes_and_moe():
    """torch 2.13's CPU build has the kernel: nothing is refused, MoE included (its experts emulate)."""
    from meshlm.model.fp8_kernels import cpu_scaled_mm_missing, fp8_path

    assert cpu_scaled_mm_missing("tensorwise") is None and cpu_scaled_mm_missing("rowwise") is None
    for recipe in ("tensorwise", "rowwise"):
        fp8_checked(make_config(**FP8, training__fp8_recipe=recipe), 1)
    fp8_checked(make_config(**FP8, model__preset="moe-debug"), 1)
    assert fp8_path("cpu", "rowwise", False, True) == ("float8 rowwise through torch._scaled_mm on cpu; experts "
                                                       "emulated (no torch._scaled_grouped_mm on cpu)")


def test_gpu_without_float8_is_refused_and_one_with_it_passes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    cfg = make_config(training__precision="fp8")
    with pytest.raises(C.ConfigError, match=r"compute capability >= 8.9 .*A100-SXM4-80GB has 8.0") as e:
        fp8_checked(cfg)
    assert "\n" not in str(e.value)
    fp8_checked(make_config(**EMULATED))  # emulation runs anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert fp8_checked(cfg).tp == 1


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # importlib.util.find_spec then answers None
    with pytest.raises(C.ConfigError, match=r"pip install meshlm\[gpu\]"):
        build_layout(make_config(**FP8), 1)


def test_cli_refuses_fp8_without_the_kernel_before_any_worker(no_cpu_scaled_mm, tmp_path, capsys):
    from meshlm.cli import main

    code = main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--model.preset", "debug",
                 "--training.global_batch", "16", "--training.micro_batch", "8", "--training.precision", "fp8",
                 "--training.device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "fp8 on the CPU needs" in err, err
    assert not (tmp_path / "run").exists()
