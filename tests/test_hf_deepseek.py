"""Hugging Face DeepSeek-V2 / V3 in and out (core/hf_deepseek.py, hf_config.py, hf.py): tiny random
DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (with and without q LoRA, group-limited routing, dense
first blocks, YaRN, a random e_score_correction_bias) give transformers' fp32 logits after
`convert --from-hf`; export and import round trip bit-exact, the bias and an MTP layer included; the
MTP module equals transformers' MtpLayer; unsupported config keys are one line naming the key."""
import json
import os
import shutil

import pytest
import torch

from meshlm.cli import main

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject [dev])

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
              max_position_embeddings=128)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=0.8, mscale_all_dim=0.707)
KINDS = {  # V3: q LoRA, 4 groups of 2 with the best 2, YaRN; V3 without q LoRA; V2 with and without q LoRA
    "v3": ("v3", dict(q_lora_rank=32, n_shared_experts=1, n_group=4, topk_group=2, rope_parameters=YARN)),
    "v3-noq": ("v3", dict(q_lora_rank=None, n_shared_experts=2, n_group=2, topk_group=1,
                          rope_parameters=dict(rope_type="default", rope_theta=50000.0))),
    "v2": ("v2", dict(q_lora_rank=32, n_shared_experts=2, rope_parameters=YARN)),
    "v2-noq": ("v2", dict(q_lora_rank=None, n_shared_experts=1, routed_scaling_factor=1.5)),
}


def make_hf(path, kind: str, seed: int = 0):
    version, extra = KINDS[kind]
    torch.manual_seed(seed)
    if version == "v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**COMMON, **extra))
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**COMMON, **extra))
    with torch.no_grad():  # larger weights than the init: logits far apart; gains, bias not 1 / 0
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.add_(0.5 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.eval().save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_deepseek")
    return {k: (str(root / k), make_hf(root / k, k)) for k in KINDS}


def tokens(n: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


def safetensors_of(d: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_from_hf_gives_transformers_logits(hf_models, tmp_path, kind):
    """Within 1e-4 of transformers in fp32 (measured: about 2e-6 of logits of size 3)."""
    from meshlm.train.convert import load_model
    hf_dir, hf = hf_models[kind]
    assert main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")]) == 0
    model = load_model(str(tmp_path / "ck"))[0]
    a = model.args
    version, extra = KINDS[kind]
    assert a.mla and a.q_lora_rank == (extra["q_lora_rank"] or 0) and a.moe_first_dense == 1 and a.mtp_depth == 0
    assert (a.moe_score, a.n_group) == (("sigmoid", extra["n_group"]) if version == "v3" else ("softmax", 1))
    x = tokens()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
        assert float((ours - theirs).abs().max()) <= 1e-4 and float(theirs.abs().max()) > 1
        if version == "v3":  # the bias decides which experts run
            for moe in (model.layers["1"].feed_forward, model.layers["2"].feed_forward):
                moe.expert_bias.zero_()
            assert float((model(x) - theirs).abs().max()) > 1e-2


@pytest.mark.parametrize("kind", ["v3", "v2-noq"])
def test_round_trip_is_bit_exact(hf_models, tmp_path, kind):
    hf_dir, _ = hf_models[kind]
    assert main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back"), "--dtype", "fp32"]) == 0
    theirs, back = safetensors_of(hf_dir), safetensors_of(str(tmp_path / "back"))
    assert set(theirs) == set(back)
    assert any(k.endswith("e_score_correction_bias") for k in back) == (kind == "v3")
    for k, t in theirs.items():
        assert torch.equal(back[k], t), k
    loaded = type(hf_models[kind][1]).from_pretrained(str(tmp_path / "back")).eval()
    x = tokens(16)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, hf_models[kind][1](x).logits)


def _mtp_layer(hf):
    """transformers' MtpLayer for `hf` (layer n_layers, a MoE block), with random weights."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    cfg = hf.config
    cfg._attn_implementation = "sdpa"  # causal without a mask
    torch.manual_seed(5)
    layer = MtpLayer(cfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, cfg.num_hidden_layers)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.copy_(1 + 0.5 * torch.randn_like(p))
        layer.mtp_block.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return layer.eval()


def _mtp_tensors(hf, layer) -> dict[str, torch.Tensor]:
    """The MtpLayer's weights as DeepSeek-V3's checkpoints hold them: layer n_layers, experts one by one,
    the shared embedding and head copied in."""
    n, inter = hf.config.num_hidden_layers, hf.config.moe_intermediate_size
    pre = f"model.layers.{n}."
    out = {pre + "enorm.weight": layer.enorm.weight, pre + "hnorm.weight": layer.hnorm.weight,
           pre + "eh_proj.weight": layer.eh_proj.weight, pre + "shared_head.norm.weight": layer.post_norm.weight,
           pre + "shared_head.head.weight": hf.lm_head.weight,
           pre + "embed_tokens.weight": hf.model.embed_tokens.weight}
    for k, v in layer.mtp_block.state_dict().items():
        if k == "mlp.experts.gate_up_proj":
            for j, w in enumerate(v):
                out[f"{pre}mlp.experts.{j}.gate_proj.weight"] = w[:inter]
                out[f"{pre}mlp.experts.{j}.up_proj.weight"] = w[inter:]
        elif k == "mlp.experts.down_proj":
            out.update({f"{pre}mlp.experts.{j}.down_proj.weight": w for j, w in enumerate(v)})
        else:
            out[pre + k] = v
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def test_mtp_layer_imports_equals_transformers_and_round_trips(hf_models, tmp_path):
    from safetensors.torch import save_file

    from meshlm.train.convert import load_model
    hf_dir, hf = hf_models["v3"]
    src = tmp_path / "with_mtp"
    shutil.copytree(hf_dir, src)
    layer = _mtp_layer(hf)
    save_file(_mtp_tensors(hf, layer), str(src / "mtp.safetensors"), metadata={"format": "pt"})
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "ck")]) == 0
    model = load_model(str(tmp_path / "ck"))[0]
    assert model.args.mtp_depth == 1
    x = tokens(24)
    with torch.no_grad():
        h = hf.model(x).last_hidden_state  # the final norm's output
        emb = hf.model.embed_tokens(x)
        pos = torch.arange(24)[None]
        theirs = layer(emb, h, hf.model.rotary_emb(h, pos), None, pos, None)
        cos, sin, _ = model.positional(24, h.device)
        ours = model.mtp["0"](h, emb, cos, sin)
    assert float((ours - theirs).abs().max()) <= 1e-4 and float(theirs.abs().max()) > 0.5
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back"), "--dtype", "fp32"]) == 0
    want, back = safetensors_of(str(src)), safetensors_of(str(tmp_path / "back"))
    assert set(want) == set(back)
    for k, t in want.items():
        assert torch.equal(back[k], t), k
    with open(tmp_path / "back" / "config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1


def _save_checkpoint(model, path: str) -> None:
    """A weights-only meshlm checkpoint of `model` (what `convert --from-hf` writes)."""
    from meshlm.core import config as C
    from meshlm.core.config.model import set_model_shape
    from meshlm.core.hf_config import param_shapes
    from meshlm.train.checkpoint import save_streaming
    state = model.state_dict()
    save_streaming(path, {f"master/{n}": s for n, s in param_shapes(model.args).items()},
                   lambda key: state[key.split("/", 1)[1]].detach().float().clone())
    cfg = C.Config()
    set_model_shape(cfg, model.args)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": 0, "weights_only": True, "config": C.to_dict(cfg)}, f)


def test_dsv3_debug_exports_to_transformers_and_back(tmp_path):
    """meshlm's own weights (MTP module, a trained-looking bias) → DeepseekV3ForCausalLM with meshlm's
    logits → back to meshlm, every tensor and buffer bit-exact."""
    from meshlm.model import Llama, materialize
    from meshlm.core.model_args import PRESETS
    from meshlm.train.convert import load_model
    with torch.device("meta"):
        model = Llama(PRESETS["dsv3-debug"])
    materialize(model, 3, "cpu")
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(0.05 * torch.randn_like(b))
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    _save_checkpoint(model.eval(), str(tmp_path / "ck"))
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = tokens(32)
    with torch.no_grad():
        assert float((hf(x).logits - model(x)).abs().max()) <= 1e-4
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck2")]) == 0
    again = load_model(str(tmp_path / "ck2"))[0]
    assert again.args == model.args.__class__(**{**model.args.to_dict(), "bias_update_rate": 0.0})
    mine, theirs = model.state_dict(), again.state_dict()
    assert set(mine) == set(theirs)
    for k, t in mine.items():
        assert torch.equal(theirs[k], t), k


def edited_copy(hf_dir: str, dst, drop=(), **changes) -> str:
    shutil.copytree(hf_dir, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(changes)
    for k in drop:
        c.pop(k)
    with open(path, "w") as f:
        json.dump(c, f)
    return str(dst)


@pytest.mark.parametrize("kind,changes,key", [
    ("v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("v3", {"sliding_window": 64}, "sliding_window"),
    ("v3", {"rope_interleave": False}, "rope_interleave"),
    ("v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("v3", {"hidden_act": "gelu"}, "hidden_act"),
    ("v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("v3", {"n_group": 3}, "n_group"),
    ("v2", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}, "topk_method"),
    ("v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("v2", {"rope_parameters": dict(YARN, attention_factor=2.0)}, "attention_factor"),
])
def test_unsupported_config_is_one_line_naming_the_key(hf_models, tmp_path, capsys, kind, changes, key):
    bad = edited_copy(hf_models[kind][0], tmp_path / "bad", **changes)
    assert main(["convert", "--from-hf", bad, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm: ") and "\n" not in err and key in err, err
    assert not (tmp_path / "out").exists()


def test_init_from_takes_the_shape_and_frees_the_training_keys(hf_models):
    from harness import make_config
    from meshlm.core.config import ConfigError
    from meshlm.core.config.model import model_args
    hf_dir, _ = hf_models["v3"]
    a = model_args(make_config(model__init_from=f"hf:{hf_dir}", model__moe__bias_update_rate=1e-3,
                               model__moe__seq_aux_loss_coef=1e-4))
    assert (a.bias_update_rate, a.seq_aux_loss_coef, a.q_lora_rank, a.rope_type) == (1e-3, 1e-4, 32, "yarn")
    with pytest.raises(ConfigError, match="^model.moe.score"):
        model_args(make_config(model__init_from=f"hf:{hf_dir}", model__moe__score="softmax"))
    with pytest.raises(ConfigError, match="^model.moe.bias_update_rate"):  # V2 checkpoints carry no bias
        model_args(make_config(model__init_from=f"hf:{hf_models['v2'][0]}", model__moe__bias_update_rate=1e-3))


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "moonlight-16b-a3b", "dsv3-debug"])
def test_preset_config_json_round_trips_and_counts_as_transformers(tmp_path, name):
    """The config.json meshlm writes for a preset reads back as the preset (less the balancing rate, a
    training setting), and transformers' model of it (on the meta device) has the preset's main-model
    parameter count."""
    import dataclasses

    from meshlm.core.model_args import PRESETS
    from meshlm.core.hf_config import args_from_hf, config_for
    a = PRESETS[name]
    c = config_for(a, "bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert args_from_hf(str(tmp_path)) == dataclasses.replace(a, bias_update_rate=0.0)
    arch = getattr(transformers, c["architectures"][0])
    conf = getattr(transformers, c["architectures"][0].replace("ForCausalLM", "Config"))
    with torch.device("meta"):
        hf = arch(conf(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")}))
    assert sum(p.numel() for p in hf.parameters()) == a.num_params() - a.mtp_params(a.num_experts)


def test_export_refusals_name_the_key():
    import dataclasses

    from meshlm.core.model_args import PRESETS
    from meshlm.core.hf_config import family_for
    a = PRESETS["dsv3-debug"]
    for changes, key in (({"moe_every": 2}, "model.moe.every"), ({"moe_score": "softmax"}, "model.moe.n_group"),
                         ({"kv_lora_rank": 0, "q_lora_rank": 0, "qk_rope_head_dim": 0, "qk_nope_head_dim": 0,
                           "v_head_dim": 0}, "model.mtp_depth")):
        with pytest.raises(ValueError, match=f"^{key}"):
            family_for(dataclasses.replace(a, **changes))
