"""DeepSeek-V2 / V3 `config.json` <-> ModelArgs (transformers' DeepseekV2ForCausalLM and
DeepseekV3ForCausalLM: MLA, DeepSeekMoE with shared experts, dense first blocks; V3: sigmoid
group-limited routing with `e_score_correction_bias`, MTP modules as layers past the last).

A DeepSeek config is read only when every key is understood: an unknown key (an fp8
`quantization_config` among them) is refused with one line naming it, as is a value meshlm's model
does not compute the way transformers does. Torch-free, like hf_config (which calls this).
"""
from __future__ import annotations

import json
import os
import struct

from .model_args import ModelArgs

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
MODEL_TYPES = {V2: "deepseek_v2", V3: "deepseek_v3"}

# keys whose values ModelArgs takes or checks (args_fields), and keys that change nothing meshlm computes
READ = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
        "n_group", "topk_group", "topk_method", "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq",
        "norm_topk_prob", "scoring_func", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
        "rope_parameters", "rope_interleave", "tie_word_embeddings", "num_nextn_predict_layers", "aux_loss_alpha",
        "seq_aux", "hidden_act", "attention_bias", "mlp_bias"}
IGNORED = {"bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "transformers_version",
           "initializer_range", "use_cache", "pretraining_tp", "attention_dropout", "output_router_logits", "ep_size",
           "auto_map", "_name_or_path", "head_dim", "qk_head_dim"}  # head_dim, qk_head_dim: derived by transformers
# (key, default, the only value supported, why)
FIXED = (("hidden_act", "silu", "silu", "SwiGLU with silu only"),
         ("attention_bias", False, False, "MLA's projections have no biases"),
         ("mlp_bias", False, False, "meshlm's feed-forward has no biases"),
         ("rope_interleave", True, True, "RoPE on interleaved pairs only (DeepSeek's weights)"),
         ("moe_layer_freq", 1, 1, "every block after the dense ones is MoE"))


def _refuse(c: dict, arch: str, path: str) -> None:
    for key in c:
        if key == "quantization_config":
            raise ValueError(f"{path}: quantization_config is not supported (block-quantized fp8 weights; "
                             f"convert them to bf16 first)")
        if key not in READ and key not in IGNORED:
            raise ValueError(f"{path}: key {key!r} is not supported (a DeepSeek config is read only when every key "
                             f"is understood)")
    for key, default, want, why in FIXED:
        if c.get(key, default) != want and not (key == "moe_layer_freq" and c.get(key) is None):
            raise ValueError(f"{path}: {key} = {c[key]!r} is not supported ({why})")
    heads = c.get("num_attention_heads")
    if c.get("num_key_value_heads") not in (None, heads):
        raise ValueError(f"{path}: num_key_value_heads {c['num_key_value_heads']} differs from num_attention_heads "
                         f"{heads} (MLA expands every head from the latent)")
    score, method = c.get("scoring_func"), c.get("topk_method")
    if arch == V3 and (score not in (None, "sigmoid") or method not in (None, "noaux_tc")):
        raise ValueError(f"{path}: scoring_func {score!r} / topk_method {method!r} is not supported "
                         f"(DeepseekV3: sigmoid, noaux_tc)")
    if arch == V2 and (score not in (None, "softmax") or method not in (None, "greedy")):
        raise ValueError(f"{path}: scoring_func {score!r} / topk_method {method!r} is not supported (DeepseekV2: "
                         f"softmax, greedy; group_limited_greedy's max-score groups are not implemented)")
    if arch == V2 and c.get("norm_topk_prob"):
        raise ValueError(f"{path}: norm_topk_prob = true is not supported for DeepseekV2 (transformers' "
                         f"DeepseekV2 never renormalises, so the two would differ)")


def args_fields(c: dict, arch: str, path: str, rope: dict, tensors: set[str] | None) -> dict:
    """ModelArgs' fields from DeepSeek config `c` (`rope`: hf_config's RoPE fields; `tensors`: the tensor
    names the directory's weights hold, None without weights). The MTP depth counts only the MTP
    layers whose weights are there (transformers saves none; its config still says 1)."""
    _refuse(c, arch, path)
    n, heads, experts = int(c["num_hidden_layers"]), int(c["num_attention_heads"]), int(c["n_routed_experts"])
    v3 = arch == V3
    mtp = int(c.get("num_nextn_predict_layers") or 0) if v3 else 0
    if tensors is not None:
        mtp = next((k for k in range(mtp) if f"model.layers.{n + k}.eh_proj.weight" not in tensors), mtp)
    seq_aux = c.get("seq_aux", True)
    return dict(
        dim=int(c["hidden_size"]), n_layers=n, n_heads=heads, n_kv_heads=heads, ffn_dim=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]), max_seq_len=int(c.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        q_lora_rank=int(c.get("q_lora_rank") or 0), kv_lora_rank=int(c["kv_lora_rank"]),
        qk_rope_head_dim=int(c["qk_rope_head_dim"]), qk_nope_head_dim=int(c["qk_nope_head_dim"]),
        v_head_dim=int(c["v_head_dim"]), mtp_depth=mtp, num_experts=experts, top_k=int(c["num_experts_per_tok"]),
        moe_ffn_dim=int(c["moe_intermediate_size"]), shared_experts=int(c.get("n_shared_experts") or 0),
        moe_first_dense=int(c.get("first_k_dense_replace") or 0), aux_loss_coef=0.0,
        seq_aux_loss_coef=float(c.get("aux_loss_alpha") or 0.0) if seq_aux else 0.0,
        moe_score="sigmoid" if v3 else "softmax", n_group=int(c.get("n_group") or 1) if v3 else 1,
        topk_group=int(c.get("topk_group") or 1) if v3 else 1,
        routed_scaling_factor=float(c.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)) if v3 else False, **rope)


def exportable(args: ModelArgs) -> str:
    """The architecture that expresses `args` (an MLA model); ValueError naming the key when none does."""
    problems = [("model.moe.num_experts", not args.moe), ("model.qkv_bias", args.qkv_bias),
                ("model.qk_norm", args.qk_norm), ("model.moe.every", args.moe_every != 1)]
    if args.moe_score == "softmax":  # DeepseekV2: plain greedy top-k, never renormalised, no bias
        problems += [("model.moe.n_group", args.n_group != 1), ("model.moe.norm_topk_prob", args.norm_topk_prob),
                     ("model.moe.bias_update_rate", args.expert_bias), ("model.mtp_depth", args.mtp_depth)]
    bad = [key for key, wrong in problems if wrong]
    if bad:
        raise ValueError(f"{bad[0]}: no transformers architecture expresses this MLA model (DeepseekV3: sigmoid "
                         f"routing, every block after the dense ones MoE; DeepseekV2: softmax greedy top-k without "
                         f"renormalisation, groups, bias or MTP)")
    return V3 if args.moe_score == "sigmoid" else V2


def config_json(args: ModelArgs, rope: dict) -> dict:
    """The DeepSeek-specific keys of the config.json meshlm exports for `args` (hf_config adds the rest)."""
    arch = exportable(args)
    out = {"architectures": [arch], "model_type": MODEL_TYPES[arch], "num_key_value_heads": args.n_heads,
           "head_dim": args.qk_rope_head_dim,  # what transformers derives (its RoPE size)
           "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
           "qk_rope_head_dim": args.qk_rope_head_dim, "qk_nope_head_dim": args.qk_nope_head_dim,
           "v_head_dim": args.v_head_dim, "n_routed_experts": args.num_experts, "n_shared_experts": args.shared_experts,
           "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.expert_dim,
           "first_k_dense_replace": args.moe_first_dense, "routed_scaling_factor": args.routed_scaling_factor,
           "norm_topk_prob": args.norm_topk_prob, "aux_loss_alpha": args.seq_aux_loss_coef, "seq_aux": True,
           "attention_bias": False, "output_router_logits": False, "rope_scaling": rope if args.rope_type != "default"
           else None}
    if arch == V3:
        return {**out, "n_group": args.n_group, "topk_group": args.topk_group, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc", "num_nextn_predict_layers": args.mtp_depth, "rope_interleave": True}
    return {**out, "n_group": None, "topk_group": None, "scoring_func": "softmax", "topk_method": "greedy",
            "mlp_bias": False}


def tensor_names(hf_dir: str) -> set[str] | None:
    """The tensor names a model directory's safetensors hold (from the index or the file headers, no
    weights read); None when it has none (a config.json alone)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index) as f:
                return set(json.load(f)["weight_map"])
        names: set[str] = set()
        files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
        for name in files:
            with open(os.path.join(hf_dir, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                names.update(k for k in json.loads(f.read(n)) if k != "__metadata__")
        return names if files else None
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ValueError(f"{hf_dir}: unreadable safetensors index or header ({e})") from None
