"""Which transformer blocks each pipeline stage holds (pure Python, shared with the planner).

S = pp × pp_virtual stages in model order; stage s lives on (rank s % pp, chunk s // pp), or in a V for
ZB-V (actions.py).
Stage 0 also runs the embedding, stage S-1 the final norm, the head and the loss. Blocks are split
into contiguous runs so that the slowest stage is as fast as possible: every block costs 1, the
embedding and the head cost what their FLOPs are worth in blocks (a lookup is free; the head's matmul
costs vocab·dim against a block's parameter count), so the last stage gets fewer blocks when the
vocabulary is large. `parallel.pp_layers` overrides the split with an explicit count per stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..choices import choose
from .actions import stage_index
from .schedules import SCHEDULES, TAKES_VIRTUAL, V_SHAPED


@dataclass(frozen=True)
class StageCosts:
    """Relative forward cost of the pieces, in units of one transformer block."""
    block: float = 1.0
    embed: float = 0.0
    head: float = 0.0


def estimate_costs(args) -> StageCosts:
    """Matmul FLOPs scale with the parameters a token runs through (core/model_args.py ModelArgs): a block
    is worth its attention (GQA or MLA) and its feed-forward (MoE: router, top_k routed and the shared
    experts; averaged over a MoE model's MoE and dense blocks), the head vocab·dim, and each MTP module,
    which runs on the head's stage, its block, its projection (2d → d) and the head again."""
    def ffn(moe: bool) -> float:
        return args.moe_block_params(args.top_k) if moe else 3 * args.dim * args.ffn_dim

    moe = args.n_moe_blocks
    block = args.attention_params() + ((args.n_layers - moe) * ffn(False) + moe * ffn(True)) / args.n_layers
    head = args.vocab_size * args.dim
    mtp = sum(args.attention_params() + ffn(args.is_moe_block(args.n_layers + k)) + 2 * args.dim * args.dim + head
              for k in range(args.mtp_depth))
    return StageCosts(1.0, 0.0, (head + mtp) / block)


def partition(n_layers: int, stages: int, costs: StageCosts | None = None,
              override: list[int] | tuple[int, ...] | None = None) -> list[list[int]]:
    """Global block indices of every stage (contiguous, in order, at least one block each).

    Raises ValueError (message starts with the config key) when the layers cannot be split.
    """
    if stages < 1:
        raise ValueError(f"parallel.pp: need at least one stage, got {stages}")
    if override:
        counts = list(override)
        if len(counts) != stages:
            raise ValueError(f"parallel.pp_layers: {len(counts)} entries for {stages} stages "
                             f"(pp×pp_virtual); give one block count per stage")
        if any((not isinstance(c, int)) or c < 1 for c in counts):
            raise ValueError(f"parallel.pp_layers: every stage needs at least one block, got {counts}")
        if sum(counts) != n_layers:
            raise ValueError(f"parallel.pp_layers: {counts} sums to {sum(counts)}, the model has {n_layers} layers")
    else:
        if n_layers < stages:
            raise ValueError(f"parallel.pp: {n_layers} layers cannot fill pp×pp_virtual = {stages} stages "
                             f"(each stage needs at least one block)")
        counts = _balanced(n_layers, stages, costs or StageCosts())
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


@lru_cache(maxsize=1024)  # the planner asks for the same splits over and over
def _balanced(n: int, s: int, c: StageCosts) -> tuple[int, ...]:
    """Minimise the slowest stage, then the spread (sum of squared stage costs); ties keep blocks
    early. Dynamic programme over (stages used, blocks used): n, s are at most a few hundred."""
    def cost(stage: int, k: int) -> float:
        return k * c.block + (c.embed if stage == 0 else 0.0) + (c.head if stage == s - 1 else 0.0)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(s + 1)]
    choice = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = (0.0, 0.0)
    for st in range(1, s + 1):
        for used in range(st, n - (s - st) + 1):
            for k in range(1, used - (st - 1) + 1):
                prev = best[st - 1][used - k]
                if prev == inf:
                    continue
                x = cost(st - 1, k)
                cand = (round(max(prev[0], x), 9), round(prev[1] + x * x, 9))
                if cand < best[st][used]:
                    best[st][used], choice[st][used] = cand, k
    counts, used = [], n
    for st in range(s, 0, -1):
        counts.append(choice[st][used])
        used -= choice[st][used]
    return tuple(counts[::-1])


def check_pipeline(n_layers: int, pp: int, virtual: int, schedule: str, microbatches: int,
                   pp_layers: list[int], costs: StageCosts | None = None) -> list[list[int]]:
    """Everything about the pipeline settings that can be refused before workers start."""
    if pp < 2:
        if virtual > 1:
            raise ValueError(f"parallel.pp_virtual: {virtual} chunks per rank need pp > 1")
        if pp_layers and len(pp_layers) > 1:
            raise ValueError("parallel.pp_layers: a per-stage split needs pp > 1")
        return [list(range(n_layers))]
    choose(schedule, SCHEDULES, "parallel.pp_schedule")
    if schedule in V_SHAPED:
        if virtual != 2:
            raise ValueError(f"parallel.pp_virtual: schedule '{schedule}' runs exactly 2 chunks per rank "
                             f"(a V), got {virtual}; set pp_virtual = 2")
    elif schedule in TAKES_VIRTUAL:
        if virtual < 2:
            raise ValueError(f"parallel.pp_virtual: schedule '{schedule}' needs >= 2 chunks per rank, got {virtual}")
        if microbatches % pp:
            raise ValueError(f"parallel.microbatches: '{schedule}' needs micro-batches divisible by pp; "
                             f"{microbatches} is not a multiple of {pp}")
    elif virtual != 1:
        raise ValueError(f"parallel.pp_virtual: schedule '{schedule}' runs one chunk per rank, got {virtual} "
                         f"(use 'interleaved')")
    return partition(n_layers, pp * virtual, costs, pp_layers)


@dataclass
class PipelineStages:
    """This rank's part of the pipeline: which blocks every stage holds and which stages are its."""
    blocks: list[list[int]]  # global block indices of every stage
    rank: int
    p: int
    v: int
    tied: bool  # a tied weight held by two ranks (the two ends), summed over them; not under ZB-V
    vshape: bool = False

    def stage(self, chunk: int) -> int:
        return stage_index(self.rank, chunk, self.p, self.vshape)

    def holds(self, stage: int) -> bool:
        return any(self.stage(c) == stage for c in range(self.v))


def stage_blocks(args, p, m: int) -> list[list[int]]:
    """The blocks of every stage for model `args` under the pipeline keys of `p` (the parallel section)
    and `m` micro-batches (ValueError naming the key when they do not fit); core/layout/checks.py checks with it,
    the runtime cuts by it."""
    return check_pipeline(args.n_layers, p.pp, p.pp_virtual, p.pp_schedule, m, list(p.pp_layers), estimate_costs(args))
