"""Model arguments from a config's model section: the preset, the section's overrides, the shape of a
Hugging Face model (model.init_from), and their checks as one-line ConfigErrors naming the key. The
inverse (`set_model_shape`) writes a model's shape back into the config."""
from __future__ import annotations

import dataclasses

from ..choices import ATTN_IMPLS, choose
from . import Config, ConfigError
from ..model_args import MOE_SCORES, PRESETS, ROPE_TYPES, ModelArgs

# model.moe.<key> -> ModelArgs field
MOE_KEYS = {"num_experts": "num_experts", "top_k": "top_k", "ffn_dim": "moe_ffn_dim",
            "shared_experts": "shared_experts", "capacity_factor": "capacity_factor", "every": "moe_every",
            "first_dense": "moe_first_dense", "aux_loss_coef": "aux_loss_coef", "score": "moe_score",
            "bias_update_rate": "bias_update_rate", "n_group": "n_group", "topk_group": "topk_group",
            "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
            "seq_aux_loss_coef": "seq_aux_loss_coef"}
# model.rope_scaling.<key> -> ModelArgs field
ROPE_KEYS = {"type": "rope_type", "factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
             "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_seq_len",
             "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
             "mscale_all_dim": "rope_mscale_all_dim"}
# model.<key> -> ModelArgs field where the names differ
RENAMED_KEYS = {"head_dim": "explicit_head_dim"}
SUBSECTIONS = {"moe": MOE_KEYS, "rope_scaling": ROPE_KEYS}


def model_changes(m) -> dict:
    """ModelArgs fields set by a model config section (None = the preset's value)."""
    changes = {f.name: getattr(m, f.name) for f in dataclasses.fields(ModelArgs)
               if hasattr(m, f.name) and getattr(m, f.name) is not None}
    changes.update({field: getattr(m, key) for key, field in RENAMED_KEYS.items() if getattr(m, key) is not None})
    for section, keys in SUBSECTIONS.items():
        sub = getattr(m, section)
        changes.update({field: getattr(sub, key) for key, field in keys.items() if getattr(sub, key) is not None})
    return changes


def model_args(cfg: Config) -> ModelArgs:
    """The preset with the model section's overrides (model.moe.*, model.rope_scaling.* included), checked."""
    m = cfg.model
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset '{m.preset}' (known: {', '.join(PRESETS)})")
    base = PRESETS[m.preset]
    changes = model_changes(m)
    if m.init_from:
        base = _hf_base(m.init_from, changes)
    cp_impl = cfg.parallel.cp_impl if cfg.parallel.cp > 1 else None
    rows = {None: "own", "ulysses": "all"}.get(cp_impl, "local")
    args = dataclasses.replace(base, **changes, attn_kernel=attn_kernel(cfg), mask_rows=rows)
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
                "vocab_multiple"):
        if getattr(args, key) < 1:
            raise ConfigError(f"model.{key}: must be positive, got {getattr(args, key)}")
    if args.explicit_head_dim < 0:
        raise ConfigError(f"model.head_dim: must be >= 0, got {args.explicit_head_dim}")
    if not args.explicit_head_dim and args.dim % args.n_heads:
        raise ConfigError(f"model.n_heads: {args.n_heads} does not divide model.dim {args.dim}")
    if args.head_dim % 2:
        raise ConfigError(f"model.n_heads: head_dim {args.head_dim} must be even for RoPE")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {args.n_kv_heads} does not divide model.n_heads {args.n_heads}")
    _check_mla(args)
    _check_rope(args)
    _check_moe(args, m.moe)
    return args


def attn_kernel(cfg: Config) -> str:
    """model.attn_impl resolved. A dense boolean mask takes SDPA off its flash kernels, so auto is
    flex wherever SDPA would be handed one: under a document mask (without CP, or under Ulysses, whose
    core attends the whole sequence), and under all-gather context parallelism (its queries sit at
    zig-zag positions: even its causal mask is a [S/cp, S] tensor); otherwise SDPA's causal kernels.
    Flex is refused under the ring, which runs attention over key/value blocks of its own
    (docs/data.md); under Ulysses without documents it has no mask to use (SDPA's causal kernel runs)."""
    impl = cfg.model.attn_impl
    choose(impl, ATTN_IMPLS, "model.attn_impl", ConfigError)
    cp_impl = cfg.parallel.cp_impl if cfg.parallel.cp > 1 else None
    if impl == "flex" and cp_impl == "ring":
        raise ConfigError("model.attn_impl: flex is not available with parallel.cp_impl = ring (the ring "
                          "runs its own attention); use allgather or ulysses, sdpa or auto")
    if impl == "auto":
        return "flex" if cp_impl == "allgather" or (cfg.data.document_mask and cp_impl != "ring") else "sdpa"
    return impl


def _check_rope(args: ModelArgs) -> None:
    key = "model.rope_scaling"
    if args.rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.type: '{args.rope_type}' is not one of {', '.join(ROPE_TYPES)}")
    if args.rope_type != "default" and args.rope_factor <= 0:
        raise ConfigError(f"{key}.factor: must be > 0, got {args.rope_factor}")
    if args.rope_type == "yarn":
        for k in ("beta_fast", "beta_slow"):
            if not getattr(args, f"rope_{k}") > 0:
                raise ConfigError(f"{key}.{k}: must be > 0, got {getattr(args, f'rope_{k}')}")
        for k in ("mscale", "mscale_all_dim"):
            if getattr(args, f"rope_{k}") < 0:
                raise ConfigError(f"{key}.{k}: must be >= 0 (0 = unset), got {getattr(args, f'rope_{k}')}")
    if args.rope_type == "llama3" and not 0 < args.rope_low_freq_factor < args.rope_high_freq_factor:
        raise ConfigError(f"{key}.low_freq_factor: need 0 < low_freq_factor < high_freq_factor, got "
                          f"{args.rope_low_freq_factor} and {args.rope_high_freq_factor}")
    if args.rope_type in ("llama3", "yarn") and args.rope_original_max_seq_len < 1:
        raise ConfigError(f"{key}.original_max_position_embeddings: must be positive, got "
                          f"{args.rope_original_max_seq_len}")


MLA_KEYS = ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _check_mla(args: ModelArgs) -> None:
    for key in ("kv_lora_rank", *MLA_KEYS, "mtp_depth"):
        if getattr(args, key) < 0:
            raise ConfigError(f"model.{key}: must be >= 0, got {getattr(args, key)}")
    if not args.mla:
        extra = [k for k in MLA_KEYS if getattr(args, k)]
        if extra:
            raise ConfigError(f"model.{extra[0]}: set without multi-head latent attention (model.kv_lora_rank = 0)")
        return
    for key in ("qk_rope_head_dim", "v_head_dim"):
        if getattr(args, key) < 1:
            raise ConfigError(f"model.{key}: multi-head latent attention needs it > 0 (model.kv_lora_rank > 0)")
    if args.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim: {args.qk_rope_head_dim} must be even for RoPE")


def _check_moe(args: ModelArgs, given) -> None:
    if args.num_experts < 0:
        raise ConfigError(f"model.moe.num_experts: must be >= 0, got {args.num_experts}")
    if not args.moe:
        extra = [k for k in MOE_KEYS if k != "num_experts" and getattr(given, k) is not None]
        if extra:
            raise ConfigError(f"model.moe.{extra[0]}: set on a dense model (model.moe.num_experts = 0)")
        return
    if not 1 <= args.top_k <= args.num_experts:
        raise ConfigError(f"model.moe.top_k: {args.top_k} must be between 1 and num_experts {args.num_experts}")
    for key in ("ffn_dim", "shared_experts", "first_dense"):
        if getattr(args, MOE_KEYS[key]) < 0:
            raise ConfigError(f"model.moe.{key}: must be >= 0, got {getattr(args, MOE_KEYS[key])}")
    if args.moe_every < 1:
        raise ConfigError(f"model.moe.every: must be >= 1, got {args.moe_every}")
    if args.aux_loss_coef < 0:
        raise ConfigError(f"model.moe.aux_loss_coef: must be >= 0, got {args.aux_loss_coef}")
    if args.n_moe_blocks == 0:
        raise ConfigError(f"model.moe.first_dense: {args.moe_first_dense} leaves no MoE block in "
                          f"{args.n_layers} layers")
    _check_routing(args)


def _check_routing(args: ModelArgs) -> None:
    """DeepSeek-V3 routing keys (model/moe.py)."""
    if args.moe_score not in MOE_SCORES:
        raise ConfigError(f"model.moe.score: '{args.moe_score}' is not one of {', '.join(MOE_SCORES)}")
    for key in ("bias_update_rate", "seq_aux_loss_coef"):
        if getattr(args, key) < 0:
            raise ConfigError(f"model.moe.{key}: must be >= 0, got {getattr(args, key)}")
    if not args.routed_scaling_factor > 0:
        raise ConfigError(f"model.moe.routed_scaling_factor: must be > 0, got {args.routed_scaling_factor}")
    E, groups, best = args.num_experts, args.n_group, args.topk_group
    if groups < 1 or E % groups:
        raise ConfigError(f"model.moe.n_group: {groups} does not divide model.moe.num_experts {E}")
    if not 1 <= best <= groups:
        raise ConfigError(f"model.moe.topk_group: {best} must be between 1 and model.moe.n_group {groups}")
    if args.top_k > best * (E // groups):
        raise ConfigError(f"model.moe.top_k: {args.top_k} is more than the {best * (E // groups)} experts of the "
                          f"{best} chosen groups (model.moe.topk_group × num_experts / n_group)")


# Keys a config may set on top of a Hugging Face model's shape (they change no weight).
HF_FREE_KEYS = ("max_seq_len", "vocab_multiple", "capacity_factor", "aux_loss_coef", "seq_aux_loss_coef")
_CONFIG_KEY = {field: key for key, field in RENAMED_KEYS.items()} | {
    field: f"{section}.{key}" for section, keys in SUBSECTIONS.items() for key, field in keys.items()}


def _hf_base(init_from: str, changes: dict) -> ModelArgs:
    """The shape of the `model.init_from` model; explicit model keys must agree with it."""
    from ..hf_config import args_from_hf
    if not init_from.startswith("hf:") or len(init_from) == 3:
        raise ConfigError(f"model.init_from: expected 'hf:DIR', got '{init_from}'")
    try:
        base = args_from_hf(init_from[3:])
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    # the balancing rate changes no weight where the checkpoint carries the bias (sigmoid routing)
    free = HF_FREE_KEYS + (("bias_update_rate",) if base.moe_score == "sigmoid" else ())
    for key, value in changes.items():
        if key not in free and getattr(base, key) != value:
            raise ConfigError(f"model.{_CONFIG_KEY.get(key, key)}: {value} differs from {init_from[3:]}/config.json "
                              f"({getattr(base, key)}); leave it out to use the Hugging Face model's shape")
    return base


def pin_model_shape(cfg: Config) -> None:
    """Write the model.init_from model's shape into the config, so the run directory's config.toml
    (and every checkpoint's meta.json) describe the model without the Hugging Face directory."""
    if cfg.model.init_from:
        set_model_shape(cfg, model_args(cfg))


def set_model_shape(cfg: Config, args: ModelArgs) -> None:
    """Set every model key the config leaves to the preset to `args`' value (model.moe.* and
    model.rope_scaling.* included), so the config alone describes `args`."""
    m = cfg.model
    for f in dataclasses.fields(ModelArgs):
        if hasattr(m, f.name) and getattr(m, f.name) is None:
            setattr(m, f.name, getattr(args, f.name))
    for key, field in RENAMED_KEYS.items():
        if getattr(m, key) is None:
            setattr(m, key, getattr(args, field))
    for section, keys in SUBSECTIONS.items():
        sub = getattr(m, section)
        for key, field in keys.items():
            if getattr(sub, key) is None and (args.moe or section != "moe" or key == "num_experts"):
                setattr(sub, key, getattr(args, field))  # a dense model sets no other model.moe key


def check_export(cfg: Config, args: ModelArgs) -> None:
    """checkpoint.export_hf: what convert.to_hf refuses for this model, refused before any step."""
    if cfg.checkpoint.export_hf != "":
        from ..hf_config import family_for
        try:
            family_for(args)
        except ValueError as e:
            raise ConfigError(f"checkpoint.export_hf: {e}") from None
