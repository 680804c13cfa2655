"""Mixture-of-experts feed-forward (Switch / Mixtral / DeepSeekMoE style), plain PyTorch.

Routing: softmax over all experts' logits (fp32), the top-k of those probabilities, renormalised to sum
to one over the k chosen (equal to Mixtral's softmax over the top-k logits). Optional shared experts
run on every token (DeepSeekMoE), as one SwiGLU of `shared_experts × moe_ffn_dim` hidden units.

DeepSeek-V3 routing (any of `score = "sigmoid"`, a selection bias, `n_group > 1`,
`routed_scaling_factor != 1`, `norm_topk_prob = false`; otherwise the path above runs unchanged):
affinities s = sigmoid or softmax of the logits; the experts are the top-k of s + bias among the
best `topk_group` of `n_group` groups (a group's score: the sum of its two best s + bias); the gate
weights are s of the chosen, renormalised to one (`norm_topk_prob`), times `routed_scaling_factor`.

Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2, `bias_update_rate` γ > 0): the bias buffer
`expert_bias` [E] (fp32 model state in the state dict, never a Parameter: the optimizer and weight
decay never see it) only selects, it never weights. After each optimizer step the trainer applies
bias += γ · sign(mean load − load) with the step's assignments per expert summed over every rank
that routes different tokens (data, context, expert parallel ranks, every micro-batch):
    moes = balanced_moes(model)                  # once
    loads = expert_loads(moes)                   # [n, E] float64: this rank's counts (`stats`)
    all_reduce(loads, SUM)                       # over the ranks routing other tokens (tp ranks route
                                                 # the same ones: harmless, sign() ignores the scale)
    update_expert_biases(moes, loads)            # the same update on every rank
The counts are those `stats` records (training forwards only), so they must be reset each step
(`stats = None`) for every module in `moes`, MTP blocks included.

Sequence-wise balance loss (DeepSeek-V3 §2.1.2, the complement to the bias; weight
`seq_aux_loss_coef` α): per sequence of S tokens, E/(k·S) · Σ_e count_e · P_e with P_e the mean of
s_e / Σ_j s_j, averaged over the sequences of the call ([B, S, dim] input). It reaches the router like
the auxiliary loss below (`_AuxGrad`, `seq_aux_scale`): the trainer handles both the same way.

Capacity: with `capacity_factor > 0` each expert takes at most C = ceil(cf · T · k / E) assignments of the
T tokens this module sees in one call (one micro-batch on one data-parallel rank: the same tokens in
every layout, so dropping never depends on the layout). Assignments are served in priority order —
every token's first choice before any second choice, tokens in order within a choice (GShard) — and
the rest are dropped: they add nothing, the residual carries the token. `capacity_factor <= 0`: dropless.

Experts are stored stacked per block ([E, hidden, dim] for w1/w3, [E, dim, hidden] for w2) and run as a
grouped matmul over the tokens sorted by expert: `torch._grouped_mm` on CUDA for bf16 where torch has
it, else one matmul per expert over its contiguous range of rows (never one per token). fp8 training runs
the same three products in float8 (model/fp8_grouped.py, set on `Experts.gemms` from outside).

Load balancing: the Switch/Mixtral auxiliary loss E · Σ_e f_e · P_e per block (f_e: fraction of the T·k
assignments routed to e before dropping, P_e: mean router probability of e; 1.0 when perfectly
balanced), weighted by `aux_loss_coef` and summed over blocks. It reaches the optimizer without
touching the loss function: `_AuxGrad` is the identity on the block output whose backward also feeds
coef · `aux_grad_scale` into the balance term (Megatron's MoEAuxLossAutoScaler), so it works unchanged
in pipeline stages, under checkpointing and in every layout. The trainer sets `aux_grad_scale` to the
factor it multiplies the main loss by (1/accumulation, × the fp16 loss scale). A forward that must count
in nothing (uneven data parallelism's padding passes, which route tokens only to join the others'
all-to-alls) runs with `counted = False` and `aux_grad_scale = 0`, both set from outside.

The module holds no parallel state. These methods are the seams parallel/dims/expert_parallel.py overrides:
`run_experts` (expert parallelism: it takes the tokens sorted by global expert id and the count per
expert, and returns the outputs in that order), `token_totals` (context parallelism: the balance term
over the whole micro-batch), `aux_scale` (tensor parallelism: each rank's share of its gradient), and
for the sequence-wise loss `sequence_totals` (context parallelism: whole sequences) and
`seq_aux_scale` (tensor parallelism, as `aux_scale`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..core.model_args import ModelArgs
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


class GroupedGemms:
    """The three products of a grouped linear, in the operands' own precision. fp8 training hands the
    experts model/fp8_grouped.Float8Gemms instead (the same three in float8): `Experts.gemms`."""

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What backward needs of the input (saved for the weight gradient)."""
        return (x,)

    def forward(self, x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return grouped_mm(x, w, counts)

    def dgrad(self, g: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return grouped_mm(g, w.transpose(1, 2), counts)

    def wgrad(self, g: torch.Tensor, kept: tuple, counts: list[int], shape) -> torch.Tensor:
        return grouped_wgrad(g, kept[0], counts, shape)


PLAIN = GroupedGemms()


class GroupedLinear(torch.autograd.Function):
    """x [N, in] (sorted by expert) @ w[e]ᵀ per expert, with a backward that writes each expert's
    weight gradient into one [E, out, in] tensor (indexing w[e] under autograd would allocate a full
    zero gradient per expert). `gemms` computes the three products (PLAIN, or float8's)."""

    @staticmethod
    def forward(ctx, x, w, counts, gemms=PLAIN):
        ctx.save_for_backward(w, *gemms.keep(x))
        # w itself too: a recomputing checkpoint hands backward a detached alias of it, and a source of
        # pre-quantised weights (Float8Gemms.source) knows the parameter, not the alias
        ctx.counts, ctx.gemms, ctx.weight = counts, gemms, w
        return gemms.forward(x, w, counts)

    @staticmethod
    def backward(ctx, g):
        w, *kept = ctx.saved_tensors
        g = g.contiguous()
        gx = ctx.gemms.dgrad(g, ctx.weight, ctx.counts) if ctx.needs_input_grad[0] else None
        gw = ctx.gemms.wgrad(g, tuple(kept), ctx.counts, w.shape) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


class Experts(nn.Module):
    """E SwiGLU experts, stacked. Parameter `w1` holds expert e's gate at w1[e] (single-process name
    `...experts.w1`; its initial value is seeded per expert as `...experts.{e}.w1`, model/init.py).
    `gemms`: how the grouped products run (PLAIN; fp8 training sets float8's from outside)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))  # down
        self.act = SwiGLU()
        self.gemms: GroupedGemms = PLAIN

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate = GroupedLinear.apply(x, self.w1, counts, self.gemms)
        up = GroupedLinear.apply(x, self.w3, counts, self.gemms)
        return GroupedLinear.apply(self.act(gate, up), self.w2, counts, self.gemms)


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
        self.counted = True  # False: the forwards that follow record no statistics (set from outside)
        # DeepSeek-V3 routing (module doc); `plain`: the softmax path above, untouched
        self.plain, self.score = args.plain_routing, args.moe_score
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.routed_scaling_factor, self.norm_topk_prob = args.routed_scaling_factor, args.norm_topk_prob
        self.bias_update_rate, self.seq_aux_loss_coef = args.bias_update_rate, args.seq_aux_loss_coef
        # model state, never a parameter: the optimizer and weight decay never see it (fp32, like HF's)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts) if args.expert_bias else None)

    def capacity(self, tokens: int) -> int:
        """Assignments one expert takes per call; 0 = unlimited."""
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def route(self, h: torch.Tensor):
        """(probs [T, E] fp32, weights [T, k] fp32, assignment order sorted by expert (kept ones),
        per-expert assigned counts (before dropping), per-expert kept counts). An assignment j is
        token j % T's choice number j // T."""
        probs, weights, chosen = self.select(h)
        return (probs, weights, *self.dispatch(chosen))

    def select(self, h: torch.Tensor):
        """(probs [T, E]: the affinities normalised over the experts, weights [T, k], chosen [T, k])."""
        if not self.plain:
            return self._select_deepseek(self.router(h).float())
        probs = self.router(h).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        return probs, weights / weights.sum(-1, keepdim=True), chosen

    def _select_deepseek(self, logits: torch.Tensor):
        """DeepSeek-V3's gate: softmax or sigmoid affinities s; experts chosen by s + bias among the best
        topk_group groups (a group's score: the sum of its two best); gate weights from s alone,
        renormalised (norm_topk_prob) and scaled by routed_scaling_factor."""
        T, E, k = logits.shape[0], self.num_experts, self.top_k
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.n_group > 1:
            groups = choice.view(T, self.n_group, E // self.n_group)
            best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, -1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, 1), float("-inf"))
        chosen = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, weights, chosen

    def dispatch(self, chosen: torch.Tensor):
        """(order, assigned counts, kept counts) of the choices [T, k] (route's last three)."""
        T, E = chosen.shape[0], self.num_experts
        flat = chosen.t().reshape(-1)  # priority order: all first choices, then all second ...
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        kept = counts
        cap = self.capacity(T)
        if cap:
            starts = counts.cumsum(0) - counts
            pos = torch.arange(flat.numel(), device=chosen.device) - starts[flat[order]]
            order = order[pos < cap]
            kept = counts.clamp(max=cap)
        return order, counts, kept

    @eager_under_compile  # data-dependent row counts: compiled code would specialise on each
    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs of the tokens `x` sorted by expert, `counts[e]` rows for expert e. Runs eagerly under
        training.compile (routing and combining around it are compiled)."""
        return self.experts(x, counts.tolist())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        T = h.shape[0]
        probs, weights, chosen = self.select(h)
        order, counts, kept = self.dispatch(chosen)
        token, slot = order % T, order // T
        y = self.run_experts(h[token], kept)
        y = y.float() * weights[token, slot].unsqueeze(-1)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device).index_add_(0, token, y).to(h.dtype)
        if self.shared is not None:
            out = out + self.shared(h)
        balance = self._balance(counts, probs)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            out = _AuxGrad.apply(out, balance, self.aux_scale())
        if self.seq_aux_loss_coef > 0 and torch.is_grad_enabled():
            seq = self._seq_balance(chosen, probs, shape[0] if x.dim() == 3 else 1)
            out = _AuxGrad.apply(out, seq, self.seq_aux_scale())
        if self.counted and _recording():
            self._record(counts, kept, balance)
        return out.view(shape)

    def aux_scale(self) -> float | torch.Tensor:
        """The gradient the balance term receives in backward (a seam: under tensor parallelism each
        rank feeds its share, parallel/dims/expert_parallel.py)."""
        return self.aux_loss_coef * self.aux_grad_scale

    def seq_aux_scale(self) -> float | torch.Tensor:
        """The gradient the sequence-wise balance term receives (the same seam as `aux_scale`)."""
        return self.seq_aux_loss_coef * self.aux_grad_scale

    def token_totals(self, assigned: torch.Tensor, prob_sum: torch.Tensor, tokens: int):
        """(assignments per expert, summed router probabilities, tokens) of the whole micro-batch from
        this call's. One process sees all of it; the seam context parallelism replaces to sum the
        ranks holding its other tokens (parallel/dims/expert_parallel.py)."""
        return assigned, prob_sum, tokens

    def _balance(self, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """E · Σ_e f_e · P_e over the micro-batch."""
        assigned, prob_sum, T = self.token_totals(counts.float(), probs.sum(0), probs.shape[0])
        return self.num_experts * (assigned / (T * self.top_k) * (prob_sum / T)).sum()

    def sequence_totals(self, assigned: torch.Tensor, prob_sum: torch.Tensor, tokens: int):
        """(assignments [B, E], summed normalised affinities [B, E], tokens) per whole sequence from this
        call's; the seam context parallelism replaces to sum the ranks holding the rest of each sequence."""
        return assigned, prob_sum, tokens

    def _seq_balance(self, chosen: torch.Tensor, probs: torch.Tensor, seqs: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance, mean over sequences of E/(k·S) · Σ_e count_e · P_e (P_e: the
        mean normalised affinity of e over the S tokens; 1.0 when balanced)."""
        T, E = probs.shape
        seq = torch.arange(T, device=probs.device) // (T // seqs)
        assigned = torch.bincount((seq[:, None] * E + chosen).flatten(), minlength=seqs * E).view(seqs, E)
        assigned, prob_sum, S = self.sequence_totals(assigned.float(), probs.view(seqs, -1, E).sum(1), T // seqs)
        return (E / (S * self.top_k) * (assigned * (prob_sum / S))).sum(-1).mean()

    def load(self) -> torch.Tensor:
        """[E] assignments per expert (before dropping) of this rank's training forwards since the step's
        `stats` were reset (float64; zeros before any)."""
        if self.stats is None:
            return torch.zeros(self.num_experts, dtype=torch.float64, device=self.router.weight.device)
        return self.stats[:self.num_experts].clone()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: bias += bias_update_rate · sign(mean load − load), `load` [E]
        summed over every rank that routes different tokens (a no-op without a bias or a rate)."""
        if self.expert_bias is not None and self.bias_update_rate > 0:
            step = torch.sign(load.mean() - load).to(self.expert_bias)
            self.expert_bias.add_(step, alpha=self.bias_update_rate)

    @torch.no_grad()
    def _record(self, counts: torch.Tensor, kept: torch.Tensor, balance: torch.Tensor) -> None:
        extra = torch.stack([(counts - kept).sum().double(), balance.detach().double(),
                             torch.ones((), dtype=torch.float64, device=counts.device)])
        row = torch.cat([counts.double(), extra])
        self.stats = row if self.stats is None else self.stats + row


def balanced_moes(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of `model` that update a selection bias, in module order (MTP blocks too)."""
    return [m for m in model.modules() if isinstance(m, MoE) and m.expert_bias is not None and m.bias_update_rate > 0]


def expert_loads(moes: list[MoE]) -> torch.Tensor:
    """[len(moes), E] float64: each module's `load()`, stacked for one all-reduce."""
    return torch.stack([m.load() for m in moes]) if moes else torch.zeros(0, 0, dtype=torch.float64)


def update_expert_biases(moes: list[MoE], loads: torch.Tensor) -> None:
    """`update_bias` of each module with its row of the summed `loads`."""
    for m, load in zip(moes, loads):
        m.update_bias(load)
