"""Hugging Face Llama `config.json` <-> ModelArgs, and parameter names between the two layouts.

Torch-free on purpose: layout checks and the planner read HF shapes without importing torch.
Errors are ValueErrors with one line that names the file.
"""
from __future__ import annotations

import json
import os
import re

from .args import ModelArgs

ARCH = "LlamaForCausalLM"
ROPE_DEFAULT = ("default", None)

# meshlm single-process name -> transformers name (per block: `{i}` is the layer index)
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    """The transformers name of meshlm parameter `name`."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.match(name)
    if not m or m.group(2) not in _BLOCK:
        raise KeyError(f"no Hugging Face name for parameter {name}")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every meshlm parameter (single-process name, tied head left out) and its unpadded shape."""
    hd, d = args.head_dim, args.dim
    block = {"attention_norm.weight": (d,), "attention.wq.weight": (args.n_heads * hd, d),
             "attention.wk.weight": (args.n_kv_heads * hd, d), "attention.wv.weight": (args.n_kv_heads * hd, d),
             "attention.wo.weight": (d, args.n_heads * hd), "ffn_norm.weight": (d,),
             "feed_forward.w1.weight": (args.ffn_dim, d), "feed_forward.w3.weight": (args.ffn_dim, d),
             "feed_forward.w2.weight": (d, args.ffn_dim)}
    out = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        out.update({f"layers.{i}.{k}": v for k, v in block.items()})
    out["norm.weight"] = (d,)
    if not args.tie_embeddings:
        out["output.weight"] = (args.vocab_size, d)
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


def args_from_hf(hf_dir: str, max_seq_len: int | None = None) -> ModelArgs:
    """ModelArgs of the transformers Llama in `hf_dir`; anything meshlm's Llama cannot express is
    refused (another architecture, biases, a non-SiLU MLP, rope scaling, an odd head_dim)."""
    c = read_config(hf_dir)
    path = os.path.join(hf_dir, "config.json")
    archs = c.get("architectures") or []
    if ARCH not in archs and c.get("model_type") != "llama":
        what = ", ".join(archs) or c.get("model_type", "unknown")
        raise ValueError(f"{path}: architecture {what} is not supported (only {ARCH})")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"{path}: {key} = true is not supported (meshlm's Llama has no biases)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {c['hidden_act']!r} is not supported (SwiGLU with silu only)")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "?"))
        raise ValueError(f"{path}: rope_scaling of type {kind!r} is not supported (plain RoPE only; "
                         f"Llama 3.1+ long-context scaling is not implemented)")
    try:
        dim, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        args = ModelArgs(
            dim=dim, n_layers=int(c["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(c.get("num_key_value_heads") or heads), ffn_dim=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]),
            max_seq_len=int(max_seq_len or c.get("max_position_embeddings", 2048)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)))
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad value ({e})") from None
    if dim % heads or (c.get("head_dim") not in (None, dim // heads)):
        raise ValueError(f"{path}: head_dim {c.get('head_dim')} is not hidden_size/num_attention_heads "
                         f"= {dim}/{heads} (meshlm needs head_dim × heads = dim)")
    if heads % args.n_kv_heads:
        raise ValueError(f"{path}: num_key_value_heads {args.n_kv_heads} does not divide num_attention_heads {heads}")
    return args


def config_for(args: ModelArgs, dtype: str) -> dict:
    """A transformers `config.json` for `args` (dtype: 'bfloat16' or 'float32')."""
    return {
        "architectures": [ARCH], "model_type": "llama",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta, "rope_scaling": None, "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,  # older and newer transformers spell it differently
    }
