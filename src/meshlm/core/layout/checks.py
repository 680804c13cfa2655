"""The checks that need the layout and the model shape together: degrees against the model, each
dimension and feature against the others (core/layout/build.py runs them, in order, before any worker)."""
from __future__ import annotations

from ..config import Config, ConfigError, LayoutError
from ..facts.ramp import BatchRamp
from ..model_args import ModelArgs
from .degrees import Layout


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


def check_fp8(cfg: Config, args: ModelArgs) -> None:
    """training.precision = "fp8" (parallel/features/float8.py) against the install: torchao must be there
    (asked without importing it). What the device can run (torch._scaled_mm, a GPU's compute capability,
    the experts' grouped GEMMs) is the runtime's to ask, before any worker starts: model/fp8_kernels.py
    `check_fp8_device`, called by preflight.py and `parallelize` (docs/fp8.md)."""
    import importlib.util
    if cfg.training.precision == "fp8" and importlib.util.find_spec("torchao") is None:
        raise ConfigError("training.precision: fp8 needs torchao's float8 training (pip install meshlm[gpu])")


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
    from ..schedule.stage import stage_blocks
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
    per_step, sizes = layout.micro_batch * layout.dp * layout.islands, BatchRamp(t.global_batch, t.batch_rampup).sizes()
    for size in sizes:
        if size % per_step:
            names, values = "micro_batch×dp", f"{layout.micro_batch}×{layout.dp}"
            if layout.islands > 1:
                names, values = names + "×islands", values + f"×{layout.islands}"
            raise LayoutError(f"training.batch_rampup: a step of {size} sequences does not split into whole "
                              f"micro-batches of {names} = {values}")
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


def check_pipeline(cfg: Config, args: ModelArgs, microbatches: int) -> None:
    """Schedule, chunks and the stage split (core/schedule/stage.py), as one-line ConfigErrors."""
    from ..schedule.stage import stage_blocks
    try:
        stage_blocks(args, cfg.parallel, microbatches)
    except ValueError as e:
        raise LayoutError(str(e)) from None
