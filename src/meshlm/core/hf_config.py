"""Hugging Face `config.json` <-> ModelArgs, and parameter names between the two layouts, for the
families meshlm's Llama can express: Llama (3.1+ RoPE scaling included), Qwen2, Qwen3, Mixtral,
Qwen3-MoE, and DeepSeek-V2 / V3 (their config.json: core/hf_deepseek.py).

Torch-free on purpose: layout checks and the planner read HF shapes without importing torch.
Errors are ValueErrors with one line that names the file.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from . import hf_deepseek as deepseek
from .model_args import ModelArgs


@dataclass(frozen=True)
class Family:
    """One transformers architecture: what its config.json implies for ModelArgs, and where a MoE
    block's router and experts live (`experts`: expert {j}'s tensor {w}, named per meshlm w1/w2/w3)."""
    arch: str
    model_type: str
    qkv_bias: bool = False  # q/k/v biases always present (Qwen2)
    qk_norm: bool = False   # per-head q/k RMSNorm (Qwen3)
    moe: bool = False       # sparse MoE feed-forwards (Mixtral: every block; Qwen3-MoE: as configured)
    router: str = ""
    experts: str = ""
    expert_w: tuple[tuple[str, str], ...] = ()


MIXTRAL = Family("MixtralForCausalLM", "mixtral", moe=True, router="block_sparse_moe.gate.weight",
                 experts="block_sparse_moe.experts.{j}.{w}.weight", expert_w=(("w1", "w1"), ("w2", "w2"), ("w3", "w3")))
QWEN3_MOE = Family("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, moe=True, router="mlp.gate.weight",
                   experts="mlp.experts.{j}.{w}.weight",
                   expert_w=(("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")))
DEEPSEEK = {arch: Family(arch, deepseek.MODEL_TYPES[arch], moe=True, router="mlp.gate.weight",
                         experts=QWEN3_MOE.experts, expert_w=QWEN3_MOE.expert_w) for arch in deepseek.MODEL_TYPES}
FAMILIES = (Family("LlamaForCausalLM", "llama"), Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True),
            Family("Qwen3ForCausalLM", "qwen3", qk_norm=True), MIXTRAL, QWEN3_MOE, *DEEPSEEK.values())
ARCH = FAMILIES[0].arch
# architectures close enough to name in the refusal, with what is missing
REFUSED = {"Qwen2MoeForCausalLM": "Qwen2-MoE (sigmoid-gated shared expert) is not supported"}
ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_KEYS = {"beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
             "mscale_all_dim": "rope_mscale_all_dim"}

# meshlm single-process name -> transformers name (per block: `{i}` is the layer index)
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    # DeepSeek-V2/V3: multi-head latent attention, shared experts, the selection bias
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
}
# an MTP module (DeepSeek-V3) is transformers' layer n_layers + k: its own tensors, then its block's
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}
_MTP_NAME = re.compile(r"^mtp\.(\d+)\.(.+)$")
_ROUTER = "feed_forward.router.weight"
# stacked experts [E, ...]: expert j's slice is one transformers tensor (Family.experts)
_EXPERTS = {f"feed_forward.experts.{w}": w for w in ("w1", "w2", "w3")}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def stacked(name: str) -> bool:
    """Whether meshlm parameter `name` stacks one transformers tensor per expert."""
    return name.endswith(tuple(f".{e}" for e in _EXPERTS))


def hf_names(name: str, args: ModelArgs) -> list[str]:
    """The transformers names of meshlm parameter `name`: one, or one per expert for stacked experts
    (a MoE block's names depend on the architecture that expresses `args`: family_for)."""
    if name in _TOP:
        return [_TOP[name]]
    mtp = _MTP_NAME.match(name)
    if mtp and args is not None:  # MTP module k: transformers' layer n_layers + k
        layer = args.n_layers + int(mtp.group(1))
        if mtp.group(2) in _MTP:
            return [f"model.layers.{layer}.{_MTP[mtp.group(2)]}"]
        if mtp.group(2).startswith("block."):
            return hf_names(f"layers.{layer}.{mtp.group(2)[len('block.'):]}", args)
    m = _LAYER.match(name)
    if m and m.group(2) in _BLOCK:
        return [f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"]
    if m and (m.group(2) in _EXPERTS or m.group(2) == _ROUTER):
        fam, prefix = family_for(args), f"model.layers.{m.group(1)}"
        if m.group(2) == _ROUTER:
            return [f"{prefix}.{fam.router}"]
        w = dict(fam.expert_w)[_EXPERTS[m.group(2)]]
        return [f"{prefix}.{fam.experts.format(j=j, w=w)}" for j in range(args.num_experts)]
    raise KeyError(f"no Hugging Face name for parameter {name}")


def hf_copies(name: str, args: ModelArgs) -> list[str]:
    """Extra transformers tensors holding a copy of meshlm parameter `name` on export: DeepSeek-V3's MTP
    layers carry the shared embedding and head again (embed_tokens, shared_head.head)."""
    head = "output.weight" if not args.tie_embeddings else "tok_embeddings.weight"
    out = []
    for k in range(args.mtp_depth):
        layer = f"model.layers.{args.n_layers + k}"
        out += [f"{layer}.embed_tokens.weight"] * (name == "tok_embeddings.weight")
        out += [f"{layer}.shared_head.head.weight"] * (name == head)
    return out


def hf_name(name: str) -> str:
    """The transformers name of a meshlm parameter that is one transformers tensor."""
    if stacked(name):
        raise KeyError(f"{name} stacks one Hugging Face tensor per expert (hf_names)")
    return hf_names(name, None)[0]


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every meshlm parameter (single-process name, tied head left out) and its unpadded shape, and the
    MoE selection bias (a buffer, but model state exported like a weight)."""
    out = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        out.update({f"layers.{i}.{k}": v for k, v in _block_shapes(args, i).items()})
    out["norm.weight"] = (args.dim,)
    if not args.tie_embeddings:
        out["output.weight"] = (args.vocab_size, args.dim)
    d = args.dim
    for k in range(args.mtp_depth):
        out.update({f"mtp.{k}.enorm.weight": (d,), f"mtp.{k}.hnorm.weight": (d,), f"mtp.{k}.proj.weight": (d, 2 * d)})
        out.update({f"mtp.{k}.block.{n}": v for n, v in _block_shapes(args, args.n_layers + k).items()})
        out[f"mtp.{k}.norm.weight"] = (d,)
    return out


def _attention_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    hd, d = args.head_dim, args.dim
    if args.mla:
        h, rank, rope = args.n_heads, args.kv_lora_rank, args.qk_rope_head_dim
        q = h * args.qk_head_dim
        attn = {"attention.wq.weight": (q, d)} if not args.q_lora_rank else {
            "attention.wq_a.weight": (args.q_lora_rank, d), "attention.q_a_norm.weight": (args.q_lora_rank,),
            "attention.wq_b.weight": (q, args.q_lora_rank)}
        return {**attn, "attention.wkv_a.weight": (rank + rope, d), "attention.kv_a_norm.weight": (rank,),
                "attention.wkv_b.weight": (h * (args.qk_nope_head_dim + args.v_head_dim), rank),
                "attention.wo.weight": (d, h * args.v_head_dim)}
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    attn = {"attention.wq.weight": (q, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d),
            "attention.wo.weight": (d, q)}
    if args.qkv_bias:
        attn.update({"attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,)})
    if args.qk_norm:
        attn.update({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)})
    return attn


def _block_shapes(args: ModelArgs, i: int) -> dict[str, tuple[int, ...]]:
    """The tensors of block `i` (i >= n_layers: an MTP module's block)."""
    d, f, e, n = args.dim, args.ffn_dim, args.expert_dim, args.num_experts
    out = {"attention_norm.weight": (d,), **_attention_shapes(args), "ffn_norm.weight": (d,)}
    if not args.is_moe_block(i):
        return {**out, "feed_forward.w1.weight": (f, d), "feed_forward.w3.weight": (f, d),
                "feed_forward.w2.weight": (d, f)}
    out.update({"feed_forward.router.weight": (n, d), "feed_forward.experts.w1": (n, e, d),
                "feed_forward.experts.w3": (n, e, d), "feed_forward.experts.w2": (n, d, e)})
    if args.expert_bias:
        out["feed_forward.expert_bias"] = (n,)
    if args.shared_experts:
        s = args.shared_experts * e
        out.update({"feed_forward.shared.w1.weight": (s, d), "feed_forward.shared.w3.weight": (s, d),
                    "feed_forward.shared.w2.weight": (d, s)})
    return out


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ValueError(f"{hf_dir}: no such directory")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not found (a Hugging Face model directory has config.json)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def family_of(c: dict, path: str) -> Family:
    archs = c.get("architectures") or []
    for fam in FAMILIES:
        if fam.arch in archs or (not archs and c.get("model_type") == fam.model_type):
            return fam
    what = ", ".join(archs) or c.get("model_type", "unknown")
    for arch, why in REFUSED.items():
        if arch in archs:
            raise ValueError(f"{path}: architecture {arch}: {why}")
    raise ValueError(f"{path}: architecture {what} is not supported "
                     f"(only {', '.join(f.arch for f in FAMILIES)})")


def _rope(c: dict, path: str, yarn: bool = False) -> dict:
    """ModelArgs' RoPE fields from `rope_scaling` (Meta's and older transformers' files) or
    `rope_parameters` (transformers 5); dynamic NTK and LongRoPE are refused, YaRN unless `yarn`
    (DeepSeek families: transformers' keys, with the truncated correction range)."""
    params = dict(c.get("rope_parameters") or {})
    params.update(c.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(params.get("rope_theta", c.get("rope_theta", 10000.0)))}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3", "yarn") or kind == "yarn" and not yarn:
        raise ValueError(f"{path}: rope_scaling of type {kind!r} is not supported (default, linear and llama3 "
                         f"only{', and yarn' if yarn else ''}; dynamic NTK is not implemented"
                         f"{'' if yarn else ', YaRN only for DeepSeek models'})")
    need = {"llama3": ROPE_KEYS, "linear": ROPE_KEYS[:1], "yarn": ROPE_KEYS[::3]}[kind]
    missing = [k for k in need if params.get(k) is None]
    if missing:
        raise ValueError(f"{path}: rope_scaling of type {kind!r} lacks {missing[0]}")
    out.update(rope_type=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]),
                   rope_original_max_seq_len=int(params["original_max_position_embeddings"]))
    if kind == "yarn":
        if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
            raise ValueError(f"{path}: rope_scaling attention_factor / truncate = false is not supported (YaRN's "
                             f"factor from mscale / mscale_all_dim, truncated correction range)")
        out["rope_original_max_seq_len"] = int(params["original_max_position_embeddings"])
        out.update({field: float(params.get(key) or {"beta_fast": 32.0, "beta_slow": 1.0}.get(key, 0.0))
                    for key, field in YARN_KEYS.items()})
    return out


def _rope_json(args: ModelArgs) -> dict:
    """transformers' rope_parameters of `args` (rope_type, rope_theta and the type's keys)."""
    rope: dict = {"rope_type": args.rope_type, "rope_theta": args.rope_theta}
    if args.rope_type != "default":
        rope["factor"] = args.rope_factor
    if args.rope_type == "llama3":
        rope.update(low_freq_factor=args.rope_low_freq_factor, high_freq_factor=args.rope_high_freq_factor,
                    original_max_position_embeddings=args.rope_original_max_seq_len)
    if args.rope_type == "yarn":
        rope["original_max_position_embeddings"] = args.rope_original_max_seq_len
        rope.update({key: getattr(args, field) for key, field in YARN_KEYS.items()
                     if getattr(args, field) or key.startswith("beta")})
    return rope


def _refuse_features(c: dict, fam: Family, path: str) -> None:
    """What none of the families' meshlm counterpart expresses: one line naming the key."""
    if c.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias = true is not supported (meshlm's feed-forward has no biases)")
    if c.get("attention_bias"):  # Llama and Qwen3: biases on q, k, v and o (Qwen2's o has none)
        raise ValueError(f"{path}: attention_bias = true is not supported (an o_proj bias; only Qwen2's "
                         f"q/k/v biases are)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {c['hidden_act']!r} is not supported (SwiGLU with silu only)")
    layers = [t for t in c.get("layer_types") or [] if t != "full_attention"]
    if c.get("use_sliding_window") or layers:
        raise ValueError(f"{path}: sliding-window attention (use_sliding_window / layer_types) is not "
                         f"supported (full causal attention only)")
    window = c.get("sliding_window")
    if fam.moe and window is not None and window < c.get("max_position_embeddings", 0):
        raise ValueError(f"{path}: sliding_window = {window} is not supported (full causal attention only)")


def _moe(c: dict, fam: Family, path: str) -> dict:
    """ModelArgs' MoE fields. Which blocks are MoE (Qwen3-MoE: `mlp_only_layers`, `decoder_sparse_step`)
    must be meshlm's pattern (first_dense dense blocks, then every `every`-th); routing must renormalise
    the top-k (Qwen3-MoE's `norm_topk_prob`; Mixtral always does). transformers weighs one balance term
    averaged over the blocks, meshlm sums one per block: the coefficient is divided by their count."""
    n = int(c["num_hidden_layers"])
    step, dense_only = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or [])
    is_moe = [i not in dense_only and (i + 1) % step == 0 for i in range(n)]
    if not any(is_moe):
        raise ValueError(f"{path}: no MoE block (mlp_only_layers / decoder_sparse_step)")
    first = is_moe.index(True)
    later = [i for i in range(first + 1, n) if is_moe[i]]
    every = later[0] - first if later else max(1, n - first)  # one MoE block: any step past the end
    if is_moe != [i >= first and (i - first) % every == 0 for i in range(n)]:
        raise ValueError(f"{path}: MoE blocks {[i for i in range(n) if is_moe[i]]} are not leading dense blocks "
                         f"then every k-th (model.moe.first_dense / every)")
    if fam is QWEN3_MOE and not c.get("norm_topk_prob", False):
        raise ValueError(f"{path}: norm_topk_prob = false is not supported (meshlm renormalises the top-k "
                         f"router weights)")
    experts = c.get("num_local_experts", c.get("num_experts"))
    return dict(num_experts=int(experts), top_k=int(c["num_experts_per_tok"]),
                moe_ffn_dim=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
                moe_first_dense=first, moe_every=every,
                aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)) / sum(is_moe))


def args_from_hf(hf_dir: str, max_seq_len: int | None = None) -> ModelArgs:
    """ModelArgs of the transformers model in `hf_dir`; anything meshlm's Llama cannot express is
    refused (another architecture, o/MLP biases, a non-SiLU MLP, sliding windows, other RoPE scaling)."""
    c = read_config(hf_dir)
    path = os.path.join(hf_dir, "config.json")
    fam = family_of(c, path)
    if fam.arch in DEEPSEEK:
        return _deepseek_args(c, fam.arch, path, hf_dir, max_seq_len)
    _refuse_features(c, fam, path)
    try:
        dim, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        hd = int(c.get("head_dim") or (dim // heads))
        moe = _moe(c, fam, path) if fam.moe else {}
        args = ModelArgs(
            dim=dim, n_layers=int(c["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(c.get("num_key_value_heads") or heads), ffn_dim=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]),
            max_seq_len=int(max_seq_len or c.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)), qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm,
            explicit_head_dim=0 if hd * heads == dim else hd, **_rope(c, path), **moe)
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        if str(e).startswith(path):
            raise
        raise ValueError(f"{path}: bad value ({e})") from None
    if hd % 2 or hd < 2:
        raise ValueError(f"{path}: head_dim {hd} must be even for RoPE")
    if heads % args.n_kv_heads:
        raise ValueError(f"{path}: num_key_value_heads {args.n_kv_heads} does not divide num_attention_heads {heads}")
    return args


def _deepseek_args(c: dict, arch: str, path: str, hf_dir: str, max_seq_len: int | None) -> ModelArgs:
    """ModelArgs of a DeepSeek-V2 / V3 config.json (core/hf_deepseek.py), one-line ValueErrors."""
    try:
        fields = deepseek.args_fields(c, arch, path, _rope(c, path, yarn=True), deepseek.tensor_names(hf_dir))
        if max_seq_len:
            fields["max_seq_len"] = int(max_seq_len)
        args = ModelArgs(**fields)
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        if str(e).startswith(path) or str(e).startswith(hf_dir):
            raise
        raise ValueError(f"{path}: bad value ({e})") from None
    if args.num_experts % args.n_group or args.top_k > args.topk_group * (args.num_experts // args.n_group):
        raise ValueError(f"{path}: n_group {args.n_group} / topk_group {args.topk_group} do not fit "
                         f"{args.num_experts} experts and top-{args.top_k}")
    return args


def family_for(args: ModelArgs) -> Family:
    """The transformers architecture that expresses `args`; ValueError when none does."""
    if args.mla:
        return DEEPSEEK[deepseek.exportable(args)]
    deepseek_only = [("model.mtp_depth", args.mtp_depth), ("model.moe.score", args.moe_score != "softmax"),
                     ("model.moe.bias_update_rate", args.expert_bias), ("model.moe.n_group", args.n_group != 1),
                     ("model.moe.routed_scaling_factor", args.routed_scaling_factor != 1.0),
                     ("model.moe.norm_topk_prob", not args.norm_topk_prob)]
    extra = [key for key, v in deepseek_only if v and (args.moe or key == "model.mtp_depth")]
    if extra:
        raise ValueError(f"{extra[0]}: only DeepseekV2/V3 express it, and they need multi-head latent attention "
                         f"(model.kv_lora_rank > 0)")
    if args.moe:
        if args.qk_norm:  # Qwen3-MoE: dense blocks anywhere (mlp_only_layers)
            extra = [("model.moe.shared_experts", args.shared_experts), ("model.qkv_bias", args.qkv_bias)]
        else:  # Mixtral: every block MoE
            extra = [("model.moe.shared_experts", args.shared_experts), ("model.moe.first_dense", args.moe_first_dense),
                     ("model.moe.every", args.moe_every - 1), ("model.qkv_bias", args.qkv_bias)]
        extra = [k for k, v in extra if v]
        if extra:
            raise ValueError(f"{extra[0]}: no transformers architecture expresses this MoE model (Mixtral: every "
                             f"block MoE, no shared experts or q/k/v biases; Qwen3-MoE: q/k norm, no shared experts)")
        return QWEN3_MOE if args.qk_norm else MIXTRAL
    if args.qkv_bias and args.qk_norm:
        raise ValueError("model.qkv_bias with model.qk_norm: no transformers architecture expresses both "
                         "(Qwen2: biases, Qwen3: q/k norm)")
    return FAMILIES[1] if args.qkv_bias else FAMILIES[2] if args.qk_norm else FAMILIES[0]


def _moe_config(args: ModelArgs, fam: Family) -> dict:
    out = {"num_experts_per_tok": args.top_k, "router_aux_loss_coef": args.aux_loss_coef * args.n_moe_blocks,
           "output_router_logits": False, "sliding_window": None}
    if fam is MIXTRAL:
        return {**out, "num_local_experts": args.num_experts, "intermediate_size": args.expert_dim,
                "router_jitter_noise": 0.0}
    return {**out, "num_experts": args.num_experts, "moe_intermediate_size": args.expert_dim, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(args.n_layers) if not args.is_moe_block(i)]}


def config_for(args: ModelArgs, dtype: str) -> dict:
    """A transformers `config.json` for `args` (dtype: 'bfloat16' or 'float32'): Llama, Qwen2, Qwen3,
    Mixtral, Qwen3-MoE, DeepSeek-V2 or V3, whichever expresses it (family_for); ValueError when none does."""
    fam = family_for(args)
    rope = _rope_json(args)
    out = {
        "architectures": [fam.arch], "model_type": fam.model_type,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
        # both spellings: transformers 5 reads rope_parameters, older versions rope_theta / rope_scaling
        "rope_theta": args.rope_theta, "rope_scaling": None if args.rope_type == "default" else rope,
        "rope_parameters": rope, "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,  # older and newer transformers spell it differently
    }
    if fam.model_type in ("llama", "qwen3", "qwen3_moe"):
        out.update(attention_bias=False, mlp_bias=False)
    if fam.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers,
                   layer_types=["full_attention"] * args.n_layers)
    if fam.arch in DEEPSEEK:
        return {**out, **deepseek.config_json(args, rope)}
    if fam.moe:
        out.update(_moe_config(args, fam))
    return out
