"""One step interface (parallel/step.py `StepRunner`) for gradient accumulation and the pipeline runtime;
`parallelize()` returns a finished, frozen `Parallelized`; MESHLM_PLUGINS names only importable
modules with an `install`, and the product has no test switches."""
import dataclasses
import inspect
import tempfile

import pytest
import torch
from harness import make_config

from meshlm.data.sampler import Batch
from meshlm.parallel.dims.pipeline.runtime import PipelineRuntime
from meshlm.parallel.step import Accumulation, StepRunner

MEMBERS = [n for n, v in vars(StepRunner).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("cls", [Accumulation, PipelineRuntime], ids=lambda c: c.__name__)
def test_both_runners_have_the_protocol_methods(cls):
    assert set(MEMBERS) == {"run", "eval_loss"}
    for name in MEMBERS:
        want = list(inspect.signature(getattr(StepRunner, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} differs from StepRunner.{name}{want}"


def _trainer(**over):
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.plan.search.auto import layout_for_run
    from meshlm.train.trainer import Trainer

    cfg = make_config(**over)
    layout, _ = layout_for_run(cfg, 1)
    return Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-runner-"), init_context(layout.shape(), pick_device("cpu")),
                   layout)


def test_accumulation_is_the_whole_batch_step_and_parallelized_is_frozen():
    tr = _trainer(training__global_batch=8, training__micro_batch=2)
    par = tr.par
    assert isinstance(par.runner, Accumulation) and par.runner.accum == 4 and par.pipeline is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        par.runner = None
    batch = Batch(*tr.data.next_batch(0, 1))
    loss_sum = par.runner.run(batch, 1.0 / 4)
    grads = [g.clone() for g in par.grads.grad_tensors()]
    whole = Accumulation(par.model, par.loss_fn, par.grads, micro_batch=8, accum=1)
    loss = whole.run(batch, 1.0)
    torch.testing.assert_close(loss_sum / 4, loss, rtol=1e-5, atol=0)
    for a, b in zip(grads, par.grads.grad_tensors()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert float(par.runner.eval_loss(Batch(batch.inputs[:2], batch.targets[:2], None))) > 0
    tr.close()


def test_plugins_must_be_importable_modules_with_install(monkeypatch):
    from meshlm.train import plugins

    monkeypatch.setenv("MESHLM_PLUGINS", "fault_plugin, json")
    with pytest.raises(RuntimeError, match="^MESHLM_PLUGINS: json has no install"):
        plugins.load()
    monkeypatch.setenv("MESHLM_PLUGINS", "no_such_module_here")
    with pytest.raises(RuntimeError, match="^MESHLM_PLUGINS: cannot import no_such_module_here"):
        plugins.load()
    monkeypatch.setenv("MESHLM_PLUGINS", "fault_plugin")
    assert [m.__name__ for m in plugins.load()] == ["fault_plugin"]


def test_the_product_has_no_test_switches():
    """Fault injection enters from tests/fault_plugin.py through MESHLM_PLUGINS; src/ reads no
    test-only variable."""
    import os

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    found = []
    for root, _, files in os.walk(src):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                text = open(path, encoding="utf-8").read()
                found += [path for word in ("MESHLM_TEST", "TestHooks") if word in text]
    assert found == []
