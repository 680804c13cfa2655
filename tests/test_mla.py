"""Multi-head latent attention (model/mla.py), YaRN (model/layers.py), the latent KV cache and the
DeepSeek presets' shapes: each against an independent reference (transformers' RoPE functions, the
expanded attention, the published parameter counts)."""
import dataclasses
import math

import pytest
import torch

from harness import make_config
from meshlm.core.config import ConfigError
from meshlm.generate import generate
from meshlm.model import Llama, materialize
from meshlm.core.model_args import PRESETS
from meshlm.core.config.model import model_args
from meshlm.model.kv_cache import KVCache, LatentKV
from meshlm.model.mla import MLA

DSV3 = PRESETS["dsv3-debug"]
YARN = dict(rope_type="yarn", rope_factor=4.0, rope_original_max_seq_len=32, rope_mscale=1.0,
            rope_mscale_all_dim=0.707)


def build(args=DSV3, seed: int = 0, scale: float = 4.0) -> Llama:
    """A model with larger weights than the init: attention far from uniform, routing far from ties."""
    with torch.device("meta"):
        m = Llama(args)
    materialize(m, seed, "cpu")
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return m.eval()


def tokens(n: int = 32, b: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (b, n), generator=torch.Generator().manual_seed(seed))


def test_mla_shapes_and_parameter_count():
    for args in (DSV3, dataclasses.replace(DSV3, q_lora_rank=0, mtp_depth=2, tie_embeddings=True)):
        with torch.device("meta"):
            m = Llama(args)
        attn = m.layers["0"].attention
        assert isinstance(attn, MLA) and (attn.wq is None) == bool(args.q_lora_rank)
        assert attn.wkv_a.weight.shape == (args.kv_lora_rank + args.qk_rope_head_dim, args.dim)
        assert attn.wkv_b.weight.shape == (args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank)
        assert attn.wo.weight.shape == (args.dim, args.n_heads * args.v_head_dim)
        assert sum(p.numel() for p in m.parameters()) == args.num_params()
        assert len(m.mtp) == args.mtp_depth
    assert DSV3.mtp_depth == 1 and not DSV3.is_moe_block(0) and DSV3.is_moe_block(1)


PUBLISHED = {  # total and active parameters (B) as published, and how many vocab × dim matrices the active
    # count leaves out: DeepSeek-V2-Lite's 2.4B the embedding, Moonlight's 2.24B the embedding and head
    "deepseek-v2-lite": (15.7, 2.4, 1), "moonlight-16b-a3b": (16.0, 2.24, 2)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_deepseek_presets_have_published_sizes(name):
    a = PRESETS[name]
    total, active, vocab = PUBLISHED[name]
    assert abs(a.num_params() / 1e9 - total) < 0.05
    assert abs((a.active_params() - vocab * a.vocab_size * a.dim) / 1e9 - active) < 0.06


def test_deepseek_v3_preset_is_671b_plus_its_mtp_module():
    a = PRESETS["deepseek-v3"]
    main = a.num_params() - a.mtp_params(a.num_experts)
    assert abs(main / 1e9 - 671.0) < 0.1 and a.mtp_depth == 1
    assert 11e9 < a.mtp_params(a.num_experts) < 12e9  # one MoE block + projection (HF's 14B adds copies)
    assert abs(a.active_params() / 1e9 - 38.2) < 0.1  # 37B published (main model, plus MTP's block)
    assert (a.n_moe_blocks, a.num_experts, a.top_k, a.n_group, a.topk_group) == (58, 256, 8, 8, 4)
    assert a.pretrain_seq_len == 4096 and a.max_seq_len == 163840


def _hf_yarn(args, **extra):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = dict(rope_type="yarn", rope_theta=args.rope_theta, factor=args.rope_factor,
                original_max_position_embeddings=args.rope_original_max_seq_len, beta_fast=args.rope_beta_fast,
                beta_slow=args.rope_beta_slow, **extra)
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=args.qk_rope_head_dim,
                           max_position_embeddings=args.max_seq_len, rope_parameters=rope)
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


@pytest.mark.parametrize("mscale", [{}, {"mscale": 1.0, "mscale_all_dim": 1.0},
                                    {"mscale": 0.8, "mscale_all_dim": 0.707}])
def test_yarn_frequencies_and_factor_equal_transformers(mscale):
    pytest.importorskip("transformers")
    from meshlm.model.layers import rope_attention_factor, rope_frequencies
    for base in (PRESETS["deepseek-v3"], dataclasses.replace(DSV3, **YARN)):
        args = dataclasses.replace(base, rope_mscale=mscale.get("mscale", 0.0),
                                   rope_mscale_all_dim=mscale.get("mscale_all_dim", 0.0))
        theirs, factor = _hf_yarn(args, **mscale)
        ours = rope_frequencies(args)
        assert ours.shape == theirs.shape == (args.qk_rope_head_dim // 2,)
        assert float(((ours - theirs.double()) / ours).abs().max()) < 1e-6
        assert rope_attention_factor(args) == pytest.approx(factor, rel=1e-12)
        plain = rope_frequencies(dataclasses.replace(args, rope_type="default"))
        assert ours[0] == plain[0] and ours[-1] == pytest.approx(plain[-1] / args.rope_factor)  # kept, interpolated


def test_heads_come_from_the_weight_shapes():
    """A copy holding half of the heads (wq_b / wkv_b rows, wo columns, as tensor parallelism slices them)
    computes those heads' share: the two halves sum to the whole attention."""
    m = build()
    attn = m.layers["1"].attention
    cos, sin = (t[:12] for t in m.rope(12, torch.device("cpu")))
    x = torch.randn(2, 12, DSV3.dim)
    full = attn(x, cos, sin)
    qk, kv = DSV3.qk_head_dim, DSV3.qk_nope_head_dim + DSV3.v_head_dim
    halves = []
    for h in (slice(0, 2), slice(2, 4)):
        part = dataclasses.replace(DSV3, n_heads=2)
        half = MLA(part)
        sd = dict(attn.state_dict())
        sd["wq_b.weight"] = attn.wq_b.weight.view(4, qk, -1)[h].flatten(0, 1)
        sd["wkv_b.weight"] = attn.wkv_b.weight.view(4, kv, -1)[h].flatten(0, 1)
        sd["wo.weight"] = attn.wo.weight.view(DSV3.dim, 4, -1)[:, h].flatten(1)
        half.load_state_dict(sd)
        halves.append(half(x, cos, sin))
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-5)


def test_mla_is_causal_and_keeps_documents_apart():
    m = build()
    x = tokens(24)
    y = x.clone()
    y[:, 16:] = (y[:, 16:] + 7) % 256
    with torch.no_grad():
        a, b = m(x), m(y)
        # Causality makes the first 16 outputs independent of the later tokens in exact arithmetic, but
        # not bitwise: the two calls are different computations whose kernels (SDPA's key blocks, BLAS
        # blocking over all 24 rows) may round in another order. The bound is fp32 rounding over these
        # reductions (8.3e-7 measured on an AMD EPYC); a leak moves them by what the later outputs moved.
        torch.testing.assert_close(a[:, :16], b[:, :16], rtol=1e-5, atol=1e-5)
        assert (a[:, 16:] - b[:, 16:]).abs().max() > 1e-2
        docs = (torch.arange(24) >= 10).long().expand(2, -1)
        sep = m(x, docs=docs)
        alone = m(x[:, 10:])  # document 2 alone: positions restart, RoPE is relative
        torch.testing.assert_close(sep[:, 10:], alone, rtol=1e-4, atol=1e-4)
        flex = Llama(dataclasses.replace(DSV3, attn_kernel="flex"))
        flex.load_state_dict(m.state_dict())
        torch.testing.assert_close(flex.eval()(x, docs=docs), sep, rtol=1e-5, atol=1e-5)


def test_yarn_mscale_enters_the_softmax():
    """mscale_all_dim scales MLA's scores by mscale² (the expanded path), and the latent path agrees."""
    args = dataclasses.replace(DSV3, **YARN)
    m = build(args)
    x = tokens(20)
    assert m.layers["0"].attention.q_scale == pytest.approx((0.1 * 0.707 * math.log(4.0) + 1) ** 2)
    with torch.no_grad():
        scaled = m(x)
        m2 = Llama(dataclasses.replace(args, rope_mscale_all_dim=0.0))
        m2.load_state_dict(m.state_dict())
        assert (m2.eval()(x) - scaled).abs().max() > 1e-3


@pytest.mark.parametrize("extra", [{}, YARN, {"q_lora_rank": 0}])
def test_latent_cache_equals_the_full_forward(extra):
    """The cache holds the latent and the RoPE key only, and its absorbed attention gives the expanded
    attention's logits; greedy generation with and without it agrees."""
    args = dataclasses.replace(DSV3, **extra)
    m = build(args)
    x = tokens(40, b=1)
    cache = KVCache(args, 1, 48, "cpu")
    layer = cache.layers["0"]
    assert isinstance(layer, LatentKV) and layer.latent.shape == (1, 48, args.kv_lora_rank)
    assert layer.k_rope.shape == (1, 48, args.qk_rope_head_dim)
    with torch.no_grad():
        full = m(x)
        parts = [m(x[:, :30], cache=cache), m(x[:, 30:35], cache=cache)]
        parts += [m(x[:, i:i + 1], cache=cache) for i in range(35, 40)]
    rel = (torch.cat(parts, 1) - full).abs().max() / full.abs().max()
    assert rel < 1e-5
    prompt = x[0, :8].tolist()
    assert generate(m, prompt, 16) == generate(m, prompt, 16, use_cache=False)


@pytest.mark.parametrize("overrides,key", [
    ({"model__q_lora_rank": 16}, "model.q_lora_rank"),
    ({"model__preset": "dsv3-debug", "model__qk_rope_head_dim": 7}, "model.qk_rope_head_dim"),
    ({"model__preset": "dsv3-debug", "model__v_head_dim": 0}, "model.v_head_dim"),
    ({"model__preset": "dsv3-debug", "model__mtp_depth": -1}, "model.mtp_depth"),
    ({"model__rope_scaling__type": "yarn", "model__rope_scaling__beta_fast": 0}, "model.rope_scaling.beta_fast"),
    ({"model__rope_scaling__type": "ntk"}, "model.rope_scaling.type"),
    ({"training__mtp_loss_weight": -0.1}, "training.mtp_loss_weight"),
])
def test_bad_mla_input_names_the_key(overrides, key):
    cfg = make_config(**overrides)
    with pytest.raises(ConfigError) as e:
        cfg.check()
        model_args(cfg)
    assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)


def test_mla_keys_override_the_preset():
    a = model_args(make_config(model__preset="dsv3-debug", model__q_lora_rank=0, model__rope_scaling__type="yarn",
                               model__rope_scaling__factor=2.0, model__rope_scaling__mscale_all_dim=1.0))
    assert (a.q_lora_rank, a.rope_type, a.rope_factor, a.rope_mscale_all_dim) == (0, "yarn", 2.0, 1.0)
    assert a.kv_lora_rank == 32  # the preset's
