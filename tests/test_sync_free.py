"""No host syncs inside a training step (the speed issue): fp16 dynamic loss scaling keeps the scale,
the overflow flag and the skip on the device. On the CPU the "device" is the host, so a read is
caught by making every Python-level read of a tensor's value raise while `train_step` runs (on a GPU,
`bench/gpu.py --sync-check` runs the steps under torch's own CUDA sync checker). Also:
a forced overflow skips the step exactly (masters, moments, step count), the scale halves with a
floor of 1 and doubles after `growth_interval` clean steps."""
import json
import tempfile

import pytest
import torch
from harness import make_config

# Python-level ways to get a tensor's value onto the host (on CUDA each one waits for the stream).
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__complex__")


def _trainer(device: str = "cpu", **overrides):
    from meshlm.distributed.mesh import init_context, pick_device
    from harness import build_layout
    from meshlm.train.trainer import Trainer

    cfg = make_config(**overrides)
    layout = build_layout(cfg, 1)
    return Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-sync-"), init_context(layout.shape(), pick_device(device)),
                   layout)


class HostRead(AssertionError):
    pass


def _forbid_host_reads(monkeypatch, tr) -> None:
    """Every Python-level read of a tensor's value raises, except inside the data sampler, which
    builds the batch on the host by design (its tensors are host data, never the device's)."""
    armed = [True]
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def trap(self, *args, _name=name, _original=original, **kwargs):
            if armed[0]:
                raise HostRead(f"train_step read a tensor on the host: Tensor.{_name}")
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, trap)
    next_batch = tr.state.sampler.next_batch

    def host_data(*args, **kwargs):
        armed[0] = False
        try:
            return next_batch(*args, **kwargs)
        finally:
            armed[0] = True
    monkeypatch.setattr(tr.state.sampler, "next_batch", host_data)


LAYOUTS = {
    "fp16": {"training__precision": "fp16"},
    "bf16": {"training__precision": "bf16"},
    "fp32": {"training__precision": "fp32"},
    "fp16-zero2": {"training__precision": "fp16", "parallel__zero": 2},
    "fp16-zero1-offload": {"training__precision": "fp16", "parallel__zero": 1, "parallel__offload": "optimizer"},
}


@pytest.mark.parametrize("name", [n if n in ("fp16", "bf16", "fp32") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_train_step_reads_nothing_on_the_host(monkeypatch, name):
    tr = _trainer(**LAYOUTS[name])
    with monkeypatch.context() as m:
        _forbid_host_reads(m, tr)
        with pytest.raises(HostRead):  # the trap works (not vacuous)
            bool(torch.ones(()))
        for _ in range(2):
            out = tr.train_step(measure=False)
        if tr.state.scaler.enabled:  # an overflowing step, skipped on the device, reads nothing either
            tr.state.scaler.scale = 2.0 ** 40
            skipped = tr.train_step(measure=False)["skipped"]
    assert torch.isfinite(out["norm"]) and float(out["loss_sum"]) > 0
    assert not bool(out["skipped"])
    if tr.state.scaler.enabled:
        assert bool(skipped) and float(tr.state.scaler.scale) == 2.0 ** 39


def test_disabled_scaler_does_nothing(monkeypatch):
    """bf16/fp32: the scale stays exactly 1 and neither unscaling nor the scale update runs."""
    from meshlm.train.optim import LossScaler

    tr = _trainer(training__precision="bf16")
    monkeypatch.setattr(LossScaler, "inv_scale", lambda self: pytest.fail("unscaled with scaling off"))
    monkeypatch.setattr(torch, "_amp_update_scale_", lambda *a: pytest.fail("scale update with scaling off"))
    out = tr.train_step(measure=False)
    assert out["skipped"] is False
    assert float(tr.state.scaler.scale) == 1.0 and tr.state.scaler.state_dict() == {"scale": 1.0, "good_steps": 0}


def _snapshot(tr) -> dict:
    opt = tr.par.optimizer
    snap = {f"{kind}/{name}": t.detach().clone() for name, kind, t in opt.state_storage()}
    snap.update({f"param/{i}": p.detach().clone() for i, p in enumerate(opt.param_tensors())})
    return snap


@pytest.mark.parametrize("name", ["fp16", pytest.param("fp16-zero2", marks=pytest.mark.slow),
                                  pytest.param("fp16-zero1-offload", marks=pytest.mark.slow)])
def test_overflow_skips_the_step_exactly(name):
    tr = _trainer(**LAYOUTS[name])
    tr.state.scaler.scale = 1024.0
    assert not bool(tr.train_step(measure=False)["skipped"])  # moments and step count are non-zero now
    tr.state.scaler.growth_interval = 3
    assert not bool(tr.train_step(measure=False)["skipped"])
    assert tr.state.scaler.state_dict() == {"scale": 1024.0, "good_steps": 2}
    before, count = _snapshot(tr), tr.par.optimizer.step_count()
    assert count == 2
    tr.state.scaler.scale = 2.0 ** 40  # fp16 overflows at 65504: the scaled gradients become inf
    out = tr.train_step(measure=False)
    assert bool(out["skipped"]) and not torch.isfinite(out["norm"])
    assert tr.state.scaler.state_dict() == {"scale": 2.0 ** 39, "good_steps": 0}  # halved, clean run restarts
    after = _snapshot(tr)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed[:5]  # masters, moments, parameters bit for bit
    assert tr.par.optimizer.step_count() == count
    tr.state.scaler.scale = 1024.0
    assert not bool(tr.train_step(measure=False)["skipped"])
    assert tr.par.optimizer.step_count() == count + 1
    assert not torch.equal(before["param/0"], _snapshot(tr)["param/0"])


@pytest.mark.slow
def test_clean_run_doubles_after_growth_interval():
    tr = _trainer(training__precision="fp16")
    tr.state.scaler.scale, tr.state.scaler.growth_interval = 256.0, 3
    scales = []
    for _ in range(7):
        assert not bool(tr.train_step(measure=False)["skipped"])
        scales.append(float(tr.state.scaler.scale))
    assert scales == [256.0, 256.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    assert tr.state.scaler.state_dict() == {"scale": 1024.0, "good_steps": 1}


def test_loss_scaler_on_device_semantics():
    """Halve on inf/nan (floor 1), double after growth_interval clean steps; JSON state round-trips."""
    from meshlm.train.optim import LossScaler

    s = LossScaler(True, init_scale=4.0, growth_interval=2)
    assert s.scale.dtype == torch.float32 and s.scale.dim() == 0
    inf, ok = torch.ones(()), torch.zeros(())
    seen = []
    for flag in (inf, inf, inf, ok, ok, ok, inf, ok):
        s.update(flag)
        seen.append((float(s.scale), s.state_dict()["good_steps"]))
    assert seen == [(2.0, 0), (1.0, 0), (1.0, 0), (1.0, 1), (2.0, 0), (2.0, 1), (1.0, 0), (1.0, 1)]
    d = json.loads(json.dumps(s.state_dict()))
    assert d == {"scale": 1.0, "good_steps": 1} and type(d["scale"]) is float and type(d["good_steps"]) is int
    t = LossScaler(True, growth_interval=2)
    t.load_state_dict({"scale": 8.0, "good_steps": 1})
    t.update(ok)
    assert t.state_dict() == {"scale": 16.0, "good_steps": 0}
    off = LossScaler(False)
    off.update(inf)
    assert off.state_dict() == {"scale": 1.0, "good_steps": 0}


def test_one_process_and_zero_pick_the_same_adamw():
    """The equivalence tests compare ZeRO with one process at fp32 tolerance: same implementation."""
    from meshlm.parallel.optim.adamw import fused_adamw_supported

    one, zero = _trainer(), _trainer(parallel__zero=1)
    assert one.par.optimizer.fused == zero.par.optimizer.fused == fused_adamw_supported("cpu")
    assert one.par.optimizer.opt.defaults["fused"] == zero.par.optimizer.opt.defaults["fused"]


# ---------------------------------------------------------------- the same on several ranks

def trapped_steps(cfg_dict: dict, steps: int, overflow_at: int) -> list[tuple[float, bool]]:
    """Runs on every pool rank (or here, one process): `steps` train_steps with every host read of a
    tensor trapped, an overflowing scale forced at step `overflow_at` (the default again after it);
    then (untrapped) the global losses and skip flags."""
    import os

    from meshlm.core import config as C
    from meshlm.distributed.mesh import init_context, pick_device
    from harness import build_layout
    from meshlm.train.trainer import Trainer

    cfg = C.from_dict(cfg_dict)
    layout = build_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-sync-"), init_context(layout.shape(), pick_device("cpu"),
                                                                             timeout_s=120), layout)
    mp = pytest.MonkeyPatch()
    outs = []
    try:
        _forbid_host_reads(mp, tr)
        for i in range(steps):
            if i == overflow_at:
                tr.state.scaler.scale = 2.0 ** 40
            elif i == overflow_at + 1:
                tr.state.scaler.scale = 2.0 ** 16
            outs.append(tr.train_step(measure=False))
    finally:
        mp.undo()
    return [(tr.meter.global_loss(o["loss_sum"]), bool(o["skipped"])) for o in outs]


@pytest.mark.isa  # fp16 losses against one process's: `make test-isa` runs them under every CPU kernel family
@pytest.mark.parametrize("overrides", [
    {"parallel__pp": 2},
    {"parallel__pp": 2, "parallel__pp_schedule": "zb-h1"},
    {"parallel__dp": 2, "parallel__zero": 3},
    {"parallel__tp": 2, "parallel__sp": True},
], ids=["pp2-1f1b", "pp2-zb-h1", "dp2-zero3", "tp2-sp"])
def test_fp16_ranks_read_nothing_and_match_one_process(pools, overrides):
    """The pipeline schedule takes the scale as a device tensor; a skipped step is skipped on every
    rank with no host read anywhere; losses match one process (fp16 tolerance)."""
    from meshlm.core import config as C

    base = {"training__precision": "fp16", "training__micro_batch": 2}
    ref = trapped_steps(C.to_dict(make_config(**base)), 5, 2)
    got = pools(2).run(trapped_steps, C.to_dict(make_config(**base, **overrides)), 5, 2)
    assert [s for _, s in ref] == [False, False, True, False, False]
    for rank_out in got:
        assert [s for _, s in rank_out] == [s for _, s in ref]
        for (a, _), (b, _) in zip(ref, rank_out):
            assert abs(a - b) <= 1e-3 * abs(a), (a, b)
