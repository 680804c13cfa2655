"""Expert parallelism: the experts of every MoE block sharded over the `ep` group, tokens moved to them
with all-to-all (GShard / Switch / DeepSeek-V3 style).

The ep group is a second view of the data(×cp) ranks (distributed/mesh.py: `ep`, `edp`, `edp_shard`):
ep consecutive ranks of the flattened dp_replicate × dp_shard × cp block each hold E/ep experts. Each
rank routes its own micro-batch exactly as one process would (capacity and dropping are decided there,
at the source), then `ParallelMoE.run_experts`:
1. exchanges the split sizes: an all-to-all of the per-expert counts (E integers), so every rank knows
   how many rows each peer sends for each of its local experts;
2. sends the tokens (already sorted by global expert, hence grouped by destination rank) with an
   all-to-all of uneven splits;
3. regroups what arrived (source-major) into expert-major order, runs its experts as one grouped matmul,
   puts the outputs back in arrival order;
4. returns them with the reverse all-to-all. The caller combines them with the router weights.
Both all-to-alls are autograd functions whose backward is the reverse exchange.

Under fp8 with "ep" in training.fp8_comm (`ep_float8`), the exchanges in the dispatch direction (tokens
to experts) move e4m3 rows with one fp32 scale each, as DeepSeek-V3 does (§3.3.2): the forward dispatch
(`_Float8Dispatch`: the experts' float8 GEMMs take the rows as they arrive, `Float8Rows`) and the
combine's backward (`_Float8Combine`: the gradients of the down-projections' outputs, dequantised on
arrival; their float8 GEMM re-quantises them to the same values, the scales being powers of two). The
combine and the dispatch's backward (experts to tokens) stay bf16, as DeepSeek-V3 keeps them: what
returns is summed into the residual stream and its gradient (docs/fp8.md). gloo moves no float8 dtype, so
each row travels as its d bytes and its scale's 4 bytes in one uint8 buffer (booked at those bytes).

Expert gradients already hold the contributions of every peer's tokens; they are summed over the
expert-data group (the ranks holding the same experts) and divided by dp like every gradient
(compose.reductions); ZeRO shards them over `edp_shard` (inside one HSDP shard group) and all-reduces
over `dp_replicate`. Placements record the expert dimension as a `DimSplit` over `ep`, so sharded
checkpoints reshard between ep degrees.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Function

from ...distributed.comm import Comm
from ...distributed.functional import AllToAll, all_to_all, copy_to, exchange, reduce_from
from ...model.fp8_grouped import E4M3, Float8Gemms, Float8Rows, quantize
from ...model.moe import BALANCE, CALLS, DROPPED, MoE
from ...model.ops import eager_under_compile
from ..placement import DimSplit
from ..swap import swap_in


def _send_float8(x: torch.Tensor, comm: Comm, out_splits, in_splits) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows quantised (e4m3, one fp32 scale per row) and exchanged as one uint8 buffer of d + 4
    bytes per row: what arrived, (e4m3 rows, scales [rows, 1])."""
    q, s = quantize(x)
    d = x.shape[-1]
    got = exchange(torch.cat([q.view(torch.uint8), s.view(torch.uint8)], 1), comm, out_splits, in_splits)
    return got[:, :d].view(E4M3), got[:, d:].contiguous().view(torch.float32)


class _Float8Dispatch(Function):
    """Tokens to experts in float8 (the arrival stays quantised, `Float8Rows`); backward, experts to
    tokens, in the gradient's dtype."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        return Float8Rows(*_send_float8(x, comm, out_splits, in_splits), x.dtype)

    @staticmethod
    def backward(ctx, g):
        return exchange(g, ctx.comm, ctx.in_splits, ctx.out_splits), None, None, None


class _Float8Combine(AllToAll):
    """Experts to tokens in the outputs' dtype (AllToAll's forward); backward, the gradients back to the
    experts, in float8."""

    @staticmethod
    def backward(ctx, g):
        q, s = _send_float8(g, ctx.comm, ctx.in_splits, ctx.out_splits)
        return (q.float() * s).to(g.dtype), None, None, None


class ParallelMoE(MoE):
    """A MoE feed-forward with the parallel state model/moe.py leaves out, set by the dimensions that
    apply (`parallel_moe`): `experts`, the `DimSplit` of the expert dimension over `ep_comm` from the
    placement record (None: every expert here); `token_comm`, the cp ranks holding the micro-batch's
    other tokens; `aux_share`, this TP rank's share of the balance term's gradient; `ep_float8`, the
    dispatch-direction exchanges move float8 (module doc)."""
    ep_comm: Comm | None
    ep_float8: bool
    ep_split: DimSplit | None
    token_comm: Comm | None
    aux_share: float

    @eager_under_compile  # collectives with data-dependent splits stay eager under compile
    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_comm is None:
            return super().run_experts(x, counts)
        comm = self.ep_comm
        ep, n = self.ep_split.parts, self.ep_split.chunk
        got = torch.empty_like(counts)
        comm.all_to_all(got, counts)  # split sizes first: rows of each of my experts from each peer
        got = got.view(ep, n)
        send, recv = counts.view(ep, n).sum(1).tolist(), got.sum(1).tolist()
        dispatch, combine = (_Float8Dispatch.apply, _Float8Combine.apply) if self.ep_float8 else \
            (all_to_all, all_to_all)
        y = dispatch(x, comm, recv, send)
        expert = torch.repeat_interleave(torch.arange(ep * n, device=x.device) % n, got.flatten())
        perm = torch.argsort(expert, stable=True)  # source-major -> expert-major (sources in order)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        z = self.experts(y[perm], got.sum(0).tolist())
        return combine(z[inv], comm, send, recv)

    def token_totals(self, assigned: torch.Tensor, prob_sum: torch.Tensor, tokens: int):
        """Context parallelism: each cp rank routes its chunks of the micro-batch's sequences. The
        balance term needs the whole micro-batch's assignment fractions and mean probabilities: summed
        over cp (forward all-reduce, backward all-reduce: each rank's loss is the mean over its own
        tokens, so the gradient signal of every rank is cp times its share, as for the cross-entropy).
        Every cp rank then computes the same balance term and feeds its gradient in full; the
        cp-summed, (dp·cp)-divided gradients come out as one process's. Capacity dropping stays per
        rank, so it is refused with cp."""
        c = self.token_comm
        if c is None:
            return assigned, prob_sum, tokens
        return (reduce_from(copy_to(assigned.detach(), c), c).detach(), reduce_from(copy_to(prob_sum, c), c),
                tokens * c.size)

    def sequence_totals(self, assigned: torch.Tensor, prob_sum: torch.Tensor, tokens: int):
        """The sequence-wise balance loss's totals per whole sequence ([B, E] each): under context
        parallelism summed over the cp ranks holding each sequence's other chunks, as `token_totals`."""
        return self.token_totals(assigned, prob_sum, tokens)

    def aux_scale(self) -> float | torch.Tensor:
        return super().aux_scale() * self.aux_share

    def seq_aux_scale(self) -> float | torch.Tensor:
        """Tensor parallelism: each rank feeds 1/tp of the sequence-wise loss's gradient (`aux_scale`)."""
        return super().seq_aux_scale() * self.aux_share


def parallel_moe(model: nn.Module, m: MoE) -> ParallelMoE:
    """`m` in its ParallelMoE form, seated in `model` by the first dimension that asks; each dimension
    then sets its own field."""
    if isinstance(m, ParallelMoE):
        return m
    return swap_in(model, m, ParallelMoE, ep_comm=None, ep_split=None, token_comm=None, aux_share=1.0,
                   ep_float8=False)


def apply_expert_parallel(model: nn.Module, comm: Comm, plan, table, experts: set[str]) -> None:
    """Record the expert split (dim 0 of each stacked expert weight in `experts` over `comm`; the
    materialisation then keeps only this rank's experts) and hand each MoE feed-forward that split."""
    split = DimSplit(0, model.args.num_experts, model.args.num_experts, comm.size, comm.rank, comm.name)
    for name in table.names():
        if name in experts:
            table.update(name, lambda pl: pl.split(split))
    for m in plan.moe_layers(model).values():
        m = parallel_moe(model, m)
        m.ep_comm, m.ep_split = comm, split


def dispatch_in_float8(model: nn.Module, plan) -> list[int]:
    """fp8 with "ep" in training.fp8_comm: each expert-parallel MoE block whose experts multiply in float8
    (parallel/features/float8.py) moves its dispatch-direction exchanges in float8; the blocks chosen."""
    chosen = [b for b, m in plan.moe_layers(model).items()
              if isinstance(m, ParallelMoE) and m.ep_comm is not None and isinstance(m.experts.gemms, Float8Gemms)]
    for b in chosen:
        plan.moe_layers(model)[b].ep_float8 = True
    return chosen


def share_tokens_over_cp(model: nn.Module, comm: Comm, plan) -> None:
    """Context parallelism: the balance term sums over `comm` (ParallelMoE.token_totals)."""
    for m in plan.moe_layers(model).values():
        parallel_moe(model, m).token_comm = comm


class MoEStats:
    """Routing statistics per step for metrics.jsonl `moe`, the aux-loss gradient scale, and the
    auxiliary-loss-free bias update (DeepSeek-V3 §2.1.2).

    Every MoE module sums, over the step's training forwards, the tokens assigned to each expert
    (before dropping), the dropped assignments, its balance term and its call count. `record` sums
    those over the world (each TP rank routes the same tokens: divided by tp) into one row per MoE
    block of the model (MTP blocks included, as blocks n_layers + k), whichever stage holds it. Under
    cp every cp rank records the same balance term once per call, so the mean over calls is unchanged.

    `update_biases` runs after every optimizer step: the [MoE blocks, E] counts are summed over the
    world in one all-reduce of a fixed shape (a stage holds only its blocks' rows, zeros elsewhere; dp,
    cp and ep ranks route different tokens, tp ranks the same ones, which scales every row by tp and
    leaves sign() alone), so every rank holding a block applies the same update."""

    def __init__(self, model: nn.Module, plan, tp: int):
        args = model.args
        self.scale: float | torch.Tensor = 1.0
        self.modules = plan.moe_layers(model)
        blocks = [i for i in range(args.n_layers + args.mtp_depth) if args.is_moe_block(i)]
        self.row = {b: i for i, b in enumerate(blocks)}
        self.experts, self.tp = args.num_experts, tp
        self.balancing = args.expert_bias and args.bias_update_rate > 0  # the same on every rank

    def begin_step(self, scale: float | torch.Tensor) -> None:
        """`scale`: what the main loss is multiplied by before backward (1/accum, × fp16's scale)."""
        self.scale = scale
        for m in self.modules.values():
            m.aux_grad_scale = scale
            m.stats = None
            m.counted = True

    def padding(self, on: bool) -> None:
        """`on`: the passes that follow are padding (parallel/step.py `Accumulation`: loss × 0), which
        route tokens only to join the other replicas' all-to-alls: they record no routing statistics
        (bias update, aux loss, metrics) and feed the balance losses no gradient."""
        for m in self.modules.values():
            m.counted = not on
            m.aux_grad_scale = 0.0 if on else self.scale

    def _rows(self, width: int, device: torch.device) -> torch.Tensor:
        """[MoE blocks, width] float64: this rank's `stats` (first `width` columns), zeros for the
        blocks other stages hold."""
        rows = torch.zeros(len(self.row), width, dtype=torch.float64, device=device)
        for b, m in self.modules.items():
            if m.stats is not None:
                rows[self.row[b]] = m.stats[:width].to(rows)
        return rows

    def update_biases(self, world: Comm, device: torch.device, skipped: torch.Tensor | None = None) -> None:
        """bias += γ·sign(mean load − load) per block from the step's global counts. `skipped` (a device
        flag, 1.0 when the optimizer skipped the step: fp16 overflow, a loss spike): the bias stays
        too, so a skipped step changes no model state; the counts are zeroed, sign(0) = 0, no host read."""
        if not self.balancing:
            return
        loads = self._rows(self.experts, device)
        world.all_reduce(loads)
        if skipped is not None:
            loads.mul_(1.0 - skipped.to(loads))
        for b, m in self.modules.items():
            m.update_bias(loads[self.row[b]])

    def record(self, world: Comm, device: torch.device) -> dict:
        E = self.experts
        rows = self._rows(E + 3, device)
        world.all_reduce(rows)
        rows = (rows / self.tp).cpu()
        counts = rows[:, :E]
        calls = rows[:, E + CALLS].sum().item()
        return {"aux_loss": rows[:, E + BALANCE].sum().item() / max(calls, 1.0),
                "tokens_per_expert_min": counts.min().item(), "tokens_per_expert_max": counts.max().item(),
                "dropped": rows[:, E + DROPPED].sum().item() / max(counts.sum().item(), 1.0)}
