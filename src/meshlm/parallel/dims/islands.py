"""DiLoCo's outer step across islands (parallel.islands > 1, training.outer; docs/diloco.md).

Each island trains alone for H inner steps; then every rank takes its pseudo-gradient Δ = θ_outer − θ_inner
over the fp32 masters it owns (its optimizer's `state_storage`: whole tensors, TP slices, pipeline stages
or ZeRO shards alike), averages Δ with the ranks at the same place in every other island (the `islands`
group: they own the same elements), and takes one Nesterov SGD step on θ_outer, which every island then
restarts from; the inner optimizer's moments are kept. Streaming DiLoCo cuts the parameters into K
fragments (`fragment_of`, the model plan's) and syncs fragment k at inner steps ≡ k·H/K (mod H).

The outer gradient travels as fp32 (one all-reduce) or quantised (bf16, or float8 / int8 codes with one
fp32 scale per QUANT_BLOCK elements, all-gathered); every rank sums the islands' values in fp32 in island
order, so every island computes the same θ_outer. Bytes are booked as `outer` (plan/islands.py's formula).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...distributed import float8_comm as f8
from ...plan.islands import padded
from ...plan.volume import QUANT_BLOCK
from .zero.quantize import dequantize_rows, quantize_rows

KIND = "outer"  # the books' name for the outer sync's collectives (metrics.jsonl `comm.outer`)


class OuterSync:
    """θ_outer and its Nesterov momentum (fp32, laid out like this rank's masters), and the sync."""

    def __init__(self, optimizer, comm, outer, fragment_of: Callable[[str], int], device: torch.device):
        self.optimizer, self.comm, self.cfg, self.device = optimizer, comm, outer, device
        self.fragments: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(outer.fragments)]
        for name, kind, t in optimizer.state_storage():
            if kind == "master":
                self.fragments[fragment_of(name)].append((name, t))
        self.params = {name: t.detach().float().clone() for frag in self.fragments for name, t in frag}
        self.momentum = {name: torch.zeros_like(t) for name, t in self.params.items()}
        self.rounds = None  # island jobs: the rounds over the link (island_link.LinkedRounds)
        self.pending_flag = None  # the previous step's stop flag, on its way across the islands

    def storage(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """What checkpoints hold (train/state.py): θ_outer and the momentum, by parameter name."""
        return [("param", self.params), ("momentum", self.momentum)]

    @torch.no_grad()
    def restart_from_masters(self) -> None:
        """θ_outer = the masters, no momentum: DiLoCo starting from an ordinary (one-island) checkpoint."""
        for frag in self.fragments:
            for name, t in frag:
                self.params[name].copy_(t)
                self.momentum[name].zero_()

    @torch.no_grad()
    def rejoin(self) -> None:
        """The masters = θ_outer: an island that was not in the checkpoint (re)joins from the outer model."""
        for frag in self.fragments:
            for name, t in frag:
                t.copy_(self.params[name])

    def due(self, step: int) -> list[int]:
        """Fragments synced after inner step `step` (1-based): fragment k at step ≡ k·H/K (mod H)."""
        h, k = self.cfg.sync_every, self.cfg.fragments
        return [f for f in range(k) if step % h == f * h // k % h]

    def agree_stop(self, flag: torch.Tensor) -> torch.Tensor:
        """The stop decision of this step: the preemption flags of the step before, summed over every
        island. This step's flag (already summed over this island with the gradient norm) is sent without
        waiting, so the link's latency hides behind the next step instead of adding to each; every island
        then stops one step after a signal reached any of them, all at the same step. Island jobs stop
        each on its own (docs/diloco.md, "Losing an island"): their own flag, at once."""
        if self.comm.size == 1 or self.rounds is not None:
            return flag
        sent = flag.clone()
        pending, self.pending_flag = self.pending_flag, (self.comm.all_reduce(sent, kind="outer_flag", async_op=True), sent)
        if pending is None:
            return torch.zeros_like(flag)
        pending[0].wait()
        return pending[1]

    def drain(self) -> None:
        """Wait for the last step's flag (the run ended): no collective is left running at the teardown."""
        if self.pending_flag is not None:
            self.pending_flag[0].wait()
            self.pending_flag = None

    @torch.no_grad()
    def after_step(self, step: int) -> list[int]:
        """The outer step of every fragment due after inner step `step`; the fragments synced."""
        due = self.due(step)
        for f in due:
            self.sync(f, step)
        if due:
            self.optimizer.loaded(self.optimizer.step_count())  # the new masters reach the parameters
        return due

    def sync(self, f: int, step: int = 0) -> None:
        """Δ averaged over the islands, one Nesterov step on θ_outer, the masters set to it (island jobs:
        as a round over the link, parallel/dims/island_link.py)."""
        if not self.fragments[f]:
            return
        if self.rounds is not None:
            self.rounds.sync(f, step)
            return
        self.apply(f, self.average(self.comm, self.delta(f)))

    def delta(self, f: int) -> torch.Tensor:
        """Fragment f's Δ = θ_outer − θ_inner over this rank's masters, flat, on the compute device
        (offload = "optimizer" keeps masters in host memory)."""
        return torch.cat([(self.params[name] - t.float()).reshape(-1) for name, t in self.fragments[f]]).to(self.device)

    def size(self, f: int) -> int:
        return sum(t.numel() for _, t in self.fragments[f])

    @torch.no_grad()
    def apply(self, f: int, mean: torch.Tensor) -> None:
        """The outer Nesterov step of fragment f with the islands' mean Δ; the masters set to θ_outer."""
        frag = self.fragments[f]
        mean = mean.to(frag[0][1].device)
        lr, mu, at = self.cfg.lr, self.cfg.momentum, 0
        for name, t in frag:
            g = mean[at:at + t.numel()].view(t.shape)
            at += t.numel()
            buf = self.momentum[name].mul_(mu).add_(g)  # torch.optim.SGD(nesterov=True), dampening 0
            self.params[name].sub_(g.add(buf, alpha=mu), alpha=lr)
            t.copy_(self.params[name])

    def average(self, comm, delta: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """The mean of every island's `delta` (fp32), as the outer gradient travels (training.outer.quantize);
        `count`: how many islands sent one (the others sent zeros: an island joining), default all."""
        n, islands, q = delta.numel(), comm.size, self.cfg.quantize
        count = islands if count is None else count
        if q == "none":
            comm.all_reduce(delta, kind=KIND)
            return delta.div_(count)
        if q == "bf16":
            sent = delta.to(torch.bfloat16)
            got = torch.empty(islands * n, dtype=torch.bfloat16, device=delta.device)
            comm.all_gather(got, sent, kind=KIND)
            return _island_sum(got.view(islands, n).float()).div_(count)
        rows = padded(n, q) // QUANT_BLOCK
        x = F.pad(delta, (0, rows * QUANT_BLOCK - n)).view(rows, QUANT_BLOCK)
        packed = _pack(x, q)
        got = torch.empty((islands,) + tuple(packed.shape), dtype=torch.uint8, device=delta.device)
        comm.all_gather(got.view(-1), packed.view(-1), kind=KIND)
        return _island_sum(torch.stack([_unpack(p, q) for p in got]).view(islands, -1)[:, :n]).div_(count)


def _pack(x: torch.Tensor, q: str) -> torch.Tensor:
    """Rows of QUANT_BLOCK fp32 values -> uint8 rows of codes and scales (int8: zero/quantize.py's rows;
    fp8: distributed/float8_comm.py's, one e4m3 scale per row)."""
    if q == "int8":
        out = torch.empty(1, x.numel() + 4 * x.shape[0], dtype=torch.uint8, device=x.device)
        quantize_rows(x.reshape(1, -1), out)
        return out
    return f8.pack_rows(x, f8.scales_of(x.abs().amax(dim=1, keepdim=True)))


def _unpack(p: torch.Tensor, q: str) -> torch.Tensor:
    if q == "int8":
        return dequantize_rows(p, p.numel() * QUANT_BLOCK // (QUANT_BLOCK + 4))
    codes, scale = f8.unpack_rows(p, QUANT_BLOCK)
    return codes.float() / scale


def _island_sum(values: torch.Tensor) -> torch.Tensor:
    """(islands, n) -> their sum, in island order (the same bits on every rank)."""
    out = values[0].clone()
    for v in values[1:]:
        out.add_(v)
    return out


def outer_sync(par, ctx, layout, outer, plan, n_layers: int) -> OuterSync | None:
    """The outer step of a run with islands (None with one island: nothing changes)."""
    if layout.islands <= 1:
        return None
    return OuterSync(par.optimizer, ctx.comm("islands"), outer,
                     lambda name: plan.fragment_of(name, n_layers, outer.fragments), ctx.device)
