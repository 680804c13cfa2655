"""Resolve a config into a concrete layout and refuse impossible ones before any worker starts."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .choices import AC_MODES, CP_IMPLS, OFFLOAD, PP_SCHEDULES, PRECISIONS, REDUCE_DTYPES, ZERO_STAGES, choose
from .config import Config, ConfigError, resolve_auto
from .model.args import PRESETS, ModelArgs


# Dimensions whose runtime has not landed yet: refused with the issue that brings them.
NOT_YET: dict[str, str] = {
}

# model.moe.<key> -> ModelArgs field
MOE_KEYS = {"num_experts": "num_experts", "top_k": "top_k", "ffn_dim": "moe_ffn_dim",
            "shared_experts": "shared_experts", "capacity_factor": "capacity_factor", "every": "moe_every",
            "first_dense": "moe_first_dense", "aux_loss_coef": "aux_loss_coef"}
# model.rope_scaling.<key> -> ModelArgs field
ROPE_KEYS = {"type": "rope_type", "factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
             "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_seq_len"}
# model.<key> -> ModelArgs field where the names differ
RENAMED_KEYS = {"head_dim": "explicit_head_dim"}
SUBSECTIONS = {"moe": MOE_KEYS, "rope_scaling": ROPE_KEYS}
ROPE_TYPES = ("default", "linear", "llama3")  # model/llama.py's rope_frequencies


@dataclass(frozen=True)
class Layout:
    """Degrees of the 5-D mesh (outermost first) and the batch split they imply."""
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    micro_batch: int
    accum: int  # micro-batches per optimizer step on each dp rank
    microbatches: int  # pipeline micro-batches per step (= accum unless set)
    ep: int = 1  # expert parallelism: a second view of the dp×cp ranks (distributed/mesh.py)
    zpp_group: int = 0  # ZeRO++: ranks per group of the shard group (hpZ, qgZ's intra level); 0: off

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def shape(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                "cp": self.cp, "tp": self.tp, "ep": self.ep, **({"zpp": self.zpp_group} if self.zpp_group else {})}


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
    args = dataclasses.replace(base, **changes)
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
    _check_rope(args)
    _check_moe(args, m.moe)
    return args


def _check_rope(args: ModelArgs) -> None:
    key = "model.rope_scaling"
    if args.rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.type: '{args.rope_type}' is not one of {', '.join(ROPE_TYPES)}")
    if args.rope_type != "default" and args.rope_factor <= 0:
        raise ConfigError(f"{key}.factor: must be > 0, got {args.rope_factor}")
    if args.rope_type == "llama3":
        if not 0 < args.rope_low_freq_factor < args.rope_high_freq_factor:
            raise ConfigError(f"{key}.low_freq_factor: need 0 < low_freq_factor < high_freq_factor, got "
                              f"{args.rope_low_freq_factor} and {args.rope_high_freq_factor}")
        if args.rope_original_max_seq_len < 1:
            raise ConfigError(f"{key}.original_max_position_embeddings: must be positive, got "
                              f"{args.rope_original_max_seq_len}")


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


# Keys a config may set on top of a Hugging Face model's shape (they change no weight).
HF_FREE_KEYS = ("max_seq_len", "vocab_multiple", "capacity_factor", "aux_loss_coef")
_CONFIG_KEY = {field: key for key, field in RENAMED_KEYS.items()} | {
    field: f"{section}.{key}" for section, keys in SUBSECTIONS.items() for key, field in keys.items()}


def _hf_base(init_from: str, changes: dict) -> ModelArgs:
    """The shape of the `model.init_from` model; explicit model keys must agree with it."""
    from .model.hf_config import args_from_hf
    if not init_from.startswith("hf:") or len(init_from) == 3:
        raise ConfigError(f"model.init_from: expected 'hf:DIR', got '{init_from}'")
    try:
        base = args_from_hf(init_from[3:])
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    for key, value in changes.items():
        if key not in HF_FREE_KEYS and getattr(base, key) != value:
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


def check_checkpoint_keys(cfg: Config) -> None:
    c = cfg.checkpoint
    if isinstance(c.every, str):
        if c.every != "auto":
            raise ConfigError(f"checkpoint.every: expected a step count or \"auto\", got '{c.every}'")
        if not c.mtbf_hours or c.mtbf_hours <= 0:
            raise ConfigError("checkpoint.mtbf_hours: checkpoint.every = \"auto\" needs the job's mean time "
                              "between failures in hours (> 0)")
    elif c.every < 0:
        raise ConfigError(f"checkpoint.every: must be >= 0 or \"auto\", got {c.every}")
    if c.mtbf_hours < 0:
        raise ConfigError(f"checkpoint.mtbf_hours: must be >= 0, got {c.mtbf_hours}")
    if isinstance(c.export_hf, str) and c.export_hf not in ("", "end") or \
            not isinstance(c.export_hf, str) and c.export_hf < 1:
        raise ConfigError(f"checkpoint.export_hf: expected \"\" (off), \"end\" or a step count >= 1, "
                          f"got '{c.export_hf}'")
    _choice(c.export_dtype, ("bf16", "fp32"), "checkpoint.export_dtype")


def check_fault_keys(cfg: Config) -> None:
    """Loss spikes, stragglers, elastic resizes (docs/fault_tolerance.md)."""
    t, m = cfg.training, cfg.metrics
    if t.spike_zscore < 0:
        raise ConfigError(f"training.spike_zscore: must be >= 0 (0 = off), got {t.spike_zscore}")
    if t.spike_window < 2:
        raise ConfigError(f"training.spike_window: must be >= 2 steps, got {t.spike_window}")
    _choice(t.spike_action, SPIKE_ACTIONS, "training.spike_action")
    if t.spike_zscore and t.spike_action == "rollback" and not cfg.checkpoint.every:
        raise ConfigError('training.spike_action: "rollback" needs checkpoints (set checkpoint.every)')
    if not m.straggler_factor > 1:
        raise ConfigError(f"metrics.straggler_factor: must be > 1, got {m.straggler_factor}")
    if m.straggler_steps < 0:
        raise ConfigError(f"metrics.straggler_steps: must be >= 0 (0 = off), got {m.straggler_steps}")
    _choice(cfg.parallel.elastic, ELASTIC, "parallel.elastic")
    hb = cfg.parallel.heartbeat_s
    if hb < 0 or 0 < hb < 3:
        raise ConfigError(f"parallel.heartbeat_s: must be 0 (off) or >= 3 s (stamps go out every second), got {hb}")


SPIKE_ACTIONS = ("skip", "rollback")
ELASTIC = ("fail", "replan")


def _choice(value, allowed, key: str) -> None:
    choose(value, allowed, key, ConfigError)


def batch_split(p, t, world: int, flag: str = "--nproc") -> tuple[int, int]:
    """(dp, accumulation count) of `world` ranks, or a ConfigError naming the key. Shared with the
    planner, whose `flag` is --gpus."""
    inner = p.pp * p.cp * p.tp
    if world % inner:
        raise ConfigError(f"parallel: pp×cp×tp = {inner} does not divide the world size {world}")
    dp = world // inner if p.dp == -1 else p.dp
    if dp < 1:
        raise ConfigError(f"parallel.dp: must be >= 1 or -1, got {p.dp}")
    if dp * inner != world:
        raise ConfigError(f"{flag}: {world} ranks but the layout pp×dp×cp×tp = "
                          f"{p.pp}×{dp}×{p.cp}×{p.tp} needs {dp * inner}")
    if t.micro_batch < 1 or t.global_batch < 1:
        raise ConfigError("training.micro_batch: batch sizes must be >= 1")
    if t.global_batch % (t.micro_batch * dp):
        raise ConfigError(f"training.global_batch: {t.global_batch} is not divisible by "
                          f"micro_batch×dp = {t.micro_batch}×{dp}")
    accum = t.global_batch // (t.micro_batch * dp)
    if p.microbatches and p.microbatches != accum:
        raise ConfigError(f"parallel.microbatches: {p.microbatches} must equal the accumulation count "
                          f"global_batch/(micro_batch×dp) = {accum}")
    return dp, accum


def check_shape(args: ModelArgs, tp: int, pp: int, pp_virtual: int) -> None:
    """The model shape against the tp and pp degrees (shared with the planner)."""
    if args.n_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide model.n_heads {args.n_heads}")
    if args.n_kv_heads % tp and tp % args.n_kv_heads:
        raise ConfigError(f"parallel.tp: {tp} and model.n_kv_heads {args.n_kv_heads} do not divide one another")
    if args.ffn_dim % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide model.ffn_dim {args.ffn_dim}")
    if args.moe and args.expert_dim % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide model.moe.ffn_dim {args.expert_dim}")
    if args.n_layers < pp * pp_virtual:
        raise ConfigError(f"parallel.pp: {args.n_layers} layers cannot fill pp×pp_virtual = {pp * pp_virtual} stages")


def check_cp(args: ModelArgs, cp: int, impl: str, tp: int, sp: bool, seq_len: int) -> None:
    """Context parallelism against the sequence and the heads (shared with the planner). Ring cuts each
    sequence in 2·cp chunks (zig-zag); Ulysses in cp, and splits each TP rank's heads over cp."""
    if cp == 1:
        return
    chunks = 2 * cp if impl == "ring" else cp
    if seq_len % chunks:
        raise ConfigError(f"data.seq_len: {seq_len} is not divisible by {chunks} "
                          f"({'2×cp: ring attention holds 2 chunks per rank' if impl == 'ring' else 'cp'})")
    if sp and tp > 1 and (seq_len // cp) % tp:
        raise ConfigError(f"parallel.sp: each CP rank's {seq_len // cp} tokens are not divisible by tp {tp}")
    if impl == "ulysses":
        heads, kv = args.n_heads // tp, max(1, args.n_kv_heads // tp)
        if heads % cp:
            raise ConfigError(f"parallel.cp: ulysses splits the {heads} heads per TP rank over cp = {cp}; "
                              f"cp does not divide them")
        if kv % cp and cp % kv:
            raise ConfigError(f"model.n_kv_heads: ulysses needs the {kv} kv heads per TP rank and cp = {cp} "
                              f"to divide one another")


def device_defaults(cfg: Config) -> Config:
    """training.precision / compile = "auto" resolved for the device training.device names (in place):
    a CUDA device, with or without bf16, or a CPU. A GPU job resolves on every rank, each for its own."""
    t = cfg.training
    if "auto" not in (t.precision, t.compile):  # nothing to probe (still checked)
        return resolve_auto(cfg, False)
    import torch
    kind = t.device
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    bf16 = cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return resolve_auto(cfg, cuda, bf16)


def resolve(cfg: Config, world_size: int) -> Layout:
    """The layout for `world_size` ranks, or a ConfigError naming the offending key.

    With parallel.auto the planner chooses the layout first: callers go through plan.auto.resolve,
    which writes the choice into `cfg` and then calls this (layout sits below plan: docs/architecture.md)."""
    device_defaults(cfg)
    p, t, tr = cfg.parallel, cfg.training, cfg.model
    args = model_args(cfg)
    _choice(t.precision, PRECISIONS, "training.precision")
    _choice(t.ac, AC_MODES, "training.ac")
    _choice(p.pp_schedule, PP_SCHEDULES, "parallel.pp_schedule")
    _choice(p.offload, OFFLOAD, "parallel.offload")
    _choice(p.reduce_dtype, REDUCE_DTYPES, "parallel.reduce_dtype")
    _choice(p.cp_impl, CP_IMPLS, "parallel.cp_impl")
    for key in ("tp", "pp", "cp", "ep", "pp_virtual"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}: must be >= 1, got {getattr(p, key)}")
    _choice(p.zero, ZERO_STAGES, "parallel.zero")
    if p.offload != "none" and p.zero < 1:
        raise ConfigError(f"parallel.offload: {p.offload} offload needs a ZeRO stage that shards the optimizer (zero >= 1)")
    if p.offload == "nvme" and not p.offload_dir:
        raise ConfigError('parallel.offload_dir: offload = "nvme" needs a directory for the optimizer state files')
    if p.offload == "nvme" and not p.offload_buffer_mb > 0:
        raise ConfigError(f"parallel.offload_buffer_mb: must be > 0, got {p.offload_buffer_mb}")
    if world_size < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {world_size}")
    dp, accum = batch_split(p, t, world_size)
    microbatches = accum
    group = p.zero_group or dp
    if dp % group:
        raise ConfigError(f"parallel.zero_group: {group} does not divide dp {dp}")
    if p.zero_group and p.zero == 0:
        raise ConfigError("parallel.zero_group: HSDP groups need a ZeRO stage (zero >= 1)")
    dp_shard = group if p.zero else 1
    check_shape(args, p.tp, p.pp, p.pp_virtual)
    # sp splits the sequence over the tp group; at tp = 1 it is a no-op (docs/tensor_parallel.md)
    if p.sp and p.tp > 1 and cfg.data.seq_len % p.tp:
        raise ConfigError(f"parallel.sp: data.seq_len {cfg.data.seq_len} is not divisible by tp {p.tp}")
    check_cp(args, p.cp, p.cp_impl, p.tp, p.sp, cfg.data.seq_len)
    check_ep(args, p.ep, dp, dp_shard, p.cp, p.zero)
    zpp_group = check_zeropp(p, dp_shard * p.cp)
    if cfg.data.seq_len < 1:
        raise ConfigError(f"data.seq_len: must be >= 1, got {cfg.data.seq_len}")
    if cfg.data.document_mask and p.cp > 1:
        raise ConfigError("data.document_mask: not available with context parallelism (cp > 1) yet: the ring "
                          "and Ulysses cores take no mask")
    if cfg.data.mix and cfg.data.path:
        raise ConfigError("data.mix: give data.path or data.mix, not both")
    if p.pp > 1 or p.pp_virtual > 1 or p.pp_layers:
        _check_pipeline(cfg, args, microbatches)
    if t.steps < 0:
        raise ConfigError(f"training.steps: must be >= 0, got {t.steps}")
    if t.peak_tflops < 0:
        raise ConfigError(f"training.peak_tflops: must be >= 0 (0 = datasheet or measured), got {t.peak_tflops}")
    if not 0 <= cfg.metrics.profile_step <= t.steps:  # train/metrics.StepProfiler
        raise ConfigError(f"metrics.profile_step: expected 0 (off) or a step in 1..{t.steps}, got "
                          f"{cfg.metrics.profile_step}")
    check_checkpoint_keys(cfg)
    check_fault_keys(cfg)
    if cfg.checkpoint.export_hf != "":  # what convert.to_hf refuses, refused before any step
        from .model.hf_config import family_for
        try:
            family_for(args)
        except ValueError as e:
            raise ConfigError(f"checkpoint.export_hf: {e}") from None
    for key, label in NOT_YET.items():
        value = getattr(p, key)
        if value > (0 if key == "zero" else 1):
            raise ConfigError(f"parallel.{key}: {label} is not available in this build yet")
    del tr
    return Layout(pp=p.pp, dp_replicate=dp // dp_shard, dp_shard=dp_shard, cp=p.cp, tp=p.tp,
                  micro_batch=t.micro_batch, accum=accum, microbatches=microbatches, ep=p.ep, zpp_group=zpp_group)


def check_zeropp(p, shard: int) -> int:
    """ZeRO++ keys against the stage and the shard group (size `shard` = dp_shard × cp); the group size
    its hpZ copies and qgZ's intra level use (0: ZeRO++ off). Shared with the planner."""
    on = [k for k in ("quantize_weights", "quantize_grads") if getattr(p, k)] + (["hpz_group"] if p.hpz_group else [])
    if p.hpz_group < 0:
        raise ConfigError(f"parallel.hpz_group: must be >= 0 (0 = off), got {p.hpz_group}")
    if not on:
        return 0
    if p.zero != 3:
        raise ConfigError(f"parallel.{on[0]}: ZeRO++ works on sharded parameters (zero = 3), got zero = {p.zero}")
    if p.ep > 1:
        raise ConfigError(f"parallel.{on[0]}: ZeRO++ with expert parallelism (ep > 1) is not available yet")
    if p.offload == "nvme":
        raise ConfigError(f"parallel.{on[0]}: ZeRO++ with nvme offload is not available yet")
    if p.hpz_group and shard % p.hpz_group:
        raise ConfigError(f"parallel.hpz_group: {p.hpz_group} does not divide the shard group size {shard} "
                          f"(dp_shard × cp)")
    return p.hpz_group or shard


def check_ep(args: ModelArgs, ep: int, dp: int, dp_shard: int, cp: int, zero: int) -> None:
    """Expert parallelism against the model and the dp×cp block it borrows its ranks from (shared with
    the planner). With ZeRO the experts' shard group lies inside one HSDP shard group: ep | dp_shard×cp."""
    if args.moe and cp > 1 and args.capacity_factor > 0:  # each cp rank routes only its chunks
        raise ConfigError("model.moe.capacity_factor: capacity dropping with context parallelism is not "
                          "supported (each cp rank holds part of the micro-batch); use a dropless model (<= 0)")
    if ep == 1:
        return
    if not args.moe:
        raise ConfigError("parallel.ep: expert parallelism needs a mixture-of-experts model (model.moe.num_experts > 0)")
    if args.num_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide model.moe.num_experts {args.num_experts}")
    if (dp * cp) % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide dp×cp = {dp * cp}")
    if zero and (dp_shard * cp) % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide the ZeRO shard group × cp = {dp_shard * cp} "
                          f"(parallel.zero_group)")


def _check_pipeline(cfg: Config, args: ModelArgs, microbatches: int) -> None:
    """Schedule, chunks and the stage split (schedule/stage.py), as one-line ConfigErrors."""
    from .schedule.stage import stage_blocks
    try:
        stage_blocks(args, cfg, microbatches)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_data(cfg: Config) -> None:
    """Missing data, an unreadable tokenizer or Hugging Face weights that do not match their
    config.json (headers only): refused before workers start."""
    if cfg.model.init_from:
        from .model.hf import HFWeights
        try:
            HFWeights(cfg.model.init_from[3:]).check(model_args(cfg))
        except ValueError as e:
            raise ConfigError(f"model.init_from: {e}") from None
    for key, path in [("data.path", cfg.data.path)] * bool(cfg.data.path) + [("data.mix", p) for p, _ in cfg.data.mix]:
        if not os.path.exists(path):
            raise ConfigError(f"{key}: no such directory: {path}")
        if not os.path.isfile(os.path.join(path, "index.json")):
            raise ConfigError(f"{key}: {path} has no index.json (run `meshlm prepare` first)")
    if cfg.data.tokenizer != "bytes":
        if not os.path.isfile(cfg.data.tokenizer):
            raise ConfigError(f"data.tokenizer: cannot read tokenizer file {cfg.data.tokenizer}")
        try:
            from tokenizers import Tokenizer
            Tokenizer.from_file(cfg.data.tokenizer)
        except Exception as e:  # noqa: BLE001 - any failure means unusable
            raise ConfigError(f"data.tokenizer: cannot read tokenizer {cfg.data.tokenizer}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
