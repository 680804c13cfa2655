"""Mixture-of-experts feed-forward (Switch / Mixtral / DeepSeekMoE style), plain PyTorch.

Routing: softmax over all experts' logits (fp32), the top-k of those probabilities, renormalised to sum
to one over the k chosen (equal to Mixtral's softmax over the top-k logits). Optional shared experts
run on every token (DeepSeekMoE), as one SwiGLU of `shared_experts × moe_ffn_dim` hidden units.

Capacity: with `capacity_factor > 0` each expert takes at most C = ceil(cf · T · k / E) assignments of the
T tokens this module sees in one call (one micro-batch on one data-parallel rank: the same tokens in
every layout, so dropping never depends on the layout). Assignments are served in priority order —
every token's first choice before any second choice, tokens in order within a choice (GShard) — and
the rest are dropped: they add nothing, the residual carries the token. `capacity_factor <= 0`: dropless.

Experts are stored stacked per block ([E, hidden, dim] for w1/w3, [E, dim, hidden] for w2) and run as a
grouped matmul over the tokens sorted by expert: `torch._grouped_mm` on CUDA for bf16 where torch has
it, else one matmul per expert over its contiguous range of rows (never one per token).

Load balancing: the Switch/Mixtral auxiliary loss E · Σ_e f_e · P_e per block (f_e: fraction of the T·k
assignments routed to e before dropping, P_e: mean router probability of e; 1.0 when perfectly
balanced), weighted by `aux_loss_coef` and summed over blocks. It reaches the optimizer without
touching the loss function: `_AuxGrad` is the identity on the block output whose backward also feeds
coef · `aux_grad_scale` into the balance term (Megatron's MoEAuxLossAutoScaler), so it works unchanged
in pipeline stages, under checkpointing and in every layout. The trainer sets `aux_grad_scale` to the
factor it multiplies the main loss by (1/accumulation, × the fp16 loss scale).

The module holds no parallel state. Three methods are the seams parallel/dims/expert_parallel.py overrides:
`run_experts` (expert parallelism: it takes the tokens sorted by global expert id and the count per
expert, and returns the outputs in that order), `token_totals` (context parallelism: the balance term
over the whole micro-batch) and `aux_scale` (tensor parallelism: each rank's share of its gradient).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .args import ModelArgs
from .feed_forward import FeedForward, SwiGLU
from .ops import eager_under_compile

# stats vector layout: tokens per expert (assigned, before dropping), then these
DROPPED, BALANCE, CALLS = 0, 1, 2


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor(counts, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of expert e (contiguous, counts[e] of them, in expert order) times w[e]ᵀ: [N, in] → [N, out]."""
    if _use_grouped_mm(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=_offsets(counts, x.device))
    outs, off = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(x[off:off + n] @ w[e].t())
        off += n
    return torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, counts: list[int], shape) -> torch.Tensor:
    """Σ over each expert's rows of gᵀx: the weight gradient [E, out, in] (zeros for idle experts)."""
    if _use_grouped_mm(x, g):
        return torch._grouped_mm(g.t(), x, offs=_offsets(counts, x.device))
    gw = x.new_zeros(shape)
    off = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(g[off:off + n].t(), x[off:off + n], out=gw[e])
        off += n
    return gw


class GroupedLinear(torch.autograd.Function):
    """x [N, in] (sorted by expert) @ w[e]ᵀ per expert, with a backward that writes each expert's
    weight gradient into one [E, out, in] tensor (indexing w[e] under autograd would allocate a full
    zero gradient per expert)."""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return grouped_mm(x, w, counts)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        gx = grouped_mm(g, w.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
        gw = grouped_wgrad(g, x, ctx.counts, w.shape) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class Experts(nn.Module):
    """E SwiGLU experts, stacked. Parameter `w1` holds expert e's gate at w1[e] (single-process name
    `...experts.w1`; its initial value is seeded per expert as `...experts.{e}.w1`, model/init.py)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))  # down
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate = GroupedLinear.apply(x, self.w1, counts)
        up = GroupedLinear.apply(x, self.w3, counts)
        return GroupedLinear.apply(self.act(gate, up), self.w2, counts)


class _AuxGrad(torch.autograd.Function):
    """Identity on `out`; backward also hands `aux` the gradient `scale` (d(scale·aux)/d aux)."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones((), device=g.device) * ctx.scale, None


def _recording() -> bool:
    """A training forward (not eval, not checkpointing's recomputation inside backward)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): the feed-forward of a MoE block."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.capacity_factor, self.aux_loss_coef = args.capacity_factor, args.aux_loss_coef
        self.router = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = Experts(args.num_experts, args.dim, args.expert_dim)
        self.shared = FeedForward(args.dim, args.shared_experts * args.expert_dim) if args.shared_experts else None
        self.aux_grad_scale: float | torch.Tensor = 1.0  # set by the trainer each step
        self.stats: torch.Tensor | None = None  # [E + 3] summed over the step's training forwards

    def capacity(self, tokens: int) -> int:
        """Assignments one expert takes per call; 0 = unlimited."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def route(self, h: torch.Tensor):
        """(probs [T, E] fp32, weights [T, k] fp32, assignment order sorted by expert (kept ones),
        per-expert assigned counts (before dropping), per-expert kept counts). An assignment j is
        token j % T's choice number j // T."""
        T, E, k = h.shape[0], self.num_experts, self.top_k
        probs = self.router(h).float().softmax(-1)
        weights, chosen = probs.topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.t().reshape(-1)  # priority order: all first choices, then all second ...
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        kept = counts
        cap = self.capacity(T)
        if cap:
            starts = counts.cumsum(0) - counts
            pos = torch.arange(flat.numel(), device=h.device) - starts[flat[order]]
            order = order[pos < cap]
            kept = counts.clamp(max=cap)
        return probs, weights, order, counts, kept

    @eager_under_compile  # data-dependent row counts: compiled code would specialise on each
    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs of the tokens `x` sorted by expert, `counts[e]` rows for expert e. Runs eagerly under
        training.compile (routing and combining around it are compiled)."""
        return self.experts(x, counts.tolist())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        T = h.shape[0]
        probs, weights, order, counts, kept = self.route(h)
        token, slot = order % T, order // T
        y = self.run_experts(h[token], kept)
        y = y.float() * weights[token, slot].unsqueeze(-1)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device).index_add_(0, token, y).to(h.dtype)
        if self.shared is not None:
            out = out + self.shared(h)
        balance = self._balance(counts, probs)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            out = _AuxGrad.apply(out, balance, self.aux_scale())
        if _recording():
            self._record(counts, kept, balance)
        return out.view(shape)

    def aux_scale(self) -> float | torch.Tensor:
        """The gradient the balance term receives in backward (a seam: under tensor parallelism each
        rank feeds its share, parallel/dims/expert_parallel.py)."""
        return self.aux_loss_coef * self.aux_grad_scale

    def token_totals(self, assigned: torch.Tensor, prob_sum: torch.Tensor, tokens: int):
        """(assignments per expert, summed router probabilities, tokens) of the whole micro-batch from
        this call's. One process sees all of it; the seam context parallelism replaces to sum the
        ranks holding its other tokens (parallel/dims/expert_parallel.py)."""
        return assigned, prob_sum, tokens

    def _balance(self, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """E · Σ_e f_e · P_e over the micro-batch."""
        assigned, prob_sum, T = self.token_totals(counts.float(), probs.sum(0), probs.shape[0])
        return self.num_experts * (assigned / (T * self.top_k) * (prob_sum / T)).sum()

    @torch.no_grad()
    def _record(self, counts: torch.Tensor, kept: torch.Tensor, balance: torch.Tensor) -> None:
        extra = torch.stack([(counts - kept).sum().double(), balance.detach().double(),
                             torch.ones((), dtype=torch.float64, device=counts.device)])
        row = torch.cat([counts.double(), extra])
        self.stats = row if self.stats is None else self.stats + row
