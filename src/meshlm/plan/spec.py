"""What the planner plans for: a model shape and a layout (`Spec`), read from a meshlm Config.

A Spec is a `layout.Layout` (the degrees and the batch split, read from the config by the same
`layout.from_config` the trainer uses) plus the planner's knobs. The planner does its own checks
instead of calling `layout.build_layout`, because that also refuses dimensions whose runtime has not
landed yet, and the planner must reason about all of them; the checks of degrees against the model
they share are core/layout/degrees.py's. Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.choices import AC_MODES, CP_IMPLS, FP8_COMMS, OFFLOAD, PP_SCHEDULES as SCHEDULES, PRECISIONS, choose
from ..core.config import AUTO, Config, ConfigError, apply_device
from ..core.layout import Layout, check_cp, check_ep, check_shape, check_zeropp, from_config, model_args
from ..core import model_args as model_args_module

PLAN_PRECISIONS = tuple(dict.fromkeys(PRECISIONS + ("fp8",)))


class PlanError(ValueError):
    """An impossible layout or bad planner input; the message is one line naming the key."""


def presets() -> dict:
    return model_args_module.PRESETS


@dataclass(frozen=True)
class Shape:
    """A model: its ModelArgs (dense or MoE: core/model_args.py carries the MoE fields) and a name."""
    args: object  # meshlm.core.model_args.ModelArgs
    name: str = ""

    def __post_init__(self):  # hashed on every cache lookup of the search: compute it once
        object.__setattr__(self, "_hash", hash((self.args, self.name)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def moe(self) -> bool:
        return self.args.num_experts > 0

    @property
    def num_experts(self) -> int:
        return self.args.num_experts

    @property
    def top_k(self) -> int:
        return self.args.top_k

    @property
    def shared_experts(self) -> int:
        return self.args.shared_experts

    @property
    def capacity_factor(self) -> float:
        """Routed copies per token per expert slot: the capacity factor, or 1 (a balanced load) when
        dropless (the planner assumes balance; a skewed router needs more)."""
        cf = self.args.capacity_factor
        return cf if cf > 0 else 1.0

    def num_params(self) -> int:
        """Ψ: ModelArgs.num_params() (routed experts, router and shared experts included)."""
        return self.args.num_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (ModelArgs.flops_per_token; MoE counts only active experts)."""
        return self.args.flops_per_token(seq_len)


def shape_from_config(cfg: Config) -> Shape:
    """The model section as a Shape, with layout.model_args' checks."""
    return Shape(model_args(cfg), cfg.model.preset)


@dataclass(frozen=True)
class Spec(Layout):
    """One concrete layout the planner prices: a Layout (every degree resolved: dp, zero_group and the
    accumulation are numbers) plus the planner's knobs, the keys that change a price but not the mesh."""
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_layers: tuple = ()      # blocks per stage (parallel.pp_layers); () = the runtime's balanced split
    ac: str = "none"
    offload: str = "none"
    offload_buffer_mb: float = 64.0  # offload = "nvme": the host buffer the state streams through
    precision: str = "bf16"
    seq_len: int = 2048
    cp_impl: str = "ring"
    bucket_mb: float = 25.0
    reduce_dtype: str = "fp32"
    optim: str = "adamw"            # optim.name: "muon" adds plan/cost/muon.py's memory, time and traffic
    fp8_comm: tuple = FP8_COMMS     # training.fp8_comm: under fp8, the collectives moving float8 (tensorwise)

    @classmethod
    def of(cls, layout: Layout, **knobs) -> "Spec":
        """The Spec of `layout` with these knobs (the rest at their defaults)."""
        return cls(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(Layout)}, **knobs)

    def layout_dict(self) -> dict:
        """The parallel.* keys plus training.micro_batch / ac / precision, as `plan --json` shows them."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                "zero": self.zero, "zero_group": self.zero_group, "sp": self.sp,
                "pp_schedule": self.pp_schedule, "pp_virtual": self.pp_virtual, "pp_layers": list(self.pp_layers),
                "microbatches": self.accum, "cp_impl": self.cp_impl, "offload": self.offload,
                "micro_batch": self.micro_batch, "ac": self.ac, "precision": self.precision,
                "global_batch": self.global_batch, "seq_len": self.seq_len,
                "quantize_weights": self.quantize_weights, "hpz_group": self.hpz_group,
                "quantize_grads": self.quantize_grads}

    def short(self) -> str:
        s = f"tp{self.tp}{'+sp' if self.sp_enabled else ''} pp{self.pp} cp{self.cp} dp{self.dp}"
        if self.ep_enabled:
            s += f" ep{self.ep}"
        if self.zero:
            s += f" z{self.zero}" + (f"/g{self.zero_group}" if self.zero_group != self.dp else "")
        if self.pp_enabled:
            s += f" {self.pp_schedule}" + (f"v{self.pp_virtual}" if self.pp_virtual > 1 else "")
            if self.pp_layers:
                s += " layers" + "/".join(map(str, self.pp_layers))
        zpp = "".join(f" {n}" for n, on in (("qwZ", self.quantize_weights), (f"hpZ{self.hpz_group}", self.hpz_group),
                                               ("qgZ", self.quantize_grads)) if on)
        return (s + zpp + f" mb{self.micro_batch}x{self.accum} ac={self.ac}"
                + (" offload" if self.offload != "none" else ""))


def priced_on(cfg: Config, gpu: bool) -> Config:
    """A copy of cfg as the priced device trains it: training.precision / compile = "auto" resolved
    (config.apply_device) for a GPU (bf16, compiled) or a CPU (fp32, eager). Every entry that turns a
    config into a Spec and Options calls it first; spec_from_config and code_options refuse "auto"."""
    return apply_device(dataclasses.replace(cfg), cuda=gpu)


def _resolved(cfg: Config, key: str):
    """training.`key`, which must not be "auto" here: what it means depends on the priced device."""
    value = getattr(cfg.training, key)
    if value == AUTO:
        raise PlanError(f"training.{key}: \"auto\" is resolved for the priced device first (plan.spec.priced_on)")
    return value


# the parallel.* keys a search keeps as the config gives them: it chooses the degrees, not these
SEARCH_KNOBS = ("bucket_mb", "reduce_dtype", "offload_buffer_mb")


def search_knobs(cfg: Config) -> dict:
    """The config's SEARCH_KNOBS and training.fp8_comm, so that `meshlm plan --config` prices what
    `meshlm estimate` would."""
    return {**{k: getattr(cfg.parallel, k) for k in SEARCH_KNOBS}, "fp8_comm": tuple(cfg.training.fp8_comm)}


def spec_from_config(cfg: Config, world: int | None) -> Spec:
    """The layout a training config asks for on `world` GPUs (dp = -1 takes the ranks left over; None:
    the world its parallel.dp fixes, layout.from_config)."""
    p, t = cfg.parallel, cfg.training
    cfg.data.check(cfg)  # what the data section refuses (a document mask under a CP core without masks)
    cfg.optim.check(cfg)  # the schedule the run total prices (optim.schedule, decay_steps: core/facts/course.py)
    cfg.training.check(cfg)  # its batch ramp and the rest of the section, as meshlm train checks them
    for key in ("tp", "pp", "cp", "ep", "pp_virtual"):
        if getattr(p, key) < 1:
            raise PlanError(f"parallel.{key}: must be >= 1, got {getattr(p, key)}")
    if world is not None and world < 1:
        raise PlanError(f"--gpus: must be >= 1, got {world}")
    layout = from_config(cfg, world, flag="--gpus")
    if p.zero_group and p.zero == 0:
        raise PlanError("parallel.zero_group: HSDP groups need a ZeRO stage (zero >= 1)")
    return Spec.of(layout, pp_schedule=p.pp_schedule, pp_virtual=p.pp_virtual, pp_layers=tuple(p.pp_layers),
                   ac=t.ac, offload=p.offload, precision=_resolved(cfg, "precision"), seq_len=cfg.data.seq_len,
                   cp_impl=p.cp_impl, optim=cfg.optim.name, **search_knobs(cfg))


def attention_mask(document_mask: bool, attn_impl: str = "auto") -> str:
    """How the attention kernel masks without CP (ops.StageWork.attn_mask), as model.from_config.
    attn_kernel resolves the kernel: "auto" runs flex with a document mask and SDPA's causal kernels
    without; "sdpa" with a document mask passes SDPA a dense [B, 1, S, S] mask. A layout's own mask:
    `allgather_mask` (estimate applies it to all-gather CP layouts)."""
    if attn_impl == "flex" or (attn_impl == "auto" and document_mask):
        return "flex"
    return "dense" if document_mask else "causal"


def allgather_mask(attn_mask: str, attn_impl: str | None = "auto") -> str:
    """The mask kind of an all-gather CP layout, from the kind the model runs without CP. Its queries
    sit at zig-zag positions (parallel/dims/cp_allgather.py), so even causal attention is masked: auto and
    flex run a BlockMask over the rank's rows, "sdpa" hands SDPA a dense one, the document mask's rows
    ("dense") or without documents its causal rows ("rows": one mask for the whole batch). None: not
    meshlm's code (a published run): its causal kernel stays as given."""
    if attn_mask == "causal" and attn_impl is not None:
        return "rows" if attn_impl == "sdpa" else "flex"
    return attn_mask


def code_options(cfg: Config) -> dict:
    """The estimate.Options keys a config sets by how its code runs: compile, the attention's mask and
    kernel (data.document_mask, model.attn_impl) and the chunked loss (training.loss_chunks)."""
    impl = getattr(cfg.model, "attn_impl", "auto")
    if impl not in ("auto", "sdpa", "flex"):
        raise PlanError(f"model.attn_impl: expected auto, sdpa or flex, got {impl!r}")
    chunks = int(getattr(cfg.training, "loss_chunks", 0) or 0)
    if chunks < 0:
        raise PlanError(f"training.loss_chunks: must be >= 0 (0: off), got {chunks}")
    # the mask without CP: estimate gives an all-gather layout its own (spec.allgather_mask), and a
    # search prices layouts of every cp from this one
    return {"compiled": bool(_resolved(cfg, "compile")), "loss_chunks": chunks,
            "attn_mask": attention_mask(bool(getattr(cfg.data, "document_mask", False)), impl),
            "attn_impl": impl}


def _choice(value, allowed, key):
    choose(value, allowed, key, PlanError)


def check(shape: Shape, s: Spec) -> None:
    """Raise PlanError (one line, naming the key) if the layout cannot run this model."""
    a = shape.args
    _choice(s.precision, PLAN_PRECISIONS, "training.precision")
    _choice(s.ac, AC_MODES, "training.ac")
    _choice(s.pp_schedule, SCHEDULES, "parallel.pp_schedule")
    _choice(s.offload, OFFLOAD, "parallel.offload")
    _choice(s.cp_impl, CP_IMPLS, "parallel.cp_impl")
    _choice(s.zero, (0, 1, 2, 3), "parallel.zero")
    if s.seq_len < 1:
        raise PlanError(f"data.seq_len: must be >= 1, got {s.seq_len}")
    if s.offload != "none" and s.zero < 1:
        raise PlanError(f"parallel.offload: {s.offload} offload needs a ZeRO stage that shards the optimizer (zero >= 1)")
    try:
        s.check_groups()
    except ConfigError as e:
        raise PlanError(str(e)) from None
    check_shape(a, s.tp, s.pp, s.pp_virtual)
    if s.pp_layers:
        from ..core.schedule.stage import partition
        try:
            partition(a.n_layers, s.pp * s.pp_virtual, override=list(s.pp_layers))
        except ValueError as e:
            raise PlanError(str(e)) from None
    if s.pp_schedule == "zbv":
        if s.pp_virtual != 2:
            raise PlanError(f"parallel.pp_virtual: zbv runs exactly 2 chunks per rank (a V), got {s.pp_virtual}")
    elif s.pp_virtual > 1 and s.pp_schedule != "interleaved":
        raise PlanError(f"parallel.pp_virtual: {s.pp_virtual} chunks per rank need pp_schedule = interleaved")
    if s.pp_enabled and s.pp_schedule == "interleaved":
        if s.pp_virtual < 2:
            raise PlanError("parallel.pp_virtual: interleaved needs >= 2 chunks per rank")
        if s.accum % s.pp:
            raise PlanError(f"parallel.microbatches: interleaved needs a multiple of pp = {s.pp}, got {s.accum}")
    check_cp(a, s, s.cp_impl, s.seq_len)
    try:
        check_ep(a, s)
        check_zeropp(s, s.offload)
    except ConfigError as e:
        raise PlanError(str(e)) from None


LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "zero_group", "sp", "pp_schedule", "pp_virtual", "cp_impl",
               "offload", "micro_batch", "ac", "precision", "seq_len", "quantize_weights", "hpz_group",
               "quantize_grads")


def spec_of_layout(layout: dict, **changes) -> Spec:
    """The Spec of a `plan` / `estimate` "layout" row, every priced key included (the pipeline split and
    ZeRO++ too), so that a config written from a row is the layout that was priced."""
    return Spec(**{k: layout[k] for k in LAYOUT_KEYS}, accum=layout["microbatches"],
                pp_layers=tuple(layout["pp_layers"]), **changes)


def to_config(shape: Shape, s: Spec, base: Config | None = None) -> Config:
    """A meshlm Config that trains this layout (what `plan --emit-config` writes)."""
    cfg = dataclasses.replace(base) if base is not None else Config()
    cfg.model = dataclasses.replace(cfg.model, preset=shape.name or cfg.model.preset)
    cfg.data = dataclasses.replace(cfg.data, seq_len=s.seq_len)
    cfg.training = dataclasses.replace(cfg.training, global_batch=s.global_batch, micro_batch=s.micro_batch,
                                       ac=s.ac, precision=s.precision)
    cfg.parallel = dataclasses.replace(
        cfg.parallel, dp=s.dp, tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep, zero=s.zero,
        zero_group=(s.zero_group if s.zero and s.zero_group != s.dp else 0), sp=s.sp,
        pp_schedule=s.pp_schedule, pp_virtual=s.pp_virtual, pp_layers=list(s.pp_layers), microbatches=s.accum,
        cp_impl=s.cp_impl,
        offload=s.offload, quantize_weights=s.quantize_weights, hpz_group=s.hpz_group, quantize_grads=s.quantize_grads)
    return cfg


__all__ = [
    "ConfigError",
    "PlanError",
    "Shape",
    "Spec",
    "attention_mask",
    "check",
    "code_options",
    "presets",
    "priced_on",
    "shape_from_config",
    "spec_from_config",
    "to_config",
]
