"""The plain model: shapes, layout-independent init, checkpointing modes, no distributed imports."""
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

from meshlm.model import PRESETS, Llama, ModelArgs, init_tensor, materialize
from meshlm.parallel.features.activation_checkpoint import apply_ac
from meshlm.parallel.model_plans.llama import LLAMA_PLAN

DEBUG = PRESETS["debug"]


def build(args: ModelArgs = DEBUG, seed: int = 0, **kw) -> Llama:
    with torch.device("meta"):
        m = Llama(args)
    materialize(m, seed, "cpu", **kw)
    return m


def test_param_count_matches_formula_and_real_llama_sizes():
    for name in ("debug", "small"):
        args = PRESETS[name]
        with torch.device("meta"):
            m = Llama(args)
        assert sum(p.numel() for p in m.parameters()) == args.num_params()
    assert abs(PRESETS["llama3-8b"].num_params() / 1e9 - 8.03) < 0.01
    assert abs(PRESETS["llama3-70b"].num_params() / 1e9 - 70.55) < 0.01
    assert abs(PRESETS["llama3-405b"].num_params() / 1e9 - 405.85) < 0.01


def test_small_preset_is_5_to_10M():
    assert 5e6 <= PRESETS["small"].num_params() <= 10e6


def test_init_depends_on_seed_and_name_only():
    a, b = build(seed=3), build(seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = build(seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    # Two different parameters of the same shape get different values.
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_materialize_slice_equals_slice_of_full():
    """A rank holding part of a parameter gets exactly that part of the single-process value."""
    name = "layers.1.feed_forward.w1.weight"
    full = build().layers["1"].feed_forward.w1.weight
    with torch.device("meta"):
        m = Llama(DEBUG)
    m.layers["1"].feed_forward.w1.weight = torch.nn.Parameter(torch.empty(DEBUG.ffn_dim // 2, DEBUG.dim, device="meta"))
    materialize(m, 0, "cpu", full_shapes={name: (DEBUG.ffn_dim, DEBUG.dim)},
                slicers={name: lambda t: t[DEBUG.ffn_dim // 2:]})
    assert torch.equal(m.layers["1"].feed_forward.w1.weight, full[DEBUG.ffn_dim // 2:])


def test_tied_embeddings_stay_tied():
    args = ModelArgs(**{**DEBUG.to_dict(), "tie_embeddings": True})
    m = build(args)
    assert m.output.weight is m.tok_embeddings.weight
    assert sum(p.numel() for p in m.parameters()) == args.num_params()


def test_residual_projections_are_scaled():
    w = init_tensor("layers.0.attention.wo.weight", (256, 256), 0, n_layers=8)
    q = init_tensor("layers.0.attention.wq.weight", (256, 256), 0, n_layers=8)
    assert w.std() < q.std() / 3


def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_same_loss_and_grads(mode):
    torch.manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    ref_loss, ref_grads = loss_and_grads(build(), x, y)
    m = build()
    apply_ac(m, mode, LLAMA_PLAN)
    loss, grads = loss_and_grads(m, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    strip = lambda n: n.replace("_wrapped.", "")  # noqa: E731
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[strip(n)], rtol=1e-5, atol=1e-6)


def test_gqa_and_causality():
    args = ModelArgs(**{**DEBUG.to_dict(), "n_kv_heads": 1})
    m = build(args)
    x = torch.randint(0, 256, (1, 12))
    out = m(x)
    x2 = x.clone()
    x2[0, 8:] = (x2[0, 8:] + 1) % 256
    out2 = m(x2)  # changing later tokens never changes earlier logits
    torch.testing.assert_close(out[:, :8], out2[:, :8])
    assert not torch.allclose(out[:, 8:], out2[:, 8:])


def test_model_code_imports_nothing_distributed():
    """docs/architecture.md invariant 5."""
    root = pathlib.Path(__file__).parents[1] / "src" / "meshlm" / "model"
    for f in root.glob("*.py"):
        assert not re.search(r"torch\.distributed|from torch import distributed", f.read_text()), f
