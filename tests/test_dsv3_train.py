"""Issue #49, training side: DeepSeek-V3-class models train in one process (the MTP term in the gradient,
auxiliary-loss-free balancing after every step, the bias in checkpoints) and in the layouts
(tests/test_dsv3_layouts.py)."""
import dataclasses
import os
import tempfile

import pytest
import torch

from harness import make_config, read_metrics, run_local
from meshlm.model.args import PRESETS

DSV3 = {"model__preset": "dsv3-debug", "training__steps": 3}


def test_mtp_loss_in_training_is_the_models_formula():
    """features/mtp.MTPLoss in one process: its value is the main loss exactly, its gradient that of
    main + w·model/mtp.mtp_loss (the formula the model side tests against DeepSeek's)."""
    from meshlm.model import Llama, materialize
    from meshlm.model.mtp import mtp_loss
    from meshlm.parallel.compose import cross_entropy
    from meshlm.parallel.features.mtp import MTPLoss

    torch.manual_seed(0)
    args = dataclasses.replace(PRESETS["dsv3-debug"], n_layers=2, mtp_depth=2)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    grads = []
    for use_feature in (True, False):
        m = Llama(args)
        materialize(m, 1, "cpu")
        ce = lambda out, t: cross_entropy(out, t, args.vocab_size)  # noqa: E731
        if use_feature:
            fn = MTPLoss(m, ce, 0.3, None)
            loss = fn(m(x), y)
            main = ce(m(x), y)  # a forward without grad would not run the MTP term: value check only
            assert loss.item() == main.item()
            assert fn.total is not None and fn.total.item() > 0
        else:
            m.head_in_loss = True
            h = m(x)
            loss = ce(m.output(h), y) + mtp_loss(m, h, y, 0.3)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(n.startswith("mtp.1.") for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)


def _bias(run_dir: str, step: int) -> dict[str, torch.Tensor]:
    from meshlm.train.convert import load_model
    model, *_ = load_model(os.path.join(run_dir, "checkpoints", f"step_{step:08d}"))
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}


def test_one_process_trains_with_mtp_balancing_and_a_checkpointed_bias():
    """dsv3-debug in one process: metrics carry `mtp_loss` beside the main `loss`; the bias of every MoE
    block, the MTP block's too, moves by γ per step and is in the checkpoint (`master/...expert_bias`);
    a resume from it continues with the same losses."""
    d = tempfile.mkdtemp(prefix="meshlm-dsv3-")
    full = run_local(make_config(**DSV3, checkpoint__every=2), d)
    assert all("mtp_loss" in r and r["mtp_loss"] > 0 for r in full)
    bias = _bias(d, 2)
    assert set(bias) == {"layers.1.feed_forward.expert_bias", "layers.2.feed_forward.expert_bias",
                         "layers.3.feed_forward.expert_bias", "mtp.0.block.feed_forward.expert_bias"}
    for b in bias.values():  # two updates of ±γ (or 0) each: in {0, ±γ, ±2γ} and not all zero
        assert (b.abs() <= 2e-3 + 1e-9).all() and b.abs().sum() > 0
    again = run_local(make_config(**DSV3, checkpoint__resume=os.path.join(d, "checkpoints", "step_00000002")),
                      tempfile.mkdtemp(prefix="meshlm-dsv3-resume-"))
    assert [r["step"] for r in again] == [3]
    assert again[0]["loss"] == full[2]["loss"] and again[0]["mtp_loss"] == full[2]["mtp_loss"]
    assert again[0]["moe"] == full[2]["moe"]


def test_no_balancing_leaves_the_bias_at_zero():
    d = tempfile.mkdtemp(prefix="meshlm-dsv3-")
    run_local(make_config(**{**DSV3, "training__steps": 1}, checkpoint__every=1, model__moe__bias_update_rate=0.0), d)
    assert all(float(b.abs().sum()) == 0.0 for b in _bias(d, 1).values())
