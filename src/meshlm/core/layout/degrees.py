"""The mesh degrees and the batch split of a config on a world size (`Layout`): the one place a config's
parallel section becomes numbers (docs/architecture.md), and which collectives move float8."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, ConfigError, LayoutError


@dataclass(frozen=True)
class Layout:
    """The degrees of a run and the batch split they imply: the one description of how the ranks share
    the work. The trainer resolves it from a config (`from_config`, `build_layout`); the planner prices it
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
        """`mean_accum` of a step of `batch` sequences (training.batch_rampup: each step's own; the
        islands split it like dp)."""
        return batch / (self.micro_batch * self.dp * self.islands)

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
