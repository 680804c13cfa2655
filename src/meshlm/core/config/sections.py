"""The configuration's sections: one dataclass each, with the keys' defaults and the section's own checks.

Each section checks its own keys (`check`, beside the keys it checks; `Config.check` runs them all);
what depends on the world size or the model shape is checked by layout.build_layout. Every check runs in the
parent process before any worker starts, so a bad run fails with one line naming the key and the reason.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields

from ..cards import device_groups
from ..choices import (AC_MODES, CATCHABLE_SIGNALS, CP_IMPLS, ELASTIC, EXPORT_DTYPES, FP8_COMMS, FP8_RECIPES, OFFLOAD, ON_ERROR,
                       OPTIMIZERS, OUTER_QUANTIZE, PP_SCHEDULES, PRECISIONS, REDUCE_DTYPES, SPIKE_ACTIONS, ZERO_STAGES)
from ..facts.course import check_ramp_keys, check_schedule
from .energy import EnergyConfig
from ..errors import ConfigError, LayoutError, check_choice  # noqa: F401  (LayoutError: the package exports it from here)

@dataclass
class MoEConfig:
    """Mixture-of-experts keys; None = the preset's value (core/model_args.py: ModelArgs' MoE fields)."""
    num_experts: int | None = None
    top_k: int | None = None
    ffn_dim: int | None = None            # one routed expert's hidden size (default: model.ffn_dim)
    shared_experts: int | None = None
    capacity_factor: float | None = None  # <= 0: dropless
    every: int | None = None              # every k-th block is MoE
    first_dense: int | None = None        # leading dense blocks
    aux_loss_coef: float | None = None
    # DeepSeek-V3 routing (docs/deepseek_v3.md)
    score: str | None = None              # softmax, sigmoid
    bias_update_rate: float | None = None  # > 0: auxiliary-loss-free balancing (per-expert selection bias)
    n_group: int | None = None            # group-limited routing: experts in n_group groups ...
    topk_group: int | None = None         # ... a token picks from its best topk_group of them
    routed_scaling_factor: float | None = None
    norm_topk_prob: bool | None = None    # renormalise the top-k gate weights to sum to one
    seq_aux_loss_coef: float | None = None  # DeepSeek-V3's sequence-wise balance loss


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling, named as in a transformers config.json; None = the preset's value."""
    type: str | None = None                 # default, linear, llama3, yarn
    factor: float | None = None
    low_freq_factor: float | None = None    # llama3 only
    high_freq_factor: float | None = None   # llama3 only
    original_max_position_embeddings: int | None = None  # llama3, yarn: the pretraining context
    beta_fast: float | None = None          # yarn only
    beta_slow: float | None = None          # yarn only
    mscale: float | None = None             # yarn only (0: unset)
    mscale_all_dim: float | None = None     # yarn only (0: unset; MLA's softmax scale)


@dataclass
class ModelConfig:
    preset: str = "tiny"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    tie_embeddings: bool | None = None
    norm_eps: float | None = None
    head_dim: int | None = None       # None / 0: dim // n_heads
    qkv_bias: bool | None = None      # biases on q/k/v (Qwen2)
    qk_norm: bool | None = None       # per-head q/k RMSNorm (Qwen3)
    # multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0 (docs/deepseek_v3.md)
    q_lora_rank: int | None = None    # 0: a plain wq
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    mtp_depth: int | None = None      # DeepSeek-V3 multi-token-prediction modules
    vocab_multiple: int = 128  # embedding/head rows padded to a multiple of this × tp; 1: no padding
    init_from: str = ""  # "hf:DIR": start from a Hugging Face model (shape from its config.json)
    attn_impl: str = "auto"  # auto: flex with data.document_mask or cp_impl = allgather, else sdpa (choices.ATTN_IMPLS)
    moe: MoEConfig = field(default_factory=MoEConfig)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)


@dataclass
class DataConfig:
    path: str = ""  # empty: the embedded corpus (stdlib sources, byte tokenizer)
    # several prepared sets with weights instead of `path`: [["web/", 0.7], ["code/", 0.3]] (docs/data.md)
    mix: list[list] = field(default_factory=list)
    tokenizer: str = "bytes"
    seq_len: int = 256
    document_mask: bool = False  # attention never crosses a document boundary inside a window

    def check(self, cfg: Config) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len: must be >= 1, got {self.seq_len}")
        if self.document_mask and cfg.parallel.cp > 1 and cfg.parallel.cp_impl == "ring":
            raise ConfigError("data.document_mask: not available with context parallelism (cp > 1) and "
                              "parallel.cp_impl = ring: its core takes no mask; use parallel.cp_impl = "
                              "allgather or ulysses")
        if self.mix and self.path:
            raise ConfigError("data.mix: give data.path or data.mix, not both")

    def check_files(self) -> None:
        """Missing data or an unreadable tokenizer (the files, not only the keys): before workers start."""
        for key, path in [("data.path", self.path)] * bool(self.path) + [("data.mix", p) for p, _ in self.mix]:
            if not os.path.exists(path):
                raise ConfigError(f"{key}: no such directory: {path}")
            if not os.path.isfile(os.path.join(path, "index.json")):
                raise ConfigError(f"{key}: {path} has no index.json (run `meshlm prepare` first)")
        if self.tokenizer != "bytes":
            if not os.path.isfile(self.tokenizer):
                raise ConfigError(f"data.tokenizer: cannot read tokenizer file {self.tokenizer}")
            try:
                from tokenizers import Tokenizer
                Tokenizer.from_file(self.tokenizer)
            except Exception as e:  # noqa: BLE001 - any failure means unusable
                raise ConfigError(f"data.tokenizer: cannot read tokenizer {self.tokenizer}: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


@dataclass
class ParallelConfig:
    dp: int = -1  # -1: the ranks left over
    zero: int = 0
    zero_group: int = 0  # 0: = dp (plain ZeRO); g < dp: HSDP
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_layers: list[int] = field(default_factory=list)  # blocks per stage; empty: balanced by cost
    microbatches: int = 0  # 0: the gradient-accumulation count
    cp: int = 1
    cp_impl: str = "ring"
    ep: int = 1
    offload: str = "none"  # optimizer: state in host memory; nvme: in files under offload_dir (docs/zero.md)
    offload_dir: str = ""  # offload = "nvme": per-rank state files go to offload_dir/rank{r} (scratch)
    offload_buffer_mb: float = 64.0  # offload = "nvme": host buffer the step streams the state through
    # ZeRO++ on zero = 3 (docs/zero.md): int8 weight gathers (qwZ), a secondary shard over hpz_group ranks
    # that backward re-gathers from (hpZ), int8 hierarchical gradient reduce-scatter (qgZ)
    quantize_weights: bool = False
    hpz_group: int = 0  # 0: off; K: blocks of K consecutive ranks of the shard group (a node)
    quantize_grads: bool = False
    bucket_mb: float = 25.0
    reduce_dtype: str = "fp32"
    timeout_s: float = 300.0
    heartbeat_s: float = 30.0  # a rank silent this long is lost: every rank fails at once (0: off)
    auto: bool = False  # the planner picks every key above and training.micro_batch / ac (plan/search/auto.py)
    elastic: str = "fail"  # after a resize: "fail" if the layout does not fit the new world, "replan"
    dp_weights: list[int] = field(default_factory=list)  # per dp replica: uneven batch split; empty: equal
    # a mixed cluster: the card type of each node group in rank order, "TYPE:COUNT[/NODE]" (docs/heterogeneous.md);
    # empty: one type. The form is checked here; the names, the count and the TP groups by plan/cluster.py
    devices: list[str] = field(default_factory=list)
    islands: int = 1  # DiLoCo islands, the mesh's outermost dimension (training.outer; docs/diloco.md)

    def check(self, cfg: Config) -> None:
        """The keys alone; the degrees against the world and the model: layout.build_layout."""
        check_choice(self.pp_schedule, PP_SCHEDULES, "parallel.pp_schedule")
        check_choice(self.offload, OFFLOAD, "parallel.offload")
        check_choice(self.reduce_dtype, REDUCE_DTYPES, "parallel.reduce_dtype")
        check_choice(self.cp_impl, CP_IMPLS, "parallel.cp_impl")
        for key in ("tp", "pp", "cp", "ep", "pp_virtual"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key}: must be >= 1, got {getattr(self, key)}")
        check_choice(self.zero, ZERO_STAGES, "parallel.zero")
        if self.offload != "none" and self.zero < 1:
            raise ConfigError(f"parallel.offload: {self.offload} offload needs a ZeRO stage that shards the "
                              f"optimizer (zero >= 1)")
        if self.offload == "nvme" and not self.offload_dir:
            raise ConfigError('parallel.offload_dir: offload = "nvme" needs a directory for the optimizer state files')
        if self.offload == "nvme" and not self.offload_buffer_mb > 0:
            raise ConfigError(f"parallel.offload_buffer_mb: must be > 0, got {self.offload_buffer_mb}")
        if not self.bucket_mb > 0:  # the DP gradient buckets and Muon's tp exchange are cut by it
            raise ConfigError(f"parallel.bucket_mb: must be > 0, got {self.bucket_mb}")
        if self.zero_group and self.zero == 0:
            raise ConfigError("parallel.zero_group: HSDP groups need a ZeRO stage (zero >= 1)")
        check_choice(self.elastic, ELASTIC, "parallel.elastic")
        if any(w < 1 for w in self.dp_weights):
            raise ConfigError(f"parallel.dp_weights: every weight must be a positive integer, got {self.dp_weights}")
        if self.dp_weights and (self.auto or self.elastic == "replan"):  # weights name a fixed set of replicas
            raise ConfigError(f"parallel.dp_weights: not with {'parallel.auto' if self.auto else 'parallel.elastic = replan'}"
                              f" (the planner chooses equal replicas)")
        try:
            device_groups(self.devices)
        except ValueError as e:
            raise ConfigError(f"parallel.devices: {e}") from None
        if self.devices and self.islands > 1:
            raise ConfigError("parallel.devices: not with parallel.islands > 1 (a mixed cluster is planned and "
                              "checked as one island)")
        if self.devices and self.auto:
            raise ConfigError("parallel.devices: not with parallel.auto (the search prices one device type; "
                              "meshlm plan --gpu TYPE:COUNT,... plans a mixed cluster)")
        _check_islands(self)
        hb = self.heartbeat_s
        if hb < 0 or 0 < hb < 3:
            raise ConfigError(f"parallel.heartbeat_s: must be 0 (off) or >= 3 s (stamps go out every second), "
                              f"got {hb}")


def _check_islands(p: ParallelConfig) -> None:
    """parallel.islands against the modes it cannot serve (docs/diloco.md, "Bad input")."""
    if p.islands < 1:
        raise ConfigError(f"parallel.islands: must be >= 1, got {p.islands}")
    if p.islands == 1:
        return
    why = {"parallel.offload = nvme (the outer step reads and writes the fp32 masters in memory)": p.offload == "nvme",
           "parallel.elastic = replan (the planner knows no islands)": p.elastic == "replan",
           "parallel.auto (the planner knows no islands)": p.auto,
           "parallel.dp_weights (each island reads an equal share of the global batch)": bool(p.dp_weights)}
    for reason, on in why.items():
        if on:
            raise ConfigError(f"parallel.islands: {p.islands} islands not with {reason}")


@dataclass
class OuterConfig:
    """DiLoCo's outer optimizer (parallel.islands > 1; docs/diloco.md): Nesterov SGD on the islands' mean pseudo-gradient."""
    sync_every: int = 100  # H: inner steps between outer syncs of one fragment
    lr: float = 0.7
    momentum: float = 0.9  # Nesterov
    fragments: int = 1  # streaming DiLoCo: K fragments of contiguous blocks, staggered by H/K steps
    quantize: str = "none"  # the outer gradients on the wire: none (fp32), bf16, fp8, int8 (with scales)
    # stop: one job, a lost rank fails it (restart it with fewer islands); continue: each island its own
    # job, the others go on without a lost one, which rejoins at their next sync (docs/diloco.md)
    on_island_loss: str = "stop"
    # streaming DiLoCo's overlap (torchft's fragment_sync_delay / fragment_update_alpha): a fragment's average
    # travels during the next `delay` inner steps, then lands as masters = alpha·masters + (1 − alpha)·θ_outer
    delay: int = 0
    alpha: float = 0.0

    def check(self, cfg: Config) -> None:
        if self.sync_every < 1:
            raise ConfigError(f"training.outer.sync_every: must be >= 1, got {self.sync_every}")
        if not self.lr > 0:
            raise ConfigError(f"training.outer.lr: must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"training.outer.momentum: must be in [0, 1), got {self.momentum}")
        if self.fragments < 1 or self.sync_every % self.fragments:
            raise ConfigError(f"training.outer.fragments: must be >= 1 and divide training.outer.sync_every "
                              f"{self.sync_every} (fragment k syncs at step k·H/K mod H), got {self.fragments}")
        check_choice(self.quantize, OUTER_QUANTIZE, "training.outer.quantize")
        check_choice(self.on_island_loss, ("stop", "continue"), "training.outer.on_island_loss")
        if not 0 <= self.delay < self.sync_every:
            raise ConfigError(f"training.outer.delay: must be in [0, sync_every {self.sync_every}) (a fragment's "
                              f"average lands before its next sync starts), got {self.delay}")
        if not 0 <= self.alpha < 1:
            raise ConfigError(f"training.outer.alpha: must be in [0, 1), got {self.alpha}")
        if self.delay and self.on_island_loss == "continue":
            raise ConfigError("training.outer.delay: not with on_island_loss = continue (a round over the island "
                              "link applies when it commits)")


@dataclass
class TrainingConfig:
    steps: int = 1200
    global_batch: int = 8
    micro_batch: int = 8
    precision: str = "auto"  # auto: bf16 (fp32 masters) on a GPU with bf16, fp32 on a CPU (apply_device)
    fp8_recipe: str = "tensorwise"  # precision = "fp8": torchao's float8 scaling (tensorwise, rowwise)
    fp8_emulate: bool = False  # precision = "fp8" where torch has no float8 kernel: torchao's emulation (docs/fp8.md)
    # precision = "fp8": the collectives that move float8 (ZeRO-3's weight gather, SP's activation
    # all-gather, EP's dispatch); an entry the layout does not have is left out (docs/fp8.md)
    fp8_comm: list[str] = field(default_factory=lambda: list(FP8_COMMS))
    ac: str = "none"
    seed: int = 0
    clip: float = 1.0
    compile: bool | str = "auto"  # auto: on for CUDA, off for a CPU (apply_device)
    eval_every: int = 250
    eval_batches: int = 4
    device: str = "auto"  # auto, cpu, cuda
    peak_tflops: float = 0.0  # peak per device behind MFU; 0: datasheet (GPU) or measured (CPU)
    spike_zscore: float = 0.0  # > 0: a loss / grad norm this many σ above the window is a spike (train/resilience/spike.py)
    spike_window: int = 100  # steps the spike statistics look back over
    spike_action: str = "skip"  # skip (drop the update) or rollback (newest checkpoint before it)
    loss_chunks: int = 0  # > 0: output head + loss over this many token chunks, logits never whole
    mtp_loss_weight: float = 0.3  # λ of the MTP loss (model.mtp_depth > 0; DeepSeek-V3's first 10T tokens)
    z_loss: float = 0.0  # > 0: adds z·mean(log²Z) of the main head's softmax normaliser (docs/training.md)
    # [start, increment, over]: Megatron's --rampup-batch-size (core/facts/ramp.py); empty: a fixed batch
    batch_rampup: list[int] = field(default_factory=list)

    outer: OuterConfig = field(default_factory=OuterConfig)  # DiLoCo (parallel.islands > 1)
    energy: EnergyConfig = field(default_factory=EnergyConfig)  # when to train (core/config/energy.py)

    def check(self, cfg: Config) -> None:
        check_device_keys(self)
        check_ramp_keys(self.batch_rampup, self.global_batch, cfg)
        self.outer.check(cfg)
        self.energy.check(cfg)
        check_choice(self.fp8_recipe, FP8_RECIPES, "training.fp8_recipe")
        for entry in self.fp8_comm:
            check_choice(entry, FP8_COMMS, "training.fp8_comm")
        check_choice(self.ac, AC_MODES, "training.ac")
        if self.steps < 0:
            raise ConfigError(f"training.steps: must be >= 0, got {self.steps}")
        if self.peak_tflops < 0:
            raise ConfigError(f"training.peak_tflops: must be >= 0 (0 = datasheet or measured), got {self.peak_tflops}")
        # loss spikes (docs/fault_tolerance.md)
        if self.spike_zscore < 0:
            raise ConfigError(f"training.spike_zscore: must be >= 0 (0 = off), got {self.spike_zscore}")
        if self.spike_window < 2:
            raise ConfigError(f"training.spike_window: must be >= 2 steps, got {self.spike_window}")
        check_choice(self.spike_action, SPIKE_ACTIONS, "training.spike_action")
        if self.spike_zscore and self.spike_action == "rollback" and not cfg.checkpoint.every:
            raise ConfigError('training.spike_action: "rollback" needs checkpoints (set checkpoint.every)')
        if self.loss_chunks < 0:
            raise ConfigError(f"training.loss_chunks: must be >= 0 (0 = whole logits), got {self.loss_chunks}")
        if self.mtp_loss_weight < 0:
            raise ConfigError(f"training.mtp_loss_weight: must be >= 0, got {self.mtp_loss_weight}")
        if not self.z_loss >= 0:  # NaN too
            raise ConfigError(f"training.z_loss: must be >= 0 (0 = off), got {self.z_loss}")


@dataclass
class OptimConfig:
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    name: str = "adamw"  # adamw, or muon: Muon on the blocks' matrices, AdamW on the rest (docs/muon.md)
    muon_lr: float = 0.0  # 0: optim.lr (the update is scaled to AdamW's RMS, so one rate serves both)
    muon_momentum: float = 0.95  # Nesterov momentum of the Muon parameters
    muon_ns_steps: int = 5  # quintic Newton-Schulz iterations
    # the LR schedule after warmup (core/facts/course.py lr_at, docs/training.md): cosine, wsd, constant, linear
    schedule: str = "cosine"
    decay_steps: float = 0.0  # wsd: N >= 1 steps, or a fraction in (0, 1) of training.steps; 0: 0.2
    decay_type: str = "linear"  # wsd: the decay's shape (linear, sqrt, cosine)
    anneal_steps: int = 0  # > 0 with checkpoint.resume PATH: decay over N steps from that checkpoint's step

    def check(self, cfg: Config) -> None:
        check_choice(self.name, OPTIMIZERS, "optim.name")
        check_schedule(self, cfg)
        if self.muon_lr < 0:
            raise ConfigError(f"optim.muon_lr: must be >= 0 (0 = optim.lr), got {self.muon_lr}")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"optim.muon_momentum: must be in [0, 1), got {self.muon_momentum}")
        if self.muon_ns_steps < 1:
            raise ConfigError(f"optim.muon_ns_steps: must be >= 1, got {self.muon_ns_steps}")
        if self.name == "muon":
            p = cfg.parallel
            if p.offload != "none":
                raise ConfigError("optim.name: muon runs without optimizer offload (parallel.offload = none)")


@dataclass
class CheckpointConfig:
    every: int | str = 0  # steps between checkpoints, 0: never, "auto": Young/Daly from mtbf_hours
    keep: int = 2
    async_: bool = False
    resume: str = "auto"  # auto, never, or a path
    mtbf_hours: float = 0.0  # the job's mean time between failures (for every = "auto")
    export_hf: int | str = ""  # "": off, "end": a transformers directory after the last step, N: also every N steps
    export_dtype: str = "bf16"  # bf16 or fp32: the dtype of the exported safetensors
    on_error: str = "stop"  # a save or export that fails (a full disk): stop (exit 1) or continue (retry when next due)
    on_signal: list[str] = field(default_factory=lambda: ["SIGTERM"])  # signals that save and stop (preemption)

    def check(self, cfg: Config) -> None:
        if isinstance(self.every, str):
            if self.every != "auto":
                raise ConfigError(f"checkpoint.every: expected a step count or \"auto\", got '{self.every}'")
            if not self.mtbf_hours or self.mtbf_hours <= 0:
                raise ConfigError("checkpoint.mtbf_hours: checkpoint.every = \"auto\" needs the job's mean time "
                                  "between failures in hours (> 0)")
        elif self.every < 0:
            raise ConfigError(f"checkpoint.every: must be >= 0 or \"auto\", got {self.every}")
        if self.mtbf_hours < 0:
            raise ConfigError(f"checkpoint.mtbf_hours: must be >= 0, got {self.mtbf_hours}")
        if isinstance(self.export_hf, str) and self.export_hf not in ("", "end") or \
                not isinstance(self.export_hf, str) and self.export_hf < 1:
            raise ConfigError(f"checkpoint.export_hf: expected \"\" (off), \"end\" or a step count >= 1, "
                              f"got '{self.export_hf}'")
        check_choice(self.export_dtype, EXPORT_DTYPES, "checkpoint.export_dtype")
        check_choice(self.on_error, ON_ERROR, "checkpoint.on_error")
        for name in self.on_signal:
            if name not in CATCHABLE_SIGNALS:
                raise ConfigError(f"checkpoint.on_signal: '{name}' is not a signal a process can catch "
                                  f"(e.g. SIGTERM, SIGUSR1)")


@dataclass
class MetricsConfig:
    every: int = 1
    tensorboard: bool = False
    progress: bool = True
    straggler_factor: float = 1.5  # a rank this many times slower than the median step is a straggler
    straggler_steps: int = 3  # consecutive logged steps before it is named (0: off)
    profile_step: int = 0  # N > 0: rank 0 profiles step N into RUN_DIR/profile.json (--calibrate reads it)
    wandb: bool = False  # also log to Weights & Biases (train/observe/wandb_sink.py; WANDB_MODE=offline works)
    wandb_project: str = "meshlm"
    wandb_run: str = ""  # run name; empty: the run directory's name
    wandb_entity: str = ""  # team or user; empty: wandb's default

    def check(self, cfg: Config) -> None:
        if not self.straggler_factor > 1:
            raise ConfigError(f"metrics.straggler_factor: must be > 1, got {self.straggler_factor}")
        if self.straggler_steps < 0:
            raise ConfigError(f"metrics.straggler_steps: must be >= 0 (0 = off), got {self.straggler_steps}")
        if not 0 <= self.profile_step <= cfg.training.steps:  # train/observe/metrics.StepProfiler
            raise ConfigError(f"metrics.profile_step: expected 0 (off) or a step in 1..{cfg.training.steps}, got "
                              f"{self.profile_step}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def check(self) -> None:
        """Every section's own checks (the model section's: model.from_config.model_args)."""
        for f in fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "check"):
                section.check(self)


AUTO = "auto"


def check_device_keys(t: TrainingConfig) -> None:
    """training.precision / compile: an explicit value or "auto" (apply_device turns it into one)."""
    check_choice(t.precision, (AUTO, *PRECISIONS), "training.precision")
    if t.compile not in (True, False, AUTO):
        raise ConfigError(f"training.compile: expected true, false or auto, got {t.compile!r}")


def apply_device(cfg: Config, cuda: bool, bf16: bool = True) -> Config:
    """Replace training.precision / compile = "auto" by this device's values, in place (a new
    training section, so copies that share the old one keep theirs): bf16 with fp32 masters and
    compiled blocks on a GPU (fp32 on one without bf16), fp32 eager on a CPU; and model.attn_impl =
    "auto" by sdpa on a CPU (on a GPU it stays auto: flex where a mask is). Explicit values stay.
    Training resolves for its own device (distributed/mesh.py device_defaults), the planner for the
    device it prices (plan/spec.py priced_on)."""
    t = cfg.training
    check_device_keys(t)
    precision = ("bf16" if cuda and bf16 else "fp32") if t.precision == AUTO else t.precision
    cfg.training = dataclasses.replace(t, precision=precision, compile=cuda if t.compile == AUTO else t.compile)
    if not cuda and cfg.model.attn_impl == AUTO:
        # model.attn_impl: on a CPU flex fuses only its forward (the backward is SDPA's math), so SDPA with a
        # dense mask is the faster kernel there (docs/benchmarks.md, "Attention kernels by device"); on CUDA "auto"
        # stays and model.from_config.attn_kernel picks flex where a mask is, as measured faster
        cfg.model = dataclasses.replace(cfg.model, attn_impl="sdpa")
    return cfg
