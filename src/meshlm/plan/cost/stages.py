"""What one pipeline rank holds: its blocks (split as the runtime splits them and placed as the schedule
places them), their parameters before ZeRO sharding, and the micro-batches whose activations it keeps
at its peak. The planner sizes the first, the last and the busiest middle rank (`pipeline_roles`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ...core.schedule.actions import stage_index
from ...core.schedule.stage import estimate_costs, partition
from .activations import ceil_div, vocab_rows
from .attn_widths import attn_widths
from ..spec import Shape, Spec


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds on a stage: `dense` shards over the ZeRO group, `expert` over
    zero_group/ep; `unit` is the largest piece ZeRO-3 gathers at once (a block or the embedding)."""
    dense: float
    expert: float
    unit: float
    layers: int
    embed: bool
    head: bool
    chunks: tuple = ()   # blocks of each local chunk, in chunk order
    rank: int = 0


def block_params_local(shape: Shape, tp: int, ep: int = 1, frac: float | None = None) -> tuple[float, float]:
    """(dense, expert) parameters of one Block on one TP rank. Norms are replicated; kv heads are
    replicated when tp exceeds them, MLA's latent projections and norms always; experts are split over
    ep and, like the dense FFN, over tp. MoE models: averaged over their MoE and dense blocks, or
    `frac` = 1 for a MoE block, 0 for a dense one."""
    a = shape.args
    w = attn_widths(a, tp)
    attn = sum(n * k for _, n, k in w.gemms) + w.latent_norms
    mlp = 3 * a.dim * a.ffn_dim / tp
    if shape.moe:  # per block, averaged over MoE and dense blocks (moe.every, moe.first_dense)
        frac, xmlp = a.n_moe_blocks / a.n_layers if frac is None else frac, 3 * a.dim * a.expert_dim / tp
        dense = attn + 2 * a.dim + frac * (shape.shared_experts * xmlp + a.dim * shape.num_experts) \
            + (1 - frac) * mlp
        return dense, frac * ceil_div(shape.num_experts, ep) * xmlp
    return attn + 2 * a.dim + mlp, 0.0


def float8_params_local(shape: Shape, tp: int, ep: int = 1) -> float:
    """Parameters of one Block (averaged over a MoE model's blocks) on one TP rank that fp8 training
    multiplies in float8, and so ZeRO-3 gathers in float8 (training.fp8_comm "zero"): the attention's
    split projections (not MLA's replicated latents), the dense FFN, the shared experts (tensorwise) and
    the routed experts held (split over ep; row-wise scales, dims/zero/float8.py). Norms and routers are
    gathered in bf16 (docs/fp8.md)."""
    a = shape.args
    w = attn_widths(a, tp)
    whole = {name for name, _ in w.replicated}
    attn = sum(n * k for name, n, k in w.gemms if name not in whole)
    frac = a.n_moe_blocks / a.n_layers if shape.moe else 0.0
    experts = shape.shared_experts + ceil_div(shape.num_experts, ep) if shape.moe else 0
    return attn + (1 - frac) * 3 * a.dim * a.ffn_dim / tp + frac * 3 * a.dim * a.expert_dim * experts / tp


def float8_expert_amaxes(shape: Shape, tp: int, ep: int = 1) -> float:
    """fp32 amaxes one ZeRO-3 gather of a Block (averaged over a MoE model's blocks) all-reduces for its
    routed experts: one per (expert, output row) of w1, w3, w2 forward, per (expert, input column)
    backward; 1.5 (dim + hidden) per expert on average over the two."""
    if not shape.moe:
        return 0.0
    a = shape.args
    return a.n_moe_blocks / a.n_layers * ceil_div(shape.num_experts, ep) * 1.5 * (a.dim + a.expert_dim / tp)


def pipeline_roles(pp: int) -> tuple[str, ...]:
    """The ranks the planner sizes: the first and the last, and with pp >= 3 the middle rank holding
    the most blocks (it sets the pace when the end stages are given fewer blocks). "rank{r}" names
    any one pipeline rank (`every_rank`)."""
    return ("only",) if pp == 1 else ("first", "last") if pp == 2 else ("first", "last", "middle")


def every_rank(pp: int) -> tuple[str, ...]:
    """A role per pipeline rank, for stages that differ by more than their position (a mixed cluster)."""
    return ("only",) if pp == 1 else tuple(f"rank{r}" for r in range(pp))


@lru_cache(maxsize=4096)
def stage_chunks(a, pp: int, v: int, stage: str, schedule: str = "1f1b",
                 pp_layers: tuple = ()) -> tuple[int, tuple[int, ...], bool, bool]:
    """(rank, blocks per local chunk, holds the embedding, holds the head) for a planner role, split
    exactly as the runtime splits the blocks (core/schedule/stage.py: the head costs vocab·dim,
    so the last stage gets fewer blocks; `pp_layers` overrides) and placed as the schedule places
    them (ZB-V's V puts the first and the last stage on rank 0). Layer counts that cannot be split
    fall back to ceil(L/(pp·v)) per chunk; check() reports them."""
    if pp == 1:
        return 0, (a.n_layers,), True, True
    S, vs = pp * v, schedule == "zbv"
    try:
        blocks = [len(b) for b in partition(a.n_layers, S, estimate_costs(a), list(pp_layers) or None)]
    except ValueError:
        blocks = [ceil_div(a.n_layers, S)] * S

    def held(r: int) -> list[int]:
        return [stage_index(r, c, pp, vs) for c in range(v)]

    if stage == "middle":
        rank = max(range(1, pp - 1), key=lambda r: (sum(blocks[s] for s in held(r)), -r))
    elif stage.startswith("rank"):  # one rank by number (plan/mixed/search.py sizes every stage of a mixed cluster)
        rank = int(stage[4:])
    else:
        rank = pp - 1 if stage == "last" else 0
    mine = held(rank)
    return rank, tuple(blocks[s] for s in mine), 0 in mine, S - 1 in mine


def stage_layers(a, pp: int, v: int, stage: str, schedule: str = "1f1b", pp_layers: tuple = ()) -> int:
    """Blocks on one planner role's rank over its v chunks (`stage_chunks`)."""
    return sum(stage_chunks(a, pp, v, stage, schedule, tuple(pp_layers))[1])


def stage_params(shape: Shape, s: Spec, stage: str) -> StageParams:
    """stage: 'first', 'last' or 'only' (pp = 1). The first and the last rank hold the blocks the runtime
    gives them (`stage_layers`). Tied embeddings are stored once with pp = 1 and on both end stages
    otherwise."""
    return stage_params_of(shape, s.tp, s.ep, s.pp, s.pp_virtual, s.pp_schedule, s.pp_layers, stage)


@lru_cache(maxsize=4096)
def stage_params_of(shape: Shape, tp: int, ep: int, pp: int, v: int, schedule: str, pp_layers: tuple,
                    stage: str) -> StageParams:
    """stage_params from the degrees and the pipeline's knobs (cached: the search asks often)."""
    a = shape.args
    rank, chunks, embed, head = stage_chunks(a, pp, v, stage, schedule, pp_layers)
    mtp = a.mtp_depth if head else 0
    if mtp:  # MTP modules run after the head's chunk, as more blocks of it (docs/planner.md, DeepSeek-V3)
        last = next(c for c in range(len(chunks)) if stage_index(rank, c, pp, schedule == "zbv") == pp * v - 1)
        chunks = tuple(n + mtp if c == last else n for c, n in enumerate(chunks))
    layers = sum(chunks)
    dense_blk, exp_blk = block_params_local(shape, tp, ep)
    emb = vocab_rows(a, tp) * a.dim
    dense, expert = (layers - mtp) * dense_blk, (layers - mtp) * exp_blk
    for k in range(mtp):  # each MTP module: its block (MoE or dense as block L + k), projection, 3 norms
        blk = block_params_local(shape, tp, ep, float(a.is_moe_block(a.n_layers + k)))
        dense, expert = dense + blk[0] + 2 * a.dim * a.dim + 3 * a.dim, expert + blk[1]
    if embed or mtp:  # MTP embeds the tokens ahead: the embedding (or the tied copy) is on the last stage
        dense += emb
    if head:
        dense += a.dim
        if not (a.tie_embeddings and (embed or mtp)):
            dense += emb
    unit = max(dense_blk + exp_blk, emb if (embed or head) else 0)
    return StageParams(dense, expert, unit, layers, embed, head, chunks, rank)


def held_layers(schedule: str, p: int, m: int, v: int, rank: int, chunks: tuple) -> float:
    """Block-activations (in blocks × micro-batches) a rank holds at its peak: `inflight` times its
    blocks, except ZB-V's rank 0, whose loss-stage chunk holds one micro-batch (its W runs first,
    schedules.py) while the chunk of stage 0 holds up to 2p (an upper bound: the two peaks need
    not coincide)."""
    if schedule == "zbv" and p > 1 and rank == 0:
        return min(2 * p, m) * chunks[0] + chunks[1]
    return inflight(schedule, p, m, v, rank) * sum(chunks)


def inflight(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations rank `rank` holds at its peak, in units of all its layers.

    gpipe: m; 1f1b and zb-h1: min(p - rank, m); interleaved (Megatron): (warm-up chunks + 1)/v =
    p + (p-1)/v on rank 0, the (1 + (p-1)/(p·v)) penalty of Korthikanti et al.; zbv: min(p, m) on
    every rank (2p half-size chunks, checked against the built schedule in tests/test_plan.py)."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v) / v
    if schedule == "zbv":
        return float(min(p, m))
    return float(min(p - rank, m))
