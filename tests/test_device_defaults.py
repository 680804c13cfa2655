"""training.precision / training.compile / model.attn_impl = "auto": each device's defaults, resolved
before any worker starts (distributed/mesh.py device_defaults), written into config.toml; explicit values win."""
import pytest
import torch

from meshlm.core import config as C
from meshlm.distributed.mesh import device_defaults


def _gpu(monkeypatch, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_llama3_1b_on_a_cuda_device_resolves_to_bf16_and_compile(monkeypatch):
    _gpu(monkeypatch)
    cfg = device_defaults(C.load(None, [("model.preset", "llama3-1b")]))  # what `meshlm train` resolves
    assert cfg.training.precision == "bf16" and cfg.training.compile is True
    text = C.to_toml(cfg)
    assert 'precision = "bf16"' in text and "compile = true" in text


def test_meshlm_train_on_a_cuda_machine_writes_and_prints_the_resolved_values(monkeypatch, tmp_path, capsys):
    """The launcher's side of `meshlm train --model.preset llama3-1b --nproc 2` on a (mocked) CUDA machine:
    config.toml, which the workers read, and the start-up line carry bf16 + compile; the workers
    themselves are not started."""
    from meshlm.cli import main
    from meshlm.train import launch
    _gpu(monkeypatch)
    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a) or 0)
    run = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--run-dir", str(run), "--model.preset", "llama3-1b",
                 "--training.micro_batch", "4"]) == 0
    assert len(started) == 1
    t = C.load(str(run / "config.toml")).training
    assert (t.precision, t.compile) == ("bf16", True)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"meshlm: llama3-1b, 2 workers, precision bf16, compile on, run dir {run}; energy "), first


def test_a_gpu_without_bf16_keeps_fp32_and_compiles(monkeypatch):
    _gpu(monkeypatch, bf16=False)
    t = device_defaults(C.Config()).training
    assert (t.precision, t.compile) == ("fp32", True)


def test_a_cpu_resolves_to_fp32_eager(monkeypatch):
    _gpu(monkeypatch)  # a GPU in the machine, but the config asks for the CPU
    t = device_defaults(C.load(None, [("training.device", "cpu")])).training
    assert (t.precision, t.compile) == ("fp32", False)


def test_explicit_values_win(monkeypatch):
    _gpu(monkeypatch)
    t = device_defaults(C.load(None, [("training.precision", "fp16"), ("training.compile", "false")])).training
    assert (t.precision, t.compile) == ("fp16", False)


def test_auto_round_trips_through_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(C.to_toml(C.Config()))
    t = C.load(str(path)).training
    assert (t.precision, t.compile) == ("auto", "auto")


@pytest.mark.parametrize("key,value", [("training.compile", "maybe"), ("training.precision", "fp64")])
def test_bad_values_are_one_line(key, value):
    with pytest.raises(C.ConfigError, match=key):
        device_defaults(C.load(None, [(key, value)]))


# -- the planner prices "auto" for the device of the estimate ------------------------------------------
SMALL = [("model.preset", "debug"), ("data.seq_len", "32"), ("training.global_batch", "8"),
         ("training.micro_batch", "2")]


def test_planner_refuses_an_unpriced_auto():
    from meshlm.plan.spec import PlanError, code_options, spec_from_config
    cfg = C.load(None, SMALL)
    with pytest.raises(PlanError, match="training.precision"):
        spec_from_config(cfg, 1)
    with pytest.raises(PlanError, match="training.compile"):
        code_options(cfg)


def test_estimate_on_a_gpu_profile_prices_bf16_compiled(capsys):
    import json
    from meshlm.cli import main
    argv = ["estimate", "--gpu", "h100", "--gpus", "2", "--json", *(f"--{k}={v}" for k, v in SMALL)]
    assert main(argv) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main(argv + ["--training.precision", "bf16", "--training.compile", "true"]) == 0
    assert json.loads(capsys.readouterr().out) == auto
    assert main(argv + ["--training.precision", "fp32", "--training.compile", "false"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert auto["compiled"] is True and eager["compiled"] is False
    assert auto["per_gpu"]["params"] * 2 == eager["per_gpu"]["params"]  # bf16 against fp32 parameters


def test_planner_prices_a_cpu_fp32_eager_and_a_gpu_bf16_compiled():
    from meshlm.plan.search.auto import choose_layout as choose
    from meshlm.plan.calibrate.fit import Calibration, predict
    from meshlm.plan.hardware import get_gpu
    cfg = C.load(None, SMALL + [("parallel.auto", "true")])
    new, rec = choose(cfg, 2)  # no profile: this CPU
    assert (new.training.precision, new.training.compile, rec["layout"]["precision"]) == ("fp32", False, "fp32")
    new, rec = choose(cfg, 2, get_gpu("h100"))
    assert (new.training.precision, new.training.compile, rec["layout"]["precision"]) == ("bf16", True, "bf16")
    assert cfg.training.precision == "auto"  # the caller's config is left as it was
    cpu = Calibration(rate_flops=1e10, link_bytes_s=1e9, cores=2)  # a CPU run's calibration
    explicit = C.load(None, SMALL + [("training.precision", "fp32"), ("training.compile", "false")])
    assert predict(cpu, C.load(None, SMALL), 2) == predict(cpu, explicit, 2)


def test_plan_compiles_on_a_gpu_unless_told_not_to(capsys):
    import json
    from meshlm.cli import main
    argv = ["plan", "--model", "debug", "--gpu", "h100", "--gpus", "2", "--seq-len", "32", "--global-batch-tokens",
            "256", "--top", "1", "--json"]
    got = {}
    for flag in ((), ("--compile",), ("--no-compile",)):
        assert main([*argv, *flag]) == 0
        got[flag] = json.loads(capsys.readouterr().out)[0]
    assert got[()] == got[("--compile",)]  # "auto" on a GPU profile
    assert got[()]["compiled"] is True and got[("--no-compile",)]["compiled"] is False


def test_attention_auto_is_sdpa_on_a_cpu_and_stays_auto_on_cuda(monkeypatch):
    """model.attn_impl = "auto" per device (issue 47; docs/benchmarks.md, "Attention kernels by device"):
    on a CPU the config gets sdpa (flex fuses only its forward there), on CUDA it stays auto and the
    model runs flex under a document mask (measured 1.11x SDPA's dense mask on an H200); explicit wins."""
    from meshlm.core.config.model import model_args
    mask = [("data.document_mask", "true")]
    cpu = device_defaults(C.load(None, mask + [("training.device", "cpu")]))
    assert cpu.model.attn_impl == "sdpa" and model_args(cpu).attn_kernel == "sdpa"
    pinned = device_defaults(C.load(None, mask + [("training.device", "cpu"), ("model.attn_impl", "flex")]))
    assert model_args(pinned).attn_kernel == "flex"
    _gpu(monkeypatch)
    gpu = device_defaults(C.load(None, mask))
    assert gpu.model.attn_impl == "auto" and model_args(gpu).attn_kernel == "flex"
    assert model_args(device_defaults(C.load(None, []))).attn_kernel == "sdpa"  # no mask: SDPA's causal kernel


def test_start_up_line_names_the_attention_kernel_and_why(monkeypatch, tmp_path, capsys):
    from meshlm.cli import main
    from meshlm.train import launch
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: 0)
    lines = []
    for impl in ("auto", "flex"):
        run = tmp_path / impl
        assert main(["train", "--nproc", "2", "--run-dir", str(run), "--model.preset", "debug", "--training.micro_batch",
                     "4", "--training.device", "cpu", "--data.document_mask", "true", "--model.attn_impl", impl]) == 0
        lines.append(capsys.readouterr().err.splitlines()[0])
    assert ", attention sdpa (auto: SDPA with the mask on a CPU, where flex fuses only its forward)," in lines[0]
    assert ", attention flex, run dir" in lines[1], lines[1]
    assert C.load(str(tmp_path / "auto" / "config.toml")).model.attn_impl == "sdpa"  # resolved into config.toml


def test_ranks_beyond_the_gpus_share_them_over_gloo(monkeypatch):
    """More local ranks than CUDA devices (two ranks on one GPU, bench/multirank.py): device
    local_rank % count, and gloo (whose Comm stages CUDA tensors through host memory) instead of NCCL."""
    from meshlm.distributed import mesh
    _gpu(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert mesh.ranks_share_gpus() and mesh.pick_device("auto") == torch.device("cuda", 0) and chosen == [0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not mesh.ranks_share_gpus()
