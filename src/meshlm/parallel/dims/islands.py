"""DiLoCo's outer step across islands (parallel.islands > 1, training.outer; docs/diloco.md).

Each island trains alone for H inner steps; then every rank takes its pseudo-gradient Δ = θ_outer − θ_inner
over the fp32 masters it owns (its optimizer's `state_storage`: whole tensors, TP slices, pipeline stages
or ZeRO shards alike), averages Δ with the ranks at the same place in every other island (the `islands`
group: they own the same elements), and takes one Nesterov SGD step on θ_outer, which every island then
restarts from; the inner optimizer's moments are kept. Streaming DiLoCo cuts the parameters into K
fragments (`fragment_of`, the model plan's) and syncs fragment k at inner steps ≡ k·H/K (mod H).

The outer gradient travels as fp32 (one all-reduce) or quantised (bf16, or float8 / int8 codes with one
fp32 scale per QUANT_BLOCK elements, all-gathered); every rank sums the islands' values in fp32 in island
order, so every island computes the same θ_outer. Bytes are booked as `outer` (plan/cost/islands.py's formula).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...distributed import float8_comm as f8
from ...core.facts.islands import TWO_STEP_FROM, padded, two_step_rows
from ...core.facts.quant import QUANT_BLOCK
from .zero.quantize import dequantize_rows, quantize_rows

KIND = "outer"  # the books' name for the outer sync's collectives (metrics.jsonl `comm.outer`)


class OuterSync:
    """θ_outer and its Nesterov momentum (fp32, laid out like this rank's masters), and the sync."""

    def __init__(self, optimizer, comm, outer, fragment_of: Callable[[str], int], device: torch.device, rounds=None):
        """`rounds`: island jobs, the rounds over the link each sync runs as (island_link.LinkedRounds)."""
        self.optimizer, self.comm, self.cfg, self.device = optimizer, comm, outer, device
        self.fragments: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(outer.fragments)]
        for name, kind, t in optimizer.state_storage():
            if kind == "master":
                self.fragments[fragment_of(name)].append((name, t))
        self.params = {name: t.detach().float().clone() for frag in self.fragments for name, t in frag}
        self.momentum = {name: torch.zeros_like(t) for name, t in self.params.items()}
        self.rounds = rounds
        self.pending_flag = None  # the previous step's stop flag, on its way across the islands
        # training.outer.delay: fragment -> (the step after which it lands, its mean: a tensor, or the
        # function that waits for it)
        self.pending: dict[int, tuple[int, object]] = {}

    def storage(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """What checkpoints hold (train/state.py): θ_outer and the momentum, by parameter name, and the means
        of delayed syncs in flight (`settle` first), laid out like the masters."""
        pending = {}
        for f, (_, mean) in sorted(self.pending.items()):
            at = 0
            for name, t in self.fragments[f]:
                pending[name] = mean[at:at + t.numel()].view(t.shape)
                at += t.numel()
        return [("param", self.params), ("momentum", self.momentum)] + ([("pending", pending)] if pending else [])

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
        """Wait for the last step's flag and the delayed averages (the run ended): no collective is left
        running at the teardown. A delayed sync that had not landed by the last step is not applied."""
        self.settle()
        if self.pending_flag is not None:
            self.pending_flag[0].wait()
            self.pending_flag = None

    @torch.no_grad()
    def after_step(self, step: int) -> list[int]:
        """The outer step of every fragment due after inner step `step` (with training.outer.delay τ: its
        average starts now and lands after step + τ); the fragments synced."""
        landed = self._land(step)
        due = self.due(step)
        for f in due:
            self.sync(f, step)
        if landed or (due and not self.cfg.delay):
            self.optimizer.loaded(self.optimizer.step_count())  # the new masters reach the parameters
        return due

    def _land(self, step: int) -> list[int]:
        """Delayed syncs whose τ steps are over: the outer step with the mean that travelled meanwhile,
        the masters mixed with θ_outer (training.outer.alpha: the local share kept)."""
        landed = [f for f, (at, _) in self.pending.items() if at == step]
        for f in landed:
            _, mean = self.pending.pop(f)
            self.apply(f, mean() if callable(mean) else mean, self.cfg.alpha)
        return landed

    def settle(self) -> None:
        """Wait for every delayed average in flight (a checkpoint holds the means, `storage`)."""
        for f, (at, mean) in self.pending.items():
            if callable(mean):
                self.pending[f] = (at, mean())

    def pending_meta(self) -> dict[str, int]:
        """meta.json's record of the delayed syncs: fragment -> the step after which it lands."""
        return {str(f): at for f, (at, _) in sorted(self.pending.items())}

    def expect_pending(self, meta: dict[str, int]) -> None:
        """A checkpoint taken with delayed syncs in flight: buffers its means load into (`storage`)."""
        self.pending = {int(f): (int(at), torch.zeros(self.size(int(f)), device=self.device)) for f, at in meta.items()}

    def sync(self, f: int, step: int = 0) -> None:
        """Δ averaged over the islands, one Nesterov step on θ_outer, the masters set to it (island jobs:
        as a round over the link, parallel/dims/island_link.py)."""
        if not self.fragments[f]:
            return
        if self.rounds is not None:
            self.rounds.sync(self, f, step)
            return
        if self.cfg.delay:  # overlapped with the next τ inner steps (streaming DiLoCo; torchft's sync delay)
            self.pending[f] = (step + self.cfg.delay, self.start_average(self.comm, self.delta(f)))
            return
        self.apply(f, self.average(self.comm, self.delta(f)))

    def delta(self, f: int) -> torch.Tensor:
        """Fragment f's Δ = θ_outer − θ_inner over this rank's masters, flat, on the compute device
        (offload = "optimizer" keeps masters in host memory)."""
        return torch.cat([(self.params[name] - t.float()).reshape(-1) for name, t in self.fragments[f]]).to(self.device)

    def size(self, f: int) -> int:
        return sum(t.numel() for _, t in self.fragments[f])

    @torch.no_grad()
    def apply(self, f: int, mean: torch.Tensor, alpha: float = 0.0) -> None:
        """The outer Nesterov step of fragment f with the islands' mean Δ; the masters set to θ_outer, or
        to alpha·masters + (1 − alpha)·θ_outer (a delayed sync: the inner steps taken meanwhile)."""
        frag = self.fragments[f]
        mean = mean.to(frag[0][1].device)
        lr, mu, at = self.cfg.lr, self.cfg.momentum, 0
        for name, t in frag:
            g = mean[at:at + t.numel()].view(t.shape)
            at += t.numel()
            buf = self.momentum[name].mul_(mu).add_(g)  # torch.optim.SGD(nesterov=True), dampening 0
            self.params[name].sub_(g.add(buf, alpha=mu), alpha=lr)
            if alpha:
                t.mul_(alpha).add_(self.params[name], alpha=1 - alpha)
            else:
                t.copy_(self.params[name])

    def average(self, comm, delta: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """The mean of every island's `delta` (fp32), as the outer gradient travels (training.outer.quantize);
        `count`: how many islands sent one (the others sent zeros: an island joining), default all."""
        return self.start_average(comm, delta, count)()

    def start_average(self, comm, delta: torch.Tensor, count: int | None = None) -> Callable[[], torch.Tensor]:
        """`average` started without waiting: the function that waits and returns the mean."""
        n, islands, q = delta.numel(), comm.size, self.cfg.quantize
        count = islands if count is None else count
        if q == "none":
            handle = comm.all_reduce(delta, kind=KIND, async_op=True)
            return lambda: _after(handle, lambda: delta.div_(count))
        if q == "bf16":
            got = torch.empty(islands * n, dtype=torch.bfloat16, device=delta.device)
            handle = comm.all_gather(got, delta.to(torch.bfloat16), kind=KIND, async_op=True)
            return lambda: _after(handle, lambda: _island_sum(got.view(islands, n).float()).div_(count))
        if islands >= TWO_STEP_FROM:
            return _two_step(comm, delta, q, count)
        rows = padded(n, q) // QUANT_BLOCK
        packed = _pack(F.pad(delta, (0, rows * QUANT_BLOCK - n)).view(rows, QUANT_BLOCK), q)
        got = torch.empty((islands,) + tuple(packed.shape), dtype=torch.uint8, device=delta.device)
        handle = comm.all_gather(got.view(-1), packed.view(-1), kind=KIND, async_op=True)
        return lambda: _after(handle, lambda: _island_sum(
            torch.stack([_unpack(p, q) for p in got]).view(islands, -1)[:, :n]).div_(count))


def _after(handle, then: Callable[[], torch.Tensor]) -> torch.Tensor:
    handle.wait()
    return then()


def _two_step(comm, delta: torch.Tensor, q: str, count: int) -> Callable[[], torch.Tensor]:
    """fp8 / int8 from TWO_STEP_FROM islands (plan/cost/islands.py `outer_sync_bytes`): island j receives every
    island's j-th 1/N chunk (all-to-all), sums them in fp32 in island order, sends the sum quantised again
    (all-gather); every rank decodes the same bits. Started without waiting: the all-to-all; the rest runs
    in the function returned."""
    n, islands = delta.numel(), comm.size
    rows = two_step_rows(n, islands)
    chunks = F.pad(delta, (0, rows * QUANT_BLOCK - n)).view(islands, rows // islands, QUANT_BLOCK)
    sent = torch.stack([_pack(c, q).reshape(-1) for c in chunks])
    got = torch.empty_like(sent)
    handle = comm.all_to_all(got.view(-1), sent.view(-1), kind=KIND, async_op=True)

    def finish() -> torch.Tensor:
        handle.wait()
        shape = _pack(chunks[0], q).shape
        mine = _island_sum(torch.stack([_unpack(p.view(shape), q).reshape(-1) for p in got])).div_(count)
        packed = _pack(mine.view(rows // islands, QUANT_BLOCK), q).reshape(-1)
        every = torch.empty(islands * packed.numel(), dtype=torch.uint8, device=delta.device)
        comm.all_gather(every, packed, kind=KIND)
        return torch.cat([_unpack(p.view(shape), q).reshape(-1) for p in every.view(islands, -1)])[:n]
    return finish


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


def outer_sync(par, ctx, layout, outer, plan, n_layers: int, rounds=None) -> OuterSync | None:
    """The outer step of a run with islands (None with one island: nothing changes); `rounds`: island
    jobs' rounds over the link (island_link.py `linked`)."""
    if layout.islands <= 1:
        return None
    return OuterSync(par.optimizer, ctx.comm("islands"), outer,
                     lambda name: plan.fragment_of(name, n_layers, outer.fragments), ctx.device, rounds)
