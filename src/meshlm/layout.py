"""Resolve a config against a world size: the mesh degrees and the batch split, and the checks that
need both (degrees against the model shape and each other). A section's own keys are checked beside
them (config.py, `Config.check`); the model arguments come from model/from_config.py."""
from __future__ import annotations

from dataclasses import dataclass

from .config import Config, ConfigError, LayoutError, resolve_auto
from .model.args import ModelArgs
from .model.from_config import check_export, model_args


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



def batch_split(p, t, world: int, flag: str = "--nproc") -> tuple[int, int]:
    """(dp, accumulation count) of `world` ranks, or a ConfigError naming the key. Shared with the
    planner, whose `flag` is --gpus."""
    inner = p.pp * p.cp * p.tp
    if world % inner:
        raise LayoutError(f"parallel: pp×cp×tp = {inner} does not divide the world size {world}")
    dp = world // inner if p.dp == -1 else p.dp
    if dp < 1:
        raise LayoutError(f"parallel.dp: must be >= 1 or -1, got {p.dp}")
    if dp * inner != world:
        raise LayoutError(f"{flag}: {world} ranks but the layout pp×dp×cp×tp = "
                          f"{p.pp}×{dp}×{p.cp}×{p.tp} needs {dp * inner}")
    if t.micro_batch < 1 or t.global_batch < 1:
        raise LayoutError("training.micro_batch: batch sizes must be >= 1")
    if t.global_batch % (t.micro_batch * dp):
        raise LayoutError(f"training.global_batch: {t.global_batch} is not divisible by "
                          f"micro_batch×dp = {t.micro_batch}×{dp}")
    accum = t.global_batch // (t.micro_batch * dp)
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


def check_cp(args: ModelArgs, cp: int, impl: str, tp: int, sp: bool, seq_len: int) -> None:
    """Context parallelism against the sequence and the heads (shared with the planner). Ring and
    allgather cut each sequence in 2·cp chunks (zig-zag); Ulysses in cp, and splits each TP rank's heads
    over cp."""
    if cp == 1:
        return
    zigzag = impl != "ulysses"
    chunks = 2 * cp if zigzag else cp
    if seq_len % chunks:
        raise ConfigError(f"data.seq_len: {seq_len} is not divisible by {chunks} "
                          f"({f'2×cp: {impl} attention holds 2 chunks per rank' if zigzag else 'cp'})")
    if sp and tp > 1 and (seq_len // cp) % tp:
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
    p, t = cfg.parallel, cfg.training
    args = model_args(cfg)
    cfg.check()
    if world_size < 1:
        raise LayoutError(f"--nproc: must be >= 1, got {world_size}")
    dp, accum = batch_split(p, t, world_size)
    microbatches = accum
    group = p.zero_group or dp
    if dp % group:
        raise LayoutError(f"parallel.zero_group: {group} does not divide dp {dp}")
    dp_shard = group if p.zero else 1
    check_shape(args, p.tp, p.pp, p.pp_virtual)
    # sp splits the sequence over the tp group; at tp = 1 it is a no-op (docs/tensor_parallel.md)
    if p.sp and p.tp > 1 and cfg.data.seq_len % p.tp:
        raise LayoutError(f"parallel.sp: data.seq_len {cfg.data.seq_len} is not divisible by tp {p.tp}")
    check_cp(args, p.cp, p.cp_impl, p.tp, p.sp, cfg.data.seq_len)
    check_ep(args, p.ep, dp, dp_shard, p.cp, p.zero)
    check_fp8(cfg, args)
    check_mtp(cfg, args)
    zpp_group = check_zeropp(p, dp_shard * p.cp)
    if p.pp > 1 or p.pp_virtual > 1 or p.pp_layers:
        _check_pipeline(cfg, args, microbatches)
    check_export(cfg, args)
    return Layout(pp=p.pp, dp_replicate=dp // dp_shard, dp_shard=dp_shard, cp=p.cp, tp=p.tp,
                  micro_batch=t.micro_batch, accum=accum, microbatches=microbatches, ep=p.ep, zpp_group=zpp_group)


def check_fp8(cfg: Config, args: ModelArgs) -> None:
    """training.precision = "fp8" (parallel/features/float8.py) against the install, the model, the layout and the
    device; torch is imported only to ask the GPU its compute capability."""
    t = cfg.training
    if t.precision != "fp8":
        return
    import importlib.util
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("training.precision: fp8 needs torchao's float8 training (pip install meshlm[gpu])")
    if args.moe:
        raise ConfigError("training.precision: fp8 is not available for mixture-of-experts models: torchao's "
                          "float8 training converts nn.Linear, not the experts' grouped GEMMs; use bf16")
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


def check_zeropp(p, shard: int) -> int:
    """ZeRO++ keys against the stage and the shard group (size `shard` = dp_shard × cp); the group size
    its hpZ copies and qgZ's intra level use (0: ZeRO++ off). Shared with the planner."""
    on = [k for k in ("quantize_weights", "quantize_grads") if getattr(p, k)] + (["hpz_group"] if p.hpz_group else [])
    if p.hpz_group < 0:
        raise LayoutError(f"parallel.hpz_group: must be >= 0 (0 = off), got {p.hpz_group}")
    if not on:
        return 0
    if p.zero != 3:
        raise LayoutError(f"parallel.{on[0]}: ZeRO++ works on sharded parameters (zero = 3), got zero = {p.zero}")
    if p.ep > 1:
        raise LayoutError(f"parallel.{on[0]}: ZeRO++ with expert parallelism (ep > 1) is not available yet")
    if p.offload == "nvme":
        raise LayoutError(f"parallel.{on[0]}: ZeRO++ with nvme offload is not available yet")
    if p.hpz_group and shard % p.hpz_group:
        raise LayoutError(f"parallel.hpz_group: {p.hpz_group} does not divide the shard group size {shard} "
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
        raise LayoutError("parallel.ep: expert parallelism needs a mixture-of-experts model (model.moe.num_experts > 0)")
    if args.num_experts % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide model.moe.num_experts {args.num_experts}")
    if (dp * cp) % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide dp×cp = {dp * cp}")
    if zero and (dp_shard * cp) % ep:
        raise LayoutError(f"parallel.ep: {ep} does not divide the ZeRO shard group × cp = {dp_shard * cp} "
                          f"(parallel.zero_group)")


def _check_pipeline(cfg: Config, args: ModelArgs, microbatches: int) -> None:
    """Schedule, chunks and the stage split (schedule/stage.py), as one-line ConfigErrors."""
    from .schedule.stage import stage_blocks
    try:
        stage_blocks(args, cfg.parallel, microbatches)
    except ValueError as e:
        raise LayoutError(str(e)) from None
