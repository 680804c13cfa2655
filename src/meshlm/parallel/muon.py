"""Muon (Jordan et al. 2024) on the blocks' matrices, AdamW on the rest, behind one `adamw.Optimizer`.

Muon keeps one momentum buffer per matrix, takes the Nesterov update, orthogonalises it with a few
quintic Newton-Schulz iterations and scales it by 0.2·sqrt(max(rows, cols)) (Moonlight, Liu et al. 2025),
which makes its RMS about AdamW's, so the AdamW learning rate and weight decay carry over.

Newton-Schulz needs the whole matrix. Momentum and the weight update are elementwise, so they run on
whatever piece this rank holds; only the Nesterov update travels: a matrix split by tensor parallelism
(a `DimSplit` of one of its last two dimensions, from the placement record) is all-gathered over that
split's `Comm`, orthogonalised whole, and each rank keeps its slice. Stacked expert weights
[E, rows, cols] are orthogonalised per expert (a batched Newton-Schulz over the experts this rank holds:
the expert dimension's split over ep needs no gathering). Which parameters are Muon's comes from the
model plan (`muon_params`); this module knows no model names.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable

import torch
from torch import nn

from ..config import OptimConfig
from .grad_sync import flat_groups
from .placement import DimSplit, Placement, PlacementTable

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic of Jordan et al.'s reference implementation


def newton_schulz(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with the singular vectors of each matrix of `g` ([..., rows,
    cols]): `steps` quintic iterations on g/‖g‖ (singular values land near 1, within about ±0.3, which
    is what Muon wants, not exact orthogonality). Runs in fp32 so that every layout rounds alike."""
    x = g.float()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x if wide else x.mT


def rms_scale(rows: int, cols: int) -> float:
    """Moonlight's factor: an orthogonal rows×cols matrix has RMS 1/sqrt(max(rows, cols)); this brings
    it to 0.2, about the RMS of an AdamW update."""
    return 0.2 * math.sqrt(max(rows, cols))


class Orthogonaliser:
    """Newton-Schulz for one Muon parameter whose local piece has `local_shape`: the TP splits of its
    matrix dimensions (from the placement record) with the `Comm` each is gathered over, and the
    Moonlight scale of the whole matrix."""

    def __init__(self, local_shape: tuple[int, ...], placement: Placement, comm_of: Callable, steps: int):
        nd, self.steps = len(local_shape), steps
        self.splits: list[tuple[DimSplit, object]] = [(s, comm_of(s.comm)) for s in placement.splits
                                                      if s.dim >= nd - 2 and s.parts > 1]
        whole = list(local_shape)
        for s, _ in self.splits:
            whole[s.dim] = s.size
        # the gathered tensor's own placement: slicing it back is `to_local` (padding and all)
        self.slicer = Placement(placement.name, tuple(whole), tuple(s for s, _ in self.splits))
        self.scale = rms_scale(whole[-2], whole[-1])

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole matrices of which `t` is this rank's slice (kv replicas counted once)."""
        for s, comm in reversed(self.splits):
            out = t.new_empty(comm.size * t.numel())
            comm.all_gather(out, t.reshape(-1))
            rep = comm.size // s.parts
            t = torch.cat(list(out.view((comm.size,) + tuple(t.shape))[::rep]), dim=s.dim).narrow(s.dim, 0, s.size)
        return t

    def __call__(self, update: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the scaled, orthogonalised whole of `update` (a collective over the
        TP splits' comms, where there are any)."""
        ortho = newton_schulz(self.gather(update), self.steps)
        return (self.slicer.to_local(ortho) if self.splits else ortho).mul_(self.scale)


def nesterov_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Momentum in place; the Nesterov update g + β·m (into `out` where given)."""
    momentum.mul_(beta).add_(grad)
    return torch.add(grad, momentum, alpha=beta, out=out)


class LocalMuon:
    """Muon over whole local tensors (no ZeRO): each matrix's fp32 master (the parameter itself in
    fp32), momentum and its view of a DP gradient buffer (`bind_grads`)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], cfg: OptimConfig, table: PlacementTable,
                 comm_of: Callable, group_key: Callable[[str], Hashable] | None = None):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.momenta = [torch.zeros_like(m) for m in self.masters]
        self.ortho = [Orthogonaliser(tuple(p.shape), table[n], comm_of, cfg.muon_ns_steps) for n, p in named]
        self.grads: list[torch.Tensor | None] = [None] * len(named)
        key = group_key or (lambda name: None)
        self.groups = flat_groups([key(n) for n in self.names], [p.numel() for p in self.params])

    def bind_grads(self, flat_grads: list[torch.Tensor]) -> None:
        """One DP gradient buffer per group of `groups`; each matrix takes its view."""
        for group, buf in zip(self.groups, flat_grads, strict=True):
            off = 0
            for i in group:
                n = self.params[i].numel()
                self.grads[i] = buf[off:off + n].view(self.params[i].shape)
                off += n

    def step(self, lr: float, cfg: OptimConfig) -> None:
        for master, mom, grad, ortho in zip(self.masters, self.momenta, self.grads, self.ortho):
            update = ortho(nesterov_(mom, grad, cfg.muon_momentum))
            master.mul_(1.0 - lr * cfg.weight_decay).add_(update, alpha=-lr)
        self.publish()

    def publish(self) -> None:
        copies = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        if copies:
            torch._foreach_copy_([p for p, _ in copies], [m for _, m in copies])

    def storage(self) -> list[tuple[str, str, torch.Tensor]]:
        return [(n, kind, t) for n, m, mom in zip(self.names, self.masters, self.momenta)
                for kind, t in (("master", m), ("momentum", mom))]

    def param_tensors(self) -> list[torch.Tensor]:
        return self.params

    def own_tensors(self) -> list[torch.Tensor]:
        """Optimizer-only tensors: momenta and separate masters."""
        return self.momenta + [m for p, m in zip(self.params, self.masters) if m is not p]


class MuonAdamW:  # implements parallel.adamw.Optimizer
    """Muon (`muon`: LocalMuon, or zero/muon.ZeroMuon over ZeRO's shards) next to an AdamW optimizer
    over the other parameters (`adamw`).

    The Muon learning rate follows AdamW's schedule: `set_lr(lr)` gives Muon `muon_lr · lr / optim.lr`.
    Decoupled weight decay at optim.weight_decay, as AdamW's on matrices. Muon steps first: under ZeRO
    AdamW's step ends by releasing the gradient shards and publishing the masters, Muon's included.
    Without ZeRO it exposes `.names`, `.params` and `.groups` (AdamW's flat groups, then Muon's) for
    the DP gradient buffers and takes them back in `bind_grads`."""

    def __init__(self, adamw, muon, cfg: OptimConfig):
        self.adamw, self.muon, self.cfg = adamw, muon, cfg
        self.names = adamw.names + muon.names
        self.params = adamw.params + muon.params
        first = len(adamw.params)
        self.groups = getattr(adamw, "groups", []) + [[first + i for i in g] for g in getattr(muon, "groups", [])]
        self.lr = cfg.muon_lr or cfg.lr

    @classmethod
    def local(cls, named: list[tuple[str, nn.Parameter]], cfg: OptimConfig, device: torch.device,
              make_optimizer: Callable, muon: set[str], table: PlacementTable, comm_of: Callable,
              group_key: Callable[[str], Hashable] | None = None) -> "MuonAdamW":
        """Without ZeRO: `make_optimizer` (train/optim.MasterOptimizer) on the parameters outside `muon`."""
        adamw = make_optimizer([(n, p) for n, p in named if n not in muon], cfg, device, group_key=group_key)
        return cls(adamw, LocalMuon([(n, p) for n, p in named if n in muon], cfg, table, comm_of, group_key), cfg)

    def bind_grads(self, flat_grads: list[torch.Tensor]) -> None:
        """The gradient buffers of `groups`, in order: AdamW's first, then Muon's."""
        n = len(self.adamw.groups)
        self.adamw.bind_grads(flat_grads[:n])
        self.muon.bind_grads(flat_grads[n:])

    def set_lr(self, lr: float) -> None:
        self.adamw.set_lr(lr)
        self.lr = (self.cfg.muon_lr or self.cfg.lr) * lr / self.cfg.lr

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """Muon's step unless `found_inf` is set (a host read: the fused AdamW kernel's on-device skip
        has no Muon counterpart), then AdamW's (which skips itself)."""
        if found_inf is None or not bool(found_inf):
            self.muon.step(self.lr, self.cfg)
        self.adamw.step(found_inf)

    def param_tensors(self) -> list[torch.Tensor]:
        return self.adamw.param_tensors() + self.muon.param_tensors()

    def state_bytes(self) -> int:
        """AdamW's state, Muon's momenta and its separate fp32 masters."""
        return self.adamw.state_bytes() + sum(t.numel() * t.element_size() for t in self.muon.own_tensors())

    def step_count(self) -> int:
        return self.adamw.step_count()

    def state_storage(self) -> list[tuple[str, str, torch.Tensor]]:
        """AdamW's pieces, then each Muon matrix's master and `momentum` (laid out like an Adam moment)."""
        return self.adamw.state_storage() + self.muon.storage()

    @torch.no_grad()
    def loaded(self, step: int) -> None:
        self.muon.publish()
        self.adamw.loaded(step)

    def backing(self, name: str, kind: str) -> None:
        return None  # in memory

    def close(self) -> None:
        self.adamw.close()
