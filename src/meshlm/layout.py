"""Resolve a config against a world size: the mesh degrees and the batch split (`Layout`), and the checks
that need both (degrees against the model shape and each other). A section's own keys are checked beside
them (config/sections.py, `Config.check`); the model arguments come from model/from_config.py."""
from __future__ import annotations

from dataclasses import dataclass

from .config import Config, ConfigError, LayoutError, resolve_auto
from .data.rampup import BatchRamp
from .model.args import ModelArgs
from .model.from_config import check_export, model_args


@dataclass(frozen=True)
class Layout:
    """The degrees of a run and the batch split they imply: the one description of how the ranks share
    the work. The trainer resolves it from a config (`from_config`, `resolve`); the planner prices it
    (plan.spec.Spec is a Layout plus the planner's knobs). The mesh is pp × dp_replicate × dp_shard ×
    cp × tp, outermost first (distributed/mesh.py); ep is a second view of the dp×cp ranks; ZeRO
    shards over dp_shard × cp. Degrees are numbers here (dp = -1 is resolved); checks against the model
    are this module's functions (`check_shape`, `check_cp`, `check_ep`, `check_zeropp`)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0                   # ZeRO stage: 1 shards optimizer state, 2 also grads, 3 also params
    zero_group: int = 1             # dp ranks of one ZeRO shard group (= dp unless HSDP); unused at zero 0
    sp: bool = False                # sequence parallelism: on only where tp > 1 (`sp_enabled`)
    micro_batch: int = 1
    accum: int = 1                  # micro-batches per step on each dp rank (= pipeline micro-batches; dp_weights: the most)
    quantize_weights: bool = False  # ZeRO++ qwZ (docs/zero.md)
    hpz_group: int = 0              # ZeRO++ hpZ: secondary shards over this many ranks; 0: off
    quantize_grads: bool = False    # ZeRO++ qgZ
    dp_accums: tuple[int, ...] = ()  # parallel.dp_weights: micro-batches of each dp replica; (): `accum` each
    islands: int = 1                # DiLoCo islands, outside pp: each runs the layout above (docs/diloco.md)

    @property
    def world_size(self) -> int:
        return self.islands * self.pp * self.dp * self.cp * self.tp

    @property
    def dp_shard(self) -> int:
        """dp ranks one ZeRO shard group spans (1 without ZeRO: every dp rank holds everything)."""
        return self.zero_group if self.zero else 1

    @property
    def dp_replicate(self) -> int:
        """Copies of each shard over dp (HSDP replicas; plain data parallelism: dp)."""
        return self.dp // self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO shards over: dp_shard × cp (cp ranks hold the same weights); 1 without ZeRO."""
        return self.zero_group * self.cp if self.zero else 1

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per step: the accumulation count."""
        return self.accum

    @property
    def step_microbatches(self) -> int:
        """Micro-batches of one step over all dp replicas (the global batch in micro-batches)."""
        return sum(self.dp_accums) if self.dp_accums else self.accum * self.dp

    @property
    def mean_accum(self) -> float:
        """Micro-batches per replica on average: each replica scales its micro-batch losses by its
        inverse, so the dp average of the gradients is the mean over every micro-batch of the global
        batch (= `accum` exactly without dp_weights)."""
        return self.step_microbatches / self.dp

    def step_accum(self, batch: int) -> float:
        """`mean_accum` of a step of `batch` sequences (training.batch_rampup: each step's own)."""
        return batch / (self.micro_batch * self.dp)

    def accum_of(self, dp_rank: int) -> int:
        """Micro-batches replica `dp_rank` runs per step (docs/heterogeneous.md)."""
        return self.dp_accums[dp_rank] if self.dp_accums else self.accum

    @property
    def dp_pad_to(self) -> int:
        """Under dp_weights, the passes every replica runs where its collectives meet other replicas on
        every micro-batch (ZeRO-2/3's gathers and reduce-scatters; EP's all-to-alls when an ep group spans
        replicas): the longest count, the lighter ones padding (`Accumulation`); 0: each runs its own."""
        zero = self.zero >= 2 and self.zero_enabled
        return self.accum if self.dp_accums and (zero or self.cp % self.ep) else 0

    @property
    def dp_rows(self) -> tuple[int, ...]:
        """Sequences of each replica per step under dp_weights (replica r reads the r-th contiguous run
        of the global batch); () for the equal split."""
        return tuple(self.micro_batch * a for a in self.dp_accums)

    @property
    def global_batch(self) -> int:
        """Sequences of one step over every island (each island reads its own equal share, like dp)."""
        return self.micro_batch * self.step_microbatches * self.islands

    @property
    def zpp_group(self) -> int:
        """ZeRO++'s group inside the shard group (hpZ's secondary shards, qgZ's intra level); 0: off."""
        return (self.hpz_group or self.shard_group) if self.zeropp_enabled else 0

    # -- what runs: the predicates the trainer and the planner branch on (torchtitan's ParallelDims)
    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_cp_enabled(self) -> bool:
        """Gradients are reduced across ranks (dp × cp > 1: cp ranks hold the same weights)."""
        return self.dp * self.cp > 1

    @property
    def zero_enabled(self) -> bool:
        """ZeRO shards some state over more than one rank (zero >= 1 and shard_group > 1)."""
        return self.zero > 0 and self.shard_group > 1

    @property
    def zeropp_enabled(self) -> bool:
        return bool(self.quantize_weights or self.quantize_grads or self.hpz_group)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sp_enabled(self) -> bool:
        """Sequence parallelism splits the sequence over the tp group (a no-op at tp = 1)."""
        return self.sp and self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def shape(self) -> dict[str, int]:
        """The mesh's degrees by dimension name (distributed/mesh.py), with ZeRO++'s group when on."""
        return {**({"islands": self.islands} if self.islands > 1 else {}), "pp": self.pp,
                "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
                "ep": self.ep, **({"zpp": self.zpp_group} if self.zpp_group else {})}

    def check_groups(self) -> None:
        """The ZeRO shard group against dp (a LayoutError naming parallel.zero_group)."""
        if self.zero_group < 1 or self.dp % self.zero_group:
            raise LayoutError(f"parallel.zero_group: {self.zero_group} does not divide dp {self.dp}")


def from_config(cfg: Config, world: int | None = None, flag: str = "--nproc") -> Layout:
    """Config → Layout, the one place a config's parallel section becomes degrees: the batch split of
    `world` ranks (dp = -1 takes the ranks pp×cp×tp leave), or with `world` None the ranks the section
    itself fixes (a run's config.toml; dp = -1 counts one replica, or one per parallel.dp_weights).
    `flag` names the world in errors."""
    p, t = cfg.parallel, cfg.training
    if world is None:  # parallel.dp_weights names one weight per replica
        world = Layout(dp=p.dp if p.dp > 0 else max(len(p.dp_weights), 1), tp=p.tp, pp=p.pp, cp=p.cp,
                       islands=p.islands).world_size
    dp, accum = batch_split(p, t, world, flag)
    accums = weighted_accums(p.dp_weights, dp, t.global_batch, t.micro_batch)
    return Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero, zero_group=p.zero_group or dp,
                  sp=bool(p.sp), micro_batch=t.micro_batch, accum=max(accums, default=accum),
                  quantize_weights=bool(p.quantize_weights), hpz_group=p.hpz_group,
                  quantize_grads=bool(p.quantize_grads), dp_accums=accums, islands=getattr(p, "islands", 1))


def weighted_accums(weights: list[int], dp: int, global_batch: int, micro_batch: int) -> tuple[int, ...]:
    """Each replica's micro-batches per step under parallel.dp_weights (() without), or a ConfigError:
    the weights must split the global batch into whole micro-batches per replica."""
    if not weights:
        return ()
    if len(weights) != dp:
        raise LayoutError(f"parallel.dp_weights: {len(weights)} weights for dp = {dp} replicas (one per replica)")
    if min(weights) < 1:
        raise ConfigError(f"parallel.dp_weights: every weight must be a positive integer, got {list(weights)}")
    rows = [global_batch * w / sum(weights) for w in weights]
    if any(global_batch * w % (sum(weights) * micro_batch) for w in weights):
        raise LayoutError(f"parallel.dp_weights: {list(weights)} split training.global_batch {global_batch} into "
                          f"{', '.join(f'{r:g}' for r in rows)} sequences, not whole micro-batches of "
                          f"training.micro_batch {micro_batch} per replica")
    return tuple(global_batch * w // (sum(weights) * micro_batch) for w in weights)


def batch_split(p, t, world: int, flag: str = "--nproc") -> tuple[int, int]:
    """(dp, accumulation count) of `world` ranks, or a ConfigError naming the key. Shared with the
    planner, whose `flag` is --gpus."""
    islands = getattr(p, "islands", 1)
    if world % islands:
        raise LayoutError(f"parallel.islands: {islands} does not divide the world size {world}")
    inner = Layout(tp=p.tp, pp=p.pp, cp=p.cp, islands=islands).world_size
    if world % inner:
        raise LayoutError(f"parallel: {'islands×' * (islands > 1)}pp×cp×tp = {inner} does not divide the world "
                          f"size {world}")
    dp = world // inner if p.dp == -1 else p.dp
    if dp < 1:
        raise LayoutError(f"parallel.dp: must be >= 1 or -1, got {p.dp}")
    need = Layout(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, islands=islands).world_size
    if need != world:
        raise LayoutError(f"{flag}: {world} ranks but the layout {'islands×' * (islands > 1)}pp×dp×cp×tp = "
                          f"{f'{islands}×' * (islands > 1)}{p.pp}×{dp}×{p.cp}×{p.tp} needs {need}")
    if t.micro_batch < 1 or t.global_batch < 1:
        raise LayoutError("training.micro_batch: batch sizes must be >= 1")
    if getattr(p, "dp_weights", None):  # the uneven split is checked by `weighted_accums`
        return dp, t.global_batch // (t.micro_batch * dp)
    if t.global_batch % (t.micro_batch * dp * islands):
        raise LayoutError(f"training.global_batch: {t.global_batch} is not divisible by "
                          f"micro_batch×dp{'×islands' * (islands > 1)} = {t.micro_batch}×{dp}"
                          f"{f'×{islands}' * (islands > 1)}")
    accum = t.global_batch // (t.micro_batch * dp * islands)
    if p.microbatches and p.microbatches != accum:
        raise LayoutError(f"parallel.microbatches: {p.microbatches} must equal the accumulation count "
                          f"global_batch/(micro_batch×dp) = {accum}")
    return dp, accum


def check_shape(args: ModelArgs, tp: int, pp: int, pp_virtual: int) -> None:
    """The model shape against the tp and pp degrees (shared with the planner)."""
    if args.n_heads % tp:
        raise LayoutError(f"parallel.tp: {tp} does not divide model.n_heads {args.n_heads}")
    if args.n_kv_heads % tp and tp % args.n_kv_heads:
        raise LayoutError(f"parallel.tp: {tp} and model.n_kv_heads {args.n_kv_heads} do not divide one another")
    if args.ffn_dim % tp:
        raise LayoutError(f"parallel.tp: {tp} does not divide model.ffn_dim {args.ffn_dim}")
    if args.moe and args.expert_dim % tp:
        raise LayoutError(f"parallel.tp: {tp} does not divide model.moe.ffn_dim {args.expert_dim}")
    if args.n_layers < pp * pp_virtual:
        raise LayoutError(f"parallel.pp: {args.n_layers} layers cannot fill pp×pp_virtual = {pp * pp_virtual} stages")


def check_cp(args: ModelArgs, layout: Layout, impl: str, seq_len: int) -> None:
    """Context parallelism against the sequence and the heads (shared with the planner). Ring and
    allgather cut each sequence in 2·cp chunks (zig-zag); Ulysses in cp, and splits each TP rank's heads
    over cp."""
    if not layout.cp_enabled:
        return
    cp, tp = layout.cp, layout.tp
    zigzag = impl != "ulysses"
    chunks = 2 * cp if zigzag else cp
    if seq_len % chunks:
        raise ConfigError(f"data.seq_len: {seq_len} is not divisible by {chunks} "
                          f"({f'2×cp: {impl} attention holds 2 chunks per rank' if zigzag else 'cp'})")
    if layout.sp_enabled and (seq_len // cp) % tp:
        raise LayoutError(f"parallel.sp: each CP rank's {seq_len // cp} tokens are not divisible by tp {tp}")
    if zigzag and args.mla and args.v_head_dim > args.qk_head_dim:  # its k, v travel stacked (PaddedValues)
        raise ConfigError(f"parallel.cp_impl: {impl} moves k and v together; MLA's value heads "
                          f"(model.v_head_dim {args.v_head_dim}) wider than its query/key heads "
                          f"({args.qk_head_dim}) are not supported; use ulysses")
    if impl == "ulysses":
        heads, kv = args.n_heads // tp, max(1, args.n_kv_heads // tp)
        if heads % cp:
            raise LayoutError(f"parallel.cp: ulysses splits the {heads} heads per TP rank over cp = {cp}; "
                              f"cp does not divide them")
        if kv % cp and cp % kv:
            raise ConfigError(f"model.n_kv_heads: ulysses needs the {kv} kv heads per TP rank and cp = {cp} "
                              f"to divide one another")


def device_defaults(cfg: Config) -> Config:
    """training.precision / compile and model.attn_impl = "auto" resolved for the device training.device
    names (in place):
    a CUDA device, with or without bf16, or a CPU. A GPU job resolves on every rank, each for its own."""
    t = cfg.training
    if "auto" not in (t.precision, t.compile, cfg.model.attn_impl):  # nothing to probe (still checked)
        return resolve_auto(cfg, False)
    import torch
    kind = t.device
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    # bf16 support is asked only where it decides something (precision "auto")
    bf16 = t.precision == "auto" and cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return resolve_auto(cfg, cuda, bf16)


def resolve(cfg: Config, world_size: int) -> Layout:
    """The layout for `world_size` ranks, or a ConfigError naming the offending key.

    With parallel.auto the planner chooses the layout first: callers go through plan.auto.resolve,
    which writes the choice into `cfg` and then calls this (layout sits below plan: docs/architecture.md)."""
    device_defaults(cfg)
    p = cfg.parallel
    args = model_args(cfg)
    cfg.check()
    if world_size < 1:
        raise LayoutError(f"--nproc: must be >= 1, got {world_size}")
    layout = from_config(cfg, world_size)
    layout.check_groups()
    check_shape(args, p.tp, p.pp, p.pp_virtual)
    # sp splits the sequence over the tp group; at tp = 1 it is a no-op (docs/tensor_parallel.md)
    if layout.sp_enabled and cfg.data.seq_len % p.tp:
        raise LayoutError(f"parallel.sp: data.seq_len {cfg.data.seq_len} is not divisible by tp {p.tp}")
    check_cp(args, layout, p.cp_impl, cfg.data.seq_len)
    check_ep(args, layout)
    check_fp8(cfg, args)
    check_mtp(cfg, args)
    check_zeropp(layout, p.offload)
    check_dp_weights(cfg, args, layout)
    check_islands(cfg, args, layout)
    for m in check_rampup(cfg, layout):  # every step's micro-batch count (the pipeline runs each)
        if layout.pp_enabled or p.pp_virtual > 1 or p.pp_layers:
            _check_pipeline(cfg, args, m)
    check_export(cfg, args)
    return layout


def fp8_comm_in_use(precision: str, recipe: str, entries, layout: Layout) -> frozenset[str]:
    """The entries of training.fp8_comm a run uses (docs/fp8.md): an entry the layout lacks (no ZeRO-3
    shard group, no SP, ep = 1), ZeRO++ (whose gathers are its own: qwZ int8, hpZ) or, for "zero" and
    "sp", the rowwise recipe leaves it out. EP's dispatch scales each row whatever the recipe (the
    experts' GEMMs are row-wise: model/fp8_grouped.py). The runtime and the planner both ask this."""
    if precision != "fp8":
        return frozenset()
    used = {"ep"} if layout.ep_enabled else set()
    if recipe == "tensorwise":
        used |= {"zero"} if layout.zero == 3 and layout.shard_group > 1 and not layout.zeropp_enabled else set()
        used |= {"sp"} if layout.sp_enabled else set()
    return frozenset(set(entries) & used)


def check_fp8(cfg: Config, args: ModelArgs) -> None:
    """training.precision = "fp8" (parallel/features/float8.py) against the install, the model, the layout and the
    device; torch is imported only to ask the GPU its compute capability."""
    t = cfg.training
    if t.precision != "fp8":
        return
    import importlib.util
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("training.precision: fp8 needs torchao's float8 training (pip install meshlm[gpu])")
    if t.fp8_emulate:
        return
    hint = "(training.fp8_emulate = true runs torchao's emulation, for tests)"
    import torch
    if t.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError(f"training.precision: fp8 needs a GPU with float8 matmuls (compute capability >= 8.9), "
                          f"this run is on the CPU {hint}")
    if torch.cuda.get_device_capability() < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        raise ConfigError(f"training.precision: fp8 needs compute capability >= 8.9 (Ada, Hopper or newer); "
                          f"{torch.cuda.get_device_name()} has {cap} {hint}")
    if args.moe:  # the experts' float8 grouped GEMMs (model/fp8_grouped.py)
        if not hasattr(torch, "_scaled_grouped_mm"):
            raise ConfigError(f"training.precision: fp8 for mixture-of-experts models needs torch._scaled_grouped_mm "
                              f"for the experts' float8 grouped GEMMs; torch {torch.__version__} has none {hint}")
        if torch.cuda.get_device_capability() < (9, 0):
            raise ConfigError(f"training.precision: fp8 for mixture-of-experts models needs compute capability "
                              f">= 9.0 (torch._scaled_grouped_mm: Hopper or newer); {torch.cuda.get_device_name()} "
                              f"has {'.'.join(map(str, torch.cuda.get_device_capability()))} {hint}")


def check_mtp(cfg: Config, args: ModelArgs) -> None:
    """MTP modules (model.mtp_depth, parallel/features/mtp.py) against the sequence and the loss. Every
    pipeline schedule can place them: they go with the head, on the last stage."""
    if not args.mtp_depth or cfg.training.mtp_loss_weight == 0:
        return
    if cfg.data.seq_len <= args.mtp_depth:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} tokens leave no target {args.mtp_depth + 1} "
                          f"tokens ahead for model.mtp_depth = {args.mtp_depth}")
    p = cfg.parallel
    if cfg.training.loss_chunks and p.sp and p.tp > 1:
        raise ConfigError("training.loss_chunks: the chunked loss head takes a sequence-parallel shard, from "
                          "which the MTP loss cannot pick its positions; with model.mtp_depth > 0 and "
                          "parallel.sp use training.loss_chunks = 0")


def check_dp_weights(cfg: Config, args: ModelArgs, layout: Layout) -> None:
    """What uneven data parallelism does not combine with (docs/heterogeneous.md): parallel.microbatches
    (one count for all), and a replica's count that its pipeline schedule refuses. (parallel.auto and
    elastic replanning: ParallelConfig.check.)"""
    from .schedule.stage import stage_blocks
    p = cfg.parallel
    if not p.dp_weights:
        return
    if p.microbatches:
        raise LayoutError("parallel.dp_weights: not with parallel.microbatches (it sets one count for every replica)")
    if layout.pp_enabled:  # each replica's pipeline runs its own count (or the longest, padded)
        for r, m in enumerate(layout.dp_accums):
            try:
                stage_blocks(args, p, max(m, layout.dp_pad_to))
            except ValueError as e:
                raise LayoutError(f"parallel.dp_weights: replica {r} runs {m} micro-batches: {e}") from None


def check_rampup(cfg: Config, layout: Layout) -> list[int]:
    """Every batch size of training.batch_rampup split into whole micro-batches per dp replica (a
    LayoutError naming the first that is not: another dp or micro_batch may fit); returns each size's
    micro-batches per replica, the full batch's last (without a ramp: `layout.microbatches` alone)."""
    t = cfg.training
    if not t.batch_rampup:
        return [layout.microbatches]
    per_step, sizes = layout.micro_batch * layout.dp, BatchRamp(t.global_batch, t.batch_rampup).sizes()
    for size in sizes:
        if size % per_step:
            raise LayoutError(f"training.batch_rampup: a step of {size} sequences does not split into whole "
                              f"micro-batches of micro_batch×dp = {layout.micro_batch}×{layout.dp}")
    return [size // per_step for size in sizes]


def check_islands(cfg: Config, args: ModelArgs, layout: Layout) -> None:
    """DiLoCo's keys against the model and the job (docs/diloco.md): a fragment is a run of whole blocks,
    and a rollback would send one island back while the others go on."""
    o = cfg.training.outer
    if layout.islands > 1 and o.fragments > args.n_layers:
        raise ConfigError(f"training.outer.fragments: {o.fragments} fragments of {args.n_layers} blocks "
                          f"(each fragment holds whole blocks)")
    if layout.islands > 1 and cfg.training.spike_zscore and cfg.training.spike_action == "rollback":
        raise ConfigError("training.spike_action: rollback not with parallel.islands > 1 (one island's spike "
                          "would send it back while the others go on); use skip")


def check_zeropp(layout: Layout, offload: str) -> None:
    """ZeRO++ keys against the stage, the other degrees, parallel.offload and the shard group (dp_shard
    × cp). Shared with the planner."""
    on = [k for k in ("quantize_weights", "quantize_grads") if getattr(layout, k)] + \
        (["hpz_group"] if layout.hpz_group else [])
    if layout.hpz_group < 0:
        raise LayoutError(f"parallel.hpz_group: must be >= 0 (0 = off), got {layout.hpz_group}")
    if not on:
        return
    if layout.zero != 3:
        raise LayoutError(f"parallel.{on[0]}: ZeRO++ works on sharded parameters (zero = 3), got zero = {layout.zero}")
    if layout.ep_enabled:
        raise LayoutError(f"parallel.{on[0]}: ZeRO++ with expert parallelism (ep > 1) is not available yet")
    if offload == "nvme":
        raise LayoutError(f"parallel.{on[0]}: ZeRO++ with nvme offload is not available yet")
    if layout.hpz_group and layout.shard_group % layout.hpz_group:
        raise LayoutError(f"parallel.hpz_group: {layout.hpz_group} does not divide the shard group size "
                          f"{layout.shard_group} (dp_shard × cp)")


def check_ep(args: ModelArgs, layout: Layout) -> None:
    """Expert parallelism against the model and the dp×cp block it borrows its ranks from (shared with
    the planner). With ZeRO the experts' shard group lies inside one HSDP shard group: ep | dp_shard×cp."""
    if args.moe and layout.cp_enabled and args.capacity_factor > 0:  # each cp rank routes only its chunks
        raise ConfigError("model.moe.capacity_factor: capacity dropping with context parallelism is not "
                          "supported (each cp rank holds part of the micro-batch); use a dropless model (<= 0)")
    if not layout.ep_enabled:
        return
    ep = layout.ep
    if not args.moe:
        raise LayoutError("parallel.ep: expert parallelism needs a mixture-of-experts model (model.moe.num_experts > 0)")
    if args.num_experts % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide model.moe.num_experts {args.num_experts}")
    if (layout.dp * layout.cp) % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide dp×cp = {layout.dp * layout.cp}")
    if layout.zero and layout.shard_group % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide the ZeRO shard group × cp = {layout.shard_group} "
                          f"(parallel.zero_group)")


def _check_pipeline(cfg: Config, args: ModelArgs, microbatches: int) -> None:
    """Schedule, chunks and the stage split (schedule/stage.py), as one-line ConfigErrors."""
    from .schedule.stage import stage_blocks
    try:
        stage_blocks(args, cfg.parallel, microbatches)
    except ValueError as e:
        raise LayoutError(str(e)) from None
