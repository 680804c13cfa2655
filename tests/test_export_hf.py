"""checkpoint.export_hf (issue 22, item 5): the trainer writes a transformers directory from its
sharded state — rank 0 streams the checkpoint just written, one tensor at a time — in a dp2 ZeRO-3
and a tp2 layout; transformers loads it and gives the logits of meshlm's own checkpoint. Every-N
exports land per step; bad values are one line before any step."""
import os

import pytest
import torch

from harness import make_config, run_local, train_case
from meshlm.core import config as C
from meshlm.cli import main

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject [dev])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check_export(run: str, step: int) -> None:
    from meshlm.train.convert import load_model
    out = os.path.join(run, "hf", f"step_{step:08d}")
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert next(hf.parameters()).dtype == torch.float32
    model = load_model(os.path.join(run, "checkpoints", f"step_{step:08d}"))[0]
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert rel(theirs, ours) <= 1e-5
    fresh = model_at_init()  # the export is the trained weights, not the initial ones
    with torch.no_grad():
        assert rel(fresh(x), ours) > 1e-4


def model_at_init():
    from meshlm.core.config.model import model_args
    from meshlm.model import Llama, materialize
    cfg = make_config()
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    materialize(model, cfg.training.seed, "cpu")
    return model.eval()


@pytest.mark.parametrize("layout", [{"parallel__dp": 2, "parallel__zero": 3, "training__micro_batch": 1},
                                    {"parallel__tp": 2}], ids=["dp2-zero3", "tp2"])
def test_export_at_the_end_of_a_sharded_run(pools, tmp_path, layout):
    cfg = make_config(training__steps=3, checkpoint__export_hf="end", checkpoint__export_dtype="fp32",
                      model__n_kv_heads=2, **layout)
    run = str(tmp_path / "run")
    pools(2).run(train_case, C.to_dict(cfg), run)
    assert os.listdir(os.path.join(run, "hf")) == ["step_00000003"]
    check_export(run, 3)


@pytest.mark.slow
def test_export_every_n_steps(tmp_path):
    cfg = make_config(training__steps=3, checkpoint__export_hf=2, checkpoint__export_dtype="fp32")
    run = str(tmp_path / "run")
    run_local(cfg, run)
    assert sorted(os.listdir(os.path.join(run, "hf"))) == ["step_00000002", "step_00000003"]
    check_export(run, 2)


def test_bad_export_values_are_one_line(tmp_path, capsys):
    run = str(tmp_path / "run")
    for args, key in ((["--checkpoint.export_hf", "sometimes"], "checkpoint.export_hf"),
                      (["--checkpoint.export_hf", "0"], "checkpoint.export_hf"),
                      (["--checkpoint.export_hf", "end", "--checkpoint.export_dtype", "fp8"],
                       "checkpoint.export_dtype"),
                      (["--checkpoint.export_hf", "end", "--model.preset", "moe-debug"], "checkpoint.export_hf")):
        assert main(["train", "--run-dir", run, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"meshlm: {key}") and "\n" not in err, err
    assert not os.path.exists(run)
