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


class MuonMatrix:
    """One Muon parameter on this rank: its fp32 master, momentum, and the TP splits of its matrix
    dimensions with the `Comm` each is gathered over."""

    def __init__(self, name: str, param: nn.Parameter, placement: Placement, comm_of: Callable):
        self.name, self.param = name, param
        self.master = param if param.dtype == torch.float32 else param.detach().float().clone()
        self.momentum = torch.zeros_like(self.master)
        self.grad: torch.Tensor | None = None  # its view of a DP gradient buffer (MuonAdamW.bind_grads)
        nd = param.dim()
        self.splits: list[tuple[DimSplit, object]] = [(s, comm_of(s.comm)) for s in placement.splits
                                                      if s.dim >= nd - 2 and s.parts > 1]
        whole = list(param.shape)
        for s, _ in self.splits:
            whole[s.dim] = s.size
        # the gathered tensor's own placement: slicing it back is `to_local` (padding and all)
        self.slicer = Placement(name, tuple(whole), tuple(s for s, _ in self.splits))
        self.scale = rms_scale(whole[-2], whole[-1])

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The whole matrices of which `t` is this rank's slice (kv replicas counted once)."""
        for s, comm in reversed(self.splits):
            out = t.new_empty(comm.size * t.numel())
            comm.all_gather(out, t.reshape(-1))
            rep = comm.size // s.parts
            t = torch.cat(list(out.view((comm.size,) + tuple(t.shape))[::rep]), dim=s.dim).narrow(s.dim, 0, s.size)
        return t

    def orthogonal_update(self, grad: torch.Tensor, momentum: float, steps: int) -> torch.Tensor:
        """Momentum in place, then this rank's slice of the scaled orthogonalised Nesterov update."""
        self.momentum.mul_(momentum).add_(grad)
        update = grad.add(self.momentum, alpha=momentum)
        ortho = newton_schulz(self.gather(update), steps)
        return (self.slicer.to_local(ortho) if self.splits else ortho).mul_(self.scale)


class MuonAdamW:  # implements parallel.adamw.Optimizer
    """Muon on `muon` parameters, the AdamW optimizer `make_optimizer` builds on the others.

    The Muon learning rate follows AdamW's schedule: `set_lr(lr)` gives Muon `muon_lr · lr / optim.lr`.
    Decoupled weight decay at optim.weight_decay, as AdamW's on matrices. For the DP gradient buffers
    it exposes `.names`, `.params` and `.groups` (AdamW's flat groups, then the Muon matrices grouped by
    `group_key` with `grad_sync.flat_groups`) and takes the buffers back in `bind_grads`."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], cfg: OptimConfig, device: torch.device,
                 make_optimizer: Callable, muon: set[str], table: PlacementTable, comm_of: Callable,
                 group_key: Callable[[str], Hashable] | None = None):
        self.cfg = cfg
        self.adamw = make_optimizer([(n, p) for n, p in named if n not in muon], cfg, device, group_key=group_key)
        self.matrices = [MuonMatrix(n, p, table[n], comm_of) for n, p in named if n in muon]
        key = group_key or (lambda name: None)
        self.muon_groups = flat_groups([key(m.name) for m in self.matrices], [m.param.numel() for m in self.matrices])
        first = len(self.adamw.params)
        self.names = self.adamw.names + [m.name for m in self.matrices]
        self.params = self.adamw.params + [m.param for m in self.matrices]
        self.groups = self.adamw.groups + [[first + i for i in g] for g in self.muon_groups]
        self.lr = cfg.muon_lr or cfg.lr

    def bind_grads(self, flat_grads: list[torch.Tensor]) -> None:
        """The gradient buffers of `groups`, in order: AdamW's go to it, each Muon matrix takes its view."""
        n = len(self.adamw.groups)
        self.adamw.bind_grads(flat_grads[:n])
        for group, buf in zip(self.muon_groups, flat_grads[n:], strict=True):
            off = 0
            for i in group:
                m = self.matrices[i]
                m.grad = buf[off:off + m.param.numel()].view(m.param.shape)
                off += m.param.numel()

    def set_lr(self, lr: float) -> None:
        self.adamw.set_lr(lr)
        self.lr = (self.cfg.muon_lr or self.cfg.lr) * lr / self.cfg.lr

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """AdamW's step (it skips itself on `found_inf`), then Muon's unless `found_inf` is set (a host
        read: the fused kernel's on-device skip has no Muon counterpart)."""
        self.adamw.step(found_inf)
        if found_inf is not None and bool(found_inf):
            return
        cfg = self.cfg
        for m in self.matrices:
            update = m.orthogonal_update(m.grad, cfg.muon_momentum, cfg.muon_ns_steps)
            m.master.mul_(1.0 - self.lr * cfg.weight_decay).add_(update, alpha=-self.lr)
        self._publish()

    def _publish(self) -> None:
        copies = [(m.param, m.master) for m in self.matrices if m.master is not m.param]
        if copies:
            torch._foreach_copy_([p for p, _ in copies], [m for _, m in copies])

    def param_tensors(self) -> list[torch.Tensor]:
        return self.params

    def state_bytes(self) -> int:
        """AdamW's state, Muon's momentum and its separate fp32 masters."""
        own = [m.momentum for m in self.matrices] + [m.master for m in self.matrices if m.master is not m.param]
        return self.adamw.state_bytes() + sum(t.numel() * t.element_size() for t in own)

    def step_count(self) -> int:
        return self.adamw.step_count()

    def state_storage(self) -> list[tuple[str, str, torch.Tensor]]:
        """AdamW's pieces, then each Muon matrix's master and `momentum` (laid out like an Adam moment)."""
        out = self.adamw.state_storage()
        for m in self.matrices:
            out += [(m.name, "master", m.master), (m.name, "momentum", m.momentum)]
        return out

    @torch.no_grad()
    def loaded(self, step: int) -> None:
        self.adamw.loaded(step)
        self._publish()

    def backing(self, name: str, kind: str) -> None:
        return None  # in memory

    def close(self) -> None:
        self.adamw.close()
