"""DeepSeek-V3 routing in model/moe.py: sigmoid and group-limited selection against transformers'
router, the selection bias (a buffer that selects and never weights), its update rule and the
model-level API the trainer calls, the sequence-wise balance loss, MTP's loss, and the config checks."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from harness import make_config
from meshlm.core.config import ConfigError
from meshlm.model import Llama, materialize
from meshlm.core.model_args import PRESETS
from meshlm.core.config.model import model_args
from meshlm.model.moe import MoE, balanced_moes, expert_loads, update_expert_biases

DSV3 = PRESETS["dsv3-debug"]


def _moe(seed: int = 0, **changes) -> MoE:
    args = dataclasses.replace(DSV3, n_layers=2, mtp_depth=0, **changes)
    model = Llama(args)
    materialize(model, seed, "cpu", torch.float64)
    return model.layers["1"].feed_forward


def test_plain_routing_is_the_mixtral_path_and_holds_no_bias():
    for name in ("moe-debug", "mixtral-8x7b", "deepseek-moe-16b"):
        assert PRESETS[name].plain_routing and not PRESETS[name].expert_bias
    m = Llama(dataclasses.replace(PRESETS["moe-debug"], n_layers=2))
    assert not any("expert_bias" in k for k in m.state_dict())
    assert all(not f.plain for f in (_moe(), _moe(moe_score="softmax", n_group=1, bias_update_rate=0.0,
                                                  norm_topk_prob=False)))


@pytest.mark.parametrize("groups,best,norm,scale", [(4, 2, True, 2.5), (1, 1, True, 1.0), (2, 1, False, 1.5)])
def test_selection_equals_transformers_router(groups, best, norm, scale):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    moe = _moe(n_group=groups, topk_group=best, norm_topk_prob=norm, routed_scaling_factor=scale).float()
    cfg = transformers.DeepseekV3Config(hidden_size=DSV3.dim, n_routed_experts=8, num_experts_per_tok=2,
                                        n_group=groups, topk_group=best, norm_topk_prob=norm,
                                        routed_scaling_factor=scale)
    ref = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        moe.router.weight.mul_(10)
        moe.expert_bias.copy_(0.3 * torch.randn(8, generator=torch.Generator().manual_seed(2)))
        ref.weight.copy_(moe.router.weight)
        ref.e_score_correction_bias.copy_(moe.expert_bias)
    x = torch.randn(64, DSV3.dim)
    _, weights, chosen = moe.select(x)
    _, w_ref, c_ref = ref(x)
    order, order_ref = chosen.sort(-1), c_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(weights.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


def test_groups_are_scored_by_their_two_best_experts():
    """Group 0 holds the single best expert, group 1 the best pair: top-2 sums pick group 1."""
    moe = _moe(n_group=4, topk_group=1)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.9, -5, 0.6, 0.6, -5, -5, -5, -5], dtype=torch.float64))
        moe.router.weight.zero_()
    _, _, chosen = moe.select(torch.zeros(3, DSV3.dim, dtype=torch.float64))
    assert torch.equal(chosen.sort(-1).values, torch.tensor([[2, 3]] * 3))


def test_bias_selects_but_never_weights():
    moe = _moe(n_group=1, topk_group=1)
    x = torch.randn(16, DSV3.dim, dtype=torch.float64)
    scores = (x @ moe.router.weight.t()).sigmoid()
    with torch.no_grad():
        moe.expert_bias[5] = 10.0  # expert 5 is everyone's first choice
    _, weights, chosen = moe.select(x)
    assert (chosen == 5).any(-1).all()
    picked = scores.gather(1, chosen)
    torch.testing.assert_close(weights, (2.5 * picked / picked.sum(-1, keepdim=True)).float())


def test_bias_is_state_not_a_parameter():
    """In the state dict (checkpoints, export), never among the parameters: AdamW's decay and update
    leave it as it is."""
    m = Llama(DSV3)
    names = [n for n, _ in m.named_parameters()]
    state = m.state_dict()
    for key in ("layers.1.feed_forward.expert_bias", "mtp.0.block.feed_forward.expert_bias"):
        assert key in state and key not in names and state[key].dtype == torch.float32
    moe = m.layers["1"].feed_forward
    with torch.no_grad():
        moe.expert_bias.fill_(0.5)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5)
    x = torch.randint(0, 256, (2, 16))
    F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    assert torch.equal(moe.expert_bias, torch.full((8,), 0.5))


def test_bias_update_rule_and_the_trainer_api():
    m = Llama(DSV3)
    materialize(m, 0, "cpu")
    moes = balanced_moes(m)
    assert len(moes) == 4  # three MoE blocks and the MTP module's
    assert torch.equal(expert_loads(moes), torch.zeros(4, 8, dtype=torch.float64))
    x = torch.randint(0, 256, (2, 16))
    m(x).sum().backward()
    loads = expert_loads(moes)
    assert loads.shape == (4, 8) and loads[:3].sum(1).tolist() == [2 * 16 * 2] * 3  # T·k assignments each
    assert loads[3].sum() == 0  # the MTP module ran no forward
    summed = loads * 3  # as if three data-parallel ranks had routed the same counts
    update_expert_biases(moes, summed)
    for moe, load in zip(moes, loads):
        want = 1e-3 * torch.sign(load.mean() - load)
        torch.testing.assert_close(moe.expert_bias, want.float())
    moes[0].bias_update_rate = 0.0
    before = moes[0].expert_bias.clone()
    moes[0].update_bias(loads[0])
    assert torch.equal(moes[0].expert_bias, before)


def test_balancing_evens_out_a_skewed_router():
    """Repeated updates against a bias that starts favouring the last experts bring max/mean load down."""
    moe = _moe(seed=3, n_group=1, topk_group=1)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(0, 0.1, 8))
    x = torch.randn(512, DSV3.dim, dtype=torch.float64)

    def load():
        return torch.bincount(moe.select(x)[2].flatten(), minlength=8).double()
    start = float(load().max() / load().mean())
    for _ in range(300):
        moe.update_bias(load())
    end = float(load().max() / load().mean())
    assert start > 2.0 and end < 1.2


def test_sequence_wise_loss_and_its_gradient():
    """E/(k·S) Σ_e count_e · mean_t(s_e / Σ s) per sequence, averaged; its gradient reaches the router
    as if α·loss had been added to the objective."""
    moe = _moe(seq_aux_loss_coef=0.1)
    x = torch.randn(3, 10, DSV3.dim, dtype=torch.float64)
    probs, _, chosen = moe.select(x.reshape(-1, DSV3.dim))
    s = (x @ moe.router.weight.t()).sigmoid()
    s = s / s.sum(-1, keepdim=True)
    counts = F.one_hot(chosen.view(3, 10, 2), 8).sum((1, 2)).double()
    want = (8 / (2 * 10) * counts * s.mean(1)).sum(-1).mean()
    got = moe._seq_balance(chosen, probs, 3)
    torch.testing.assert_close(got, want.float())
    grads = []
    for coef, explicit in ((0.1, 0.0), (0.0, 0.1), (0.0, 0.0)):
        moe.zero_grad()
        moe.seq_aux_loss_coef = coef
        p, _, c = moe.select(x.reshape(-1, DSV3.dim))
        (moe(x).sum() + explicit * moe._seq_balance(c, p, 3)).backward()
        grads.append(moe.router.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    assert (grads[0] - grads[2]).abs().max() > 1e-6


def test_mtp_loss_is_deepseeks_formula():
    """λ/D Σ_k CE(head(h_k)[:, :S−k], targets[:, k:]), h_k from [enorm(emb(t_{i+k})); hnorm(h_{k−1})]."""
    from meshlm.model.mtp import mtp_loss
    args = dataclasses.replace(DSV3, mtp_depth=2)
    m = Llama(args)
    materialize(m, 0, "cpu", torch.float64)
    x = torch.randint(0, 256, (2, 12))
    y = torch.randint(0, 256, (2, 12))
    m.head_in_loss = True
    h = m(x)
    got = mtp_loss(m, h, y, 0.3)
    cos, sin, _ = m.positional(12, h.device)
    want, prev = 0.0, h
    for k in (1, 2):
        mod = m.mtp[str(k - 1)]
        nxt = torch.cat([y[:, k - 1:], y[:, -1:].expand(-1, k - 1)], 1)
        z = mod.proj(torch.cat([mod.enorm(m.tok_embeddings(nxt)), mod.hnorm(prev)], -1))
        prev = mod.norm(mod.block(z, cos, sin))
        want = want + F.cross_entropy(m.output(prev)[:, :12 - k].flatten(0, 1), y[:, k:].flatten())
    torch.testing.assert_close(got, (0.3 / 2 * want).float())  # the loss is fp32, as the trainer's
    got.backward()
    assert m.mtp["1"].proj.weight.grad.abs().sum() > 0 and m.tok_embeddings.weight.grad.abs().sum() > 0
    assert float(mtp_loss(m, h, y, 0.0)) == 0.0
    # position i of depth k sees nothing past token i + k
    y2 = y.clone()
    y2[:, 8:] = (y2[:, 8:] + 1) % 256
    with torch.no_grad():
        a = m.mtp["0"](h, m.tok_embeddings(y), cos, sin)
        b = m.mtp["0"](h, m.tok_embeddings(y2), cos, sin)
    # exact in arithmetic, equal up to float64 rounding in kernels whose blocking spans the sequence (two
    # different calls; see tests/test_mla.py); a leak moves them by what the later positions moved
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-12, atol=1e-12)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-2


@pytest.mark.parametrize("overrides,key", [
    ({"model__moe__score": "relu"}, "model.moe.score"),
    ({"model__moe__topk_group": 5}, "model.moe.topk_group"),
    ({"model__moe__n_group": 3}, "model.moe.n_group"),
    ({"model__moe__top_k": 5, "model__moe__topk_group": 2}, "model.moe.top_k"),
    ({"model__moe__bias_update_rate": -1.0}, "model.moe.bias_update_rate"),
    ({"model__moe__seq_aux_loss_coef": -1.0}, "model.moe.seq_aux_loss_coef"),
    ({"model__moe__routed_scaling_factor": 0.0}, "model.moe.routed_scaling_factor"),
    ({"model__preset": "debug", "model__moe__score": "sigmoid"}, "model.moe.score"),
])
def test_bad_routing_input_names_the_key(overrides, key):
    cfg = make_config(**{"model__preset": "dsv3-debug", **overrides})
    with pytest.raises(ConfigError) as e:
        model_args(cfg)
    assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)


def test_routing_keys_override_the_preset():
    a = model_args(make_config(model__preset="dsv3-debug", model__moe__score="softmax", model__moe__n_group=2,
                               model__moe__topk_group=1, model__moe__norm_topk_prob=False,
                               model__moe__bias_update_rate=0.0, model__mtp_depth=0))
    assert (a.moe_score, a.n_group, a.topk_group, a.norm_topk_prob, a.bias_update_rate, a.mtp_depth) == \
        ("softmax", 2, 1, False, 0.0, 0)
    assert not a.plain_routing and not a.expert_bias  # groups and no renormalisation: DeepSeek's path
