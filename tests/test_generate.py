"""`meshlm generate` on a trained mixture-of-experts checkpoint: the weights load by the model's own
parameter names (stacked experts, router, shared experts), the KV cache gives the logits of a full
recompute, and greedy tokens with the cache equal greedy tokens without it. The run trains with a
capacity limit, so the test also covers generation's dropless routing."""
import pytest
import torch

from harness import make_config, run_local
from meshlm.cli import main


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("moe") / "run")
    cfg = make_config(model__preset="moe-debug", training__steps=3, checkpoint__every=3,
                      model__moe__capacity_factor=1.0, optim__lr=1e-2)
    run_local(cfg, run)
    return run


def test_moe_checkpoint_loads_every_expert(moe_run):
    from meshlm.convert import load_model
    from meshlm.model.moe import MoE
    model = load_model(moe_run)[0]
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == model.args.n_layers and moes[0].capacity_factor == 1.0
    w = moes[0].experts.w1
    assert w.shape[0] == 8 and not w.is_meta and float((w[0] - w[1]).detach().abs().max()) > 0


def test_moe_kv_cache_equals_full_recompute(moe_run):
    from meshlm.convert import load_model
    from meshlm.generate import dropless
    from meshlm.model.kv_cache import KVCache
    model = load_model(moe_run)[0]
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = KVCache(model.args, 1, 20, "cpu")
    with torch.no_grad(), dropless(model):
        full = model(x)
        parts = [model(x[:, :7], cache=cache)] + [model(x[:, i:i + 1], cache=cache) for i in range(7, 20)]
    got = torch.cat(parts, dim=1)
    assert float((got - full).abs().max() / full.abs().max()) <= 1e-5
    assert model.layers["0"].feed_forward.capacity_factor == 1.0  # restored after generation


def test_moe_greedy_with_cache_equals_without(moe_run):
    from meshlm.convert import load_model
    from meshlm.generate import generate
    model = load_model(moe_run)[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # 3 steps leave a model that repeats " ": seeded noise makes the tokens vary
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    prompt = [100, 101, 102, 32, 40, 10, 35]
    cached = generate(model, prompt, 24, temperature=0.0)
    recomputed = generate(model, prompt, 24, temperature=0.0, use_cache=False)
    assert cached == recomputed and len(cached) == 24
    assert len(set(cached)) > 1


def test_generate_cli_on_moe_run(moe_run, capsys):
    assert main(["generate", moe_run, "--prompt", "def f(", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) > 1  # a continuation (the trained model favours spaces)
