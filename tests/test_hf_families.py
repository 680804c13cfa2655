"""The Hugging Face families beyond plain Llama, each against transformers' own classes: Llama 3.1-style
RoPE scaling (llama3, linear), Qwen2 (q/k/v biases), Qwen3 (q/k norm, head_dim ≠ dim/heads), Mixtral
and Qwen3-MoE (router + stacked experts). Per family: a tiny random model saved with `save_pretrained`
gives transformers' fp32 logits after `convert --from-hf` (at positions beyond the pretraining
context for llama3), generates its greedy tokens, trains from `model.init_from` in a parallel layout
with one process's losses, and exports back to a directory transformers loads with meshlm's logits.
The llama3-* presets are the published shapes (parameter counts checked against transformers)."""
import dataclasses
import json

import pytest
import torch

from harness import assert_same_losses, make_config, run_layout, run_local
from meshlm.cli import main

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject [dev])

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # a tiny pretraining context: sequences of 64 pass it


def _build(family: str):
    if family == "llama3":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, rope_theta=500000.0,
                                                                      rope_scaling=LLAMA3_ROPE))
    if family == "linear":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **COMMON, rope_scaling=dict(rope_type="linear", factor=4.0), tie_word_embeddings=True))
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, rope_theta=30000.0))
    if family == "qwen3":  # head_dim 32 with 4 heads: q has 128 rows for a 64-wide model
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=32))
    if family == "qwen3moe":  # block 0 dense (mlp_only_layers), block 1 MoE; q/k norm, head_dim 32
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True, mlp_only_layers=[0]))
    assert family == "mixtral"
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                                      num_experts_per_tok=2))


FAMILIES = ("llama3", "linear", "qwen2", "qwen3", "mixtral", "qwen3moe")


def make_hf(path, family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = _build(family).eval()
    with torch.no_grad():  # larger weights than the init: logits far apart; biases and gains not 0 / 1
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_families")
    # seed 3 for Qwen2: seed 0's random biases make its greedy continuation one repeated token
    return {f: (str(root / f), make_hf(root / f, f, seed=3 if f == "qwen2" else 0)) for f in FAMILIES}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tokens(n: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ presets

PUBLISHED = {"llama3-1b": (1_235_814_400, 32.0), "llama3-3b": (3_212_749_824, 32.0),
             "llama3-8b": (8_030_261_248, 8.0), "llama3-70b": (70_553_706_496, 8.0),
             "llama3-405b": (405_853_388_800, 8.0)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_llama3_presets_are_the_published_models(name):
    """Parameter counts of Meta's Llama 3.2 1B/3B and 3.1 8B/70B/405B (1.24B ... 405.9B), equal to
    transformers' LlamaForCausalLM of the config.json meshlm would export (built on the meta device)."""
    from meshlm.core.model_args import PRESETS
    from meshlm.core.hf_config import config_for
    a = PRESETS[name]
    count, factor = PUBLISHED[name]
    assert a.num_params() == count
    assert (a.vocab_size, a.max_seq_len, a.rope_theta, a.rope_type, a.rope_factor) == \
        (128256, 131072, 500000.0, "llama3", factor)
    assert (a.rope_low_freq_factor, a.rope_high_freq_factor, a.rope_original_max_seq_len) == (1.0, 4.0, 8192)
    assert a.pretrain_seq_len == 8192
    cfg = transformers.LlamaConfig(**{k: v for k, v in config_for(a, "bfloat16").items()
                                      if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in hf.parameters()) == count


@pytest.mark.parametrize("first_dense,every", [(0, 1), (1, 1), (1, 2), (0, 3), (2, 2)])
def test_qwen3_moe_block_pattern_round_trips(tmp_path, first_dense, every):
    """Which blocks are MoE survives export (mlp_only_layers) and import (first_dense / every)."""
    from meshlm.core.model_args import ModelArgs
    from meshlm.core.hf_config import args_from_hf, config_for
    a = ModelArgs(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=256, qk_norm=True,
                  num_experts=4, top_k=2, moe_ffn_dim=48, moe_first_dense=first_dense, moe_every=every,
                  explicit_head_dim=32, aux_loss_coef=0.01)
    c = config_for(a, "float32")
    assert c["architectures"] == ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    b = args_from_hf(str(tmp_path))
    assert [b.is_moe_block(i) for i in range(6)] == [a.is_moe_block(i) for i in range(6)]
    assert b.aux_loss_coef == pytest.approx(a.aux_loss_coef)
    assert dataclasses.replace(b, moe_every=a.moe_every, aux_loss_coef=a.aux_loss_coef) == a


# Meta's config.json of Llama-3.1-8B and Llama-3.2-1B (older spelling: rope_scaling, top-level rope_theta)
META = {
    "llama3-8b": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
                  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
                  "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
                  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                  "use_cache": True, "vocab_size": 128256},
}
META["llama3-1b"] = dict(META["llama3-8b"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         head_dim=64, tie_word_embeddings=True,
                         rope_scaling=dict(META["llama3-8b"]["rope_scaling"], factor=32.0))


@pytest.mark.parametrize("name", list(META))
def test_meta_config_json_is_the_preset(tmp_path, name):
    from meshlm.core.model_args import PRESETS
    from meshlm.core.hf_config import args_from_hf
    (tmp_path / "config.json").write_text(json.dumps(META[name]))
    assert args_from_hf(str(tmp_path)) == PRESETS[name]


@pytest.mark.parametrize("name", [*PUBLISHED, "mixtral-8x7b", "small"])
def test_preset_config_json_round_trips(tmp_path, name):
    """`init_from` a directory with the config.json meshlm exports for a preset gives the preset back:
    plan, explore and init_from mean the same model by "llama3-8b"."""
    from meshlm.core.model_args import PRESETS
    from meshlm.core.hf_config import args_from_hf, config_for
    (tmp_path / "config.json").write_text(json.dumps(config_for(PRESETS[name], "bfloat16")))
    assert args_from_hf(str(tmp_path)) == PRESETS[name]


def test_rope_frequencies_equal_transformers():
    """llama3 and linear scaling: meshlm's frequency table is transformers' (the 8B preset's shape)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from meshlm.core.model_args import PRESETS
    from meshlm.core.hf_config import config_for
    from meshlm.model.llama import rope_frequencies
    a = PRESETS["llama3-8b"]
    linear = type(a)(**{**a.to_dict(), "rope_type": "linear", "rope_factor": 4.0})
    for args in (a, linear):
        c = config_for(args, "float32")
        cfg = transformers.LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})
        theirs, _ = ROPE_INIT_FUNCTIONS[args.rope_type](cfg, "cpu")
        ours = rope_frequencies(args)
        assert float(((ours - theirs.double()) / ours).abs().max()) < 1e-6
    assert not torch.allclose(rope_frequencies(a), rope_frequencies(type(a)(**{**a.to_dict(), "rope_type": "default"})))


# ------------------------------------------------------------------------------------ import

@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_gives_transformers_logits(hf_models, tmp_path, family):
    from meshlm.train.convert import load_model
    hf_dir, hf = hf_models[family]
    assert main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")]) == 0
    model = load_model(str(tmp_path / "ck"))[0]
    a = model.args
    assert (a.rope_type, a.qkv_bias, a.qk_norm, a.num_experts) == \
        {"llama3": ("llama3", False, False, 0), "linear": ("linear", False, False, 0),
         "qwen2": ("default", True, False, 0), "qwen3": ("default", False, True, 0),
         "mixtral": ("default", False, False, 4), "qwen3moe": ("default", False, True, 4)}[family]
    if family == "qwen3moe":
        assert (a.moe_first_dense, a.moe_every, a.expert_dim, a.ffn_dim) == (1, 1, 48, 96)
    if family == "qwen3":
        assert a.head_dim == 32 and model.layers["0"].attention.wq.weight.shape == (128, 64)
    x = tokens()
    with torch.no_grad():
        assert rel(model(x), hf(x).logits) <= 1e-5
        if family in ("llama3", "linear"):  # the scaling matters at these positions
            model.rope_cache = None
            model.args = type(a)(**{**a.to_dict(), "rope_type": "default"})
            assert rel(model(x), hf(x).logits) > 1e-3


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mixtral", "qwen3moe"])
def test_greedy_generate_matches_transformers(hf_models, tmp_path, family):
    """Through the KV cache, past the llama3 model's 16-position pretraining context."""
    from test_hf import assert_greedy_matches
    hf_dir, hf = hf_models[family]
    assert_greedy_matches(hf_dir, hf, str(tmp_path / "ck"), 24)


# ------------------------------------------------------------------------------------ export

@pytest.mark.parametrize("family", FAMILIES)
def test_export_reloads_in_transformers(hf_models, tmp_path, family):
    """convert --to-hf writes the family's config (rope scaling, head_dim, experts) and tensors;
    transformers' AutoModel loads it as the same class with meshlm's logits."""
    from meshlm.train.convert import load_model
    hf_dir, hf = hf_models[family]
    assert main(["convert", "--from-hf", hf_dir, "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back"), "--dtype", "fp32",
                 "--max-shard-gb", "0.0002"]) == 0
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    if family == "llama3":
        assert {k: back_cfg["rope_scaling"][k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
    moe = {"mixtral": "model.layers.1.block_sparse_moe.experts.3.w2.weight",
           "qwen3moe": "model.layers.1.mlp.experts.3.down_proj.weight"}
    if family in moe:  # transformers' state dict fuses the experts; the files hold them one by one
        assert moe[family] in index
    else:
        assert set(index) == set(hf.state_dict()) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(back) is type(hf)
    model = load_model(str(tmp_path / "ck"))[0]
    x = tokens()
    with torch.no_grad():
        assert rel(back(x).logits, model(x)) <= 1e-5


# ------------------------------------------------------------------------------------ training

LAYOUTS = [
    ("llama3", "tp2-pp2", 4, {"parallel__tp": 2, "parallel__pp": 2}),
    ("llama3", "cp2-ring", 2, {"parallel__cp": 2, "parallel__cp_impl": "ring"}),
    ("llama3", "cp2-ulysses", 2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses"}),
    ("qwen2", "tp2-sp-pp2", 4, {"parallel__tp": 2, "parallel__sp": True, "parallel__pp": 2}),
    ("qwen2", "tp4-kv-replicas", 4, {"parallel__tp": 4}),  # 2 kv heads on 4 ranks: biases replicated too
    ("qwen3", "tp2-pp2", 4, {"parallel__tp": 2, "parallel__pp": 2}),
    ("qwen3", "dp2-zero3-tp2-sp", 4, {"parallel__dp": 2, "parallel__zero": 3, "parallel__tp": 2,
                                      "parallel__sp": True, "training__micro_batch": 1}),
    ("mixtral", "ep2", 2, {"parallel__dp": 2, "parallel__ep": 2}),
    ("qwen3moe", "dp2-ep2-tp2", 4, {"parallel__dp": 2, "parallel__ep": 2, "parallel__tp": 2}),
]


_ONE_PROCESS: dict[str, list[dict]] = {}


@pytest.mark.parametrize("family,name,world,layout", LAYOUTS, ids=[f"{f}-{n}" for f, n, _, _ in LAYOUTS])
def test_init_from_hf_trains_like_one_process(hf_models, pools, family, name, world, layout):
    """Two steps from the HF weights (sequences of 64, past the llama3 model's 16) in a parallel layout:
    the losses equal one process's, whose first equals transformers' loss on that batch."""
    from test_hf import first_batch_loss
    hf_dir, hf = hf_models[family]
    base = dict(model__init_from=f"hf:{hf_dir}", training__steps=2, data__seq_len=64)
    if family not in _ONE_PROCESS:
        _ONE_PROCESS[family] = run_local(make_config(**base))
        first = first_batch_loss(hf, make_config(**base))
        assert abs(_ONE_PROCESS[family][0]["loss"] - first) <= 1e-5 * first
    ref = _ONE_PROCESS[family]
    got = run_layout(pools, make_config(**base, **layout), world)
    assert_same_losses(ref, got, 1e-5)


# ------------------------------------------------------------------------------------ config and refusals

@pytest.mark.parametrize("family", ["llama3", "qwen3", "mixtral"])
def test_init_from_pins_the_shape_in_the_run_config(hf_models, tmp_path, family):
    """The run's config.toml alone (model.rope_scaling.*, head_dim, qk_norm, model.moe.*) describes the
    imported model: a checkpoint's config rebuilds it without the Hugging Face directory."""
    from meshlm.core import config as C
    from meshlm.core.config.model import model_args, pin_model_shape
    from meshlm.core.hf_config import args_from_hf
    hf_dir, _ = hf_models[family]
    cfg = make_config(model__init_from=f"hf:{hf_dir}")
    pin_model_shape(cfg)
    cfg.model.init_from = ""
    (tmp_path / "c.toml").write_text(C.to_toml(cfg))
    assert model_args(C.load(str(tmp_path / "c.toml"))) == args_from_hf(hf_dir)


def test_unsupported_is_one_line_and_writes_nothing(hf_models, tmp_path, capsys):
    from test_hf import _one_line_error, edited_copy
    out = tmp_path / "out"
    cases = [
        ("qwen3", dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe"), "Qwen2-MoE"),
        ("qwen3moe", dict(norm_topk_prob=False), "norm_topk_prob"),
        ("qwen3moe", dict(mlp_only_layers=[2], num_hidden_layers=3), "every k-th"),  # MoE, MoE, dense
        ("qwen2", dict(use_sliding_window=True, sliding_window=16), "sliding"),
        ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]), "sliding"),
        ("mixtral", dict(sliding_window=32), "sliding_window"),
        ("llama3", dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "'yarn'"),
        ("llama3", dict(rope_scaling=dict(rope_type="dynamic", factor=4.0)), "'dynamic'"),
        ("llama3", dict(rope_scaling=dict(rope_type="llama3", factor=8.0), rope_parameters=None), "low_freq_factor"),
        ("llama3", dict(attention_bias=True), "attention_bias"),
    ]
    for i, (family, changes, needle) in enumerate(cases):
        d = edited_copy(hf_models[family][0], tmp_path / f"bad{i}", **changes)
        assert needle in _one_line_error(capsys, ["convert", "--from-hf", d, "--out", str(out)]), changes
        err = _one_line_error(capsys, ["train", "--model.init_from", f"hf:{d}", "--run-dir", str(tmp_path / "run")])
        assert err.startswith("meshlm: model.init_from:") and needle in err
    assert not out.exists() and not (tmp_path / "run").exists()
    hf_dir = hf_models["llama3"][0]
    err = _one_line_error(capsys, ["train", "--model.init_from", f"hf:{hf_dir}", "--model.rope_scaling.factor", "4",
                                   "--run-dir", str(tmp_path / "run")])
    assert "model.rope_scaling.factor" in err and "differs" in err
    err = _one_line_error(capsys, ["train", "--model.rope_scaling.type", "dynamic", "--run-dir", str(tmp_path / "run")])
    assert "model.rope_scaling.type" in err and "llama3" in err
    assert not (tmp_path / "run").exists()


def test_export_refuses_a_model_no_transformers_architecture_expresses(tmp_path, capsys):
    """moe-debug has a shared expert: no transformers class holds it, refused before writing."""
    from test_hf import _one_line_error
    run_local(make_config(model__preset="moe-debug", training__steps=1, checkpoint__every=1), str(tmp_path / "run"))
    err = _one_line_error(capsys, ["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert "model.moe.shared_experts" in err and "Mixtral" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


@pytest.mark.parametrize("family,layout", [("qwen3moe", {"parallel__dp": 2, "parallel__ep": 2}),
                                           ("qwen2", {"parallel__tp": 2})], ids=["qwen3moe-ep2", "qwen2-tp2"])
def test_trained_in_a_layout_exports_to_transformers(hf_models, pools, tmp_path, family, layout):
    """init_from -> 2 steps in a parallel layout -> checkpoint.export_hf: transformers loads the trained
    weights as the family's class with the logits of meshlm's checkpoint (and not the initial ones)."""
    import os

    from harness import train_case
    from meshlm.core import config as C
    from meshlm.train.convert import load_model
    from meshlm.core.config.model import pin_model_shape
    hf_dir, hf = hf_models[family]
    cfg = make_config(model__init_from=f"hf:{hf_dir}", training__steps=2, data__seq_len=64,
                      checkpoint__export_hf="end", checkpoint__export_dtype="fp32", **layout)
    pin_model_shape(cfg)  # as `meshlm train` does: the checkpoint's config describes the imported model
    run = str(tmp_path / "run")
    pools(2).run(train_case, C.to_dict(cfg), run)
    back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(run, "hf", "step_00000002")).eval()
    assert type(back) is type(hf)
    model = load_model(os.path.join(run, "checkpoints", "step_00000002"))[0]
    x = tokens()
    with torch.no_grad():
        ours = model(x)
        assert rel(back(x).logits, ours) <= 1e-5
        assert rel(hf(x).logits, ours) > 1e-4
