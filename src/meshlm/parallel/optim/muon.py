"""Muon (Jordan et al. 2024) on the blocks' matrices, AdamW on the rest, behind one `adamw.Optimizer`.

Muon keeps one momentum buffer per matrix, takes the Nesterov update, orthogonalises it with a few
quintic Newton-Schulz iterations and scales it by 0.2·sqrt(max(rows, cols)) (Moonlight, Liu et al. 2025),
which makes its RMS about AdamW's, so the AdamW learning rate and weight decay carry over.

Newton-Schulz needs the whole matrix. Momentum and the weight update are elementwise, so they run on
whatever piece this rank holds; only the Nesterov update travels. The matrices split by tensor
parallelism (a `DimSplit` of one of its last two dimensions, from the placement record) are dealt over
the split's ranks (`deal`: round-robin in order of decreasing NS cost, so the ranks' NS work differs
by at most one matrix's), and each is orthogonalised by its owner alone: one all-to-all sends every
owner the slices of its matrices, the owner joins and orthogonalises them, and the mirrored all-to-all
returns each rank the slices of the results (`owner_exchange`; optim/zero_muon.py runs the same exchange over
the shard group). Without ZeRO the split matrices travel in buckets of consecutive matrices (`buckets`,
one all-to-all pair each, the deal kept whole-step), so the exchange holds one bucket at a time.
Stacked expert weights [E, rows, cols] are orthogonalised per expert (a batched Newton-Schulz over the
experts this rank holds: the expert dimension's split over ep needs no gathering). Which parameters
are Muon's comes from the model plan (`muon_params`); this module knows no model names.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, NamedTuple

import torch
from torch import nn

from ...core.config import OptimConfig
from ..dims.grad_sync import flat_groups
from ..placement import DimSplit, Placement, PlacementTable

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


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    """Newton-Schulz's GEMM FLOPs on whole matrices of `shape` ([..., rows, cols]): per iteration the
    Gram matrix (2·m·m·n), its square (2·m³) and the product with the iterate (2·m·m·n), m ≤ n."""
    m, n = sorted(shape[-2:])
    return steps * math.prod(shape[:-2]) * (4 * m * m * n + 2 * m ** 3)


def deal(costs: list[float], n: int) -> list[int]:
    """Each item's owner among n ranks: round-robin in order of decreasing cost (ties by index), so any
    two ranks' totals differ by at most the largest cost. The same on every rank that lists the same costs."""
    owners = [0] * len(costs)
    for j, k in enumerate(sorted(range(len(costs)), key=lambda k: (-costs[k], k))):
        owners[k] = j % n
    return owners


class Route(NamedTuple):
    """An owner exchange over one group, the same every step: `at`, each item's offset in this rank's
    send buffer (its pieces by owner, then item); `send`/`recv`, the all-to-all splits (this rank's
    pieces per owner; every rank's pieces of this rank's items); `owned`, this rank's items with the
    (offset, length) of each sender's piece in the received buffer, in rank order (empty ones left out)."""
    at: list[int]
    send: list[int]
    recv: list[int]
    owned: list[tuple[int, list[tuple[int, int]]]]


def plan_route(owners: list[int], size: Callable[[int, int], int], n: int, me: int) -> Route:
    """The route of items owned by `owners`; size(k, r): how many elements of item k rank r holds."""
    send, at, pos = [0] * n, 0, [0] * len(owners)
    for k in sorted(range(len(owners)), key=lambda k: (owners[k], k)):
        pos[k] = at
        send[owners[k]] += size(k, me)
        at += size(k, me)
    mine = [k for k, o in enumerate(owners) if o == me]
    recv, pieces, at = [0] * n, {k: [] for k in mine}, 0
    for r in range(n):  # received buffer: by sender, then item, as each sender ordered it
        for k in mine:
            if sz := size(k, r):
                pieces[k].append((at, sz))
                recv[r] += sz
                at += sz
    return Route(pos, send, recv, [(k, pieces[k]) for k in mine])


def owner_exchange(comm, route: Route, buf: torch.Tensor, work: Callable) -> None:
    """`buf` (this rank's pieces at `route.at`) sent to the owners; work(items, pieces) returns each
    owned item's result flat, its pieces' results back to back in rank order; the results return into
    `buf` where the pieces were. Two all-to-alls over `comm`, booked there."""
    got = buf.new_empty(sum(route.recv))
    comm.all_to_all(got, buf, route.recv, route.send)
    views = [[got[a:a + n] for a, n in pieces] for _, pieces in route.owned]
    for pieces, result in zip(views, work([k for k, _ in route.owned], views), strict=True):
        p = 0
        for v in pieces:
            v.copy_(result[p:p + v.numel()])
            p += v.numel()
    comm.all_to_all(buf, got, route.send, route.recv)


class Orthogonaliser:
    """Newton-Schulz for one Muon parameter whose local piece has `local_shape`: its TP split of a
    matrix dimension (from the placement record; `split`, `comm`), the whole matrix's shape, its NS
    cost (`flops`) and Moonlight scale; `runs` counts the Newton-Schulz calls on this rank."""

    def __init__(self, local_shape: tuple[int, ...], placement: Placement, comm_of: Callable, steps: int):
        nd, self.steps, self.local_shape = len(local_shape), steps, tuple(local_shape)
        splits = [s for s in placement.splits if s.dim >= nd - 2 and s.parts > 1]
        if len(splits) > 1:
            raise ValueError(f"Muon: {placement.name} is split along both matrix dimensions; one split at most")
        self.split: DimSplit | None = splits[0] if splits else None
        self.comm = comm_of(self.split.comm) if self.split else None
        whole = list(local_shape)
        if self.split:
            whole[self.split.dim] = self.split.size
        self.whole, self.numel = tuple(whole), math.prod(local_shape)
        self.scale = rms_scale(whole[-2], whole[-1])
        self.flops = ns_flops(self.whole, steps)
        self.runs = 0

    def __call__(self, whole: torch.Tensor) -> torch.Tensor:
        """The scaled, orthogonalised `whole`."""
        self.runs += 1
        return newton_schulz(whole, self.steps).mul_(self.scale)

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole matrices from every rank's flat slice, in rank order (kv replicas counted once)."""
        s = self.split
        rep = len(pieces) // s.parts
        return torch.cat([p.view(self.local_shape) for p in pieces[::rep]], dim=s.dim).narrow(s.dim, 0, s.size)

    def cut(self, whole: torch.Tensor, ranks: int) -> torch.Tensor:
        """Every rank's slice of `whole`, flat, back to back in rank order (padding zero)."""
        s = self.split
        if s.padded > s.size:
            pad = list(whole.shape)
            pad[s.dim] = s.padded - s.size
            whole = torch.cat([whole, whole.new_zeros(pad)], dim=s.dim)
        rep = ranks // s.parts
        return torch.cat([whole.narrow(s.dim, (r // rep) * s.chunk, s.chunk).reshape(-1) for r in range(ranks)])


def buckets(sizes: list[int], owners: list[int], n: int, cap: int | None) -> list[list[int]]:
    """Consecutive runs of items (`sizes`: elements of each on every rank, `owners` from `deal`) such that
    a run's send buffer (the sizes) stays within max(cap, the largest size) and every owner's receive
    buffer (n x the size of each of its items) within max(cap, the largest whole item): the largest
    matrix forces those two anyway. The same on every rank; cap None: one run."""
    if cap is None or not sizes:
        return [list(range(len(sizes)))]
    send_cap, recv_cap = max(cap, max(sizes)), max(cap, n * max(sizes))
    out, send, recv = [[]], 0, [0] * n
    for k, (sz, o) in enumerate(zip(sizes, owners, strict=True)):
        if out[-1] and (send + sz > send_cap or recv[o] + n * sz > recv_cap):
            out.append([])
            send, recv = 0, [0] * n
        out[-1].append(k)
        send += sz
        recv[o] += n * sz
    return out


class Bucket(NamedTuple):
    """Items exchanged together (indices into SplitExchange.orthos) and their route (items renumbered 0..)."""
    items: list[int]
    route: Route


class SplitExchange:
    """Newton-Schulz for matrices split over one `Comm`, each on one owner (`owners`, from `deal` over
    all of them), in `buckets` of at most `cap_bytes` (fp32; None: one bucket), one all-to-all pair each."""

    def __init__(self, orthos: list[Orthogonaliser], owners: list[int], cap_bytes: int | None = None):
        comms = {o.split.comm for o in orthos}
        if len(comms) > 1:
            raise ValueError(f"Muon: matrices split over several groups {sorted(comms)}; one at most")
        self.orthos, self.owners, self.comm = orthos, owners, orthos[0].comm
        n, me = self.comm.size, self.comm.rank
        sizes = [o.numel for o in orthos]
        cap = None if cap_bytes is None else cap_bytes // 4
        self.buckets = [Bucket(items, plan_route([owners[k] for k in items], lambda j, r, items=items: sizes[items[j]],
                                                 n, me)) for items in buckets(sizes, owners, n, cap)]

    def buffer_bytes(self) -> int:
        """The largest bucket's send and receive buffers together, fp32, on this rank."""
        return max(4 * (sum(b.route.send) + sum(b.route.recv)) for b in self.buckets)

    def _work(self, b: Bucket, js: list[int], pieces: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        n = self.comm.size
        return [self.orthos[k].cut(self.orthos[k](self.orthos[k].join(p)), n)
                for k, p in zip((b.items[j] for j in js), pieces)]

    def run(self, fill: Callable, use: Callable, device: torch.device) -> None:
        """Per bucket: fill(k, view) writes item k's update into its flat view of the bucket's fresh fp32
        buffer; after the exchange use(k, view) reads the results for this rank's slices there."""
        for b in self.buckets:
            buf = torch.empty(sum(b.route.send), dtype=torch.float32, device=device)
            views = [buf[a:a + self.orthos[k].numel] for k, a in zip(b.items, b.route.at)]
            for k, v in zip(b.items, views):
                fill(k, v)
            owner_exchange(self.comm, b.route, buf, lambda js, pieces, b=b: self._work(b, js, pieces))
            for k, v in zip(b.items, views):
                use(k, v)
            del buf, views


def nesterov_(momentum: torch.Tensor, grad: torch.Tensor, beta: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Momentum in place; the Nesterov update g + β·m (into `out` where given)."""
    momentum.mul_(beta).add_(grad)
    return torch.add(grad, momentum, alpha=beta, out=out)


class LocalMuon:
    """Muon over whole local tensors (no ZeRO): each matrix's fp32 master (the parameter itself in
    fp32), momentum and its view of a DP gradient buffer (`bind_grads`)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], cfg: OptimConfig, table: PlacementTable,
                 comm_of: Callable, group_key: Callable[[str], Hashable] | None = None,
                 bucket_bytes: int | None = None):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.momenta = [torch.zeros_like(m) for m in self.masters]
        self.ortho = [Orthogonaliser(tuple(p.shape), table[n], comm_of, cfg.muon_ns_steps) for n, p in named]
        self.split = [i for i, o in enumerate(self.ortho) if o.split]  # orthogonalised by one owner each
        self.exchange = None
        if self.split:  # the deal over all of them; the buckets only bound the buffers
            orthos = [self.ortho[i] for i in self.split]
            self.exchange = SplitExchange(orthos, deal([o.flops for o in orthos], orthos[0].comm.size), bucket_bytes)
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
        """The split matrices' updates go through the owner exchange a bucket at a time, each applied
        before the next bucket's buffer exists; the others are orthogonalised here."""
        def fill(k: int, v: torch.Tensor) -> None:
            i = self.split[k]
            nesterov_(self.momenta[i], self.grads[i], cfg.muon_momentum, out=v.view(self.masters[i].shape))

        def use(k: int, v: torch.Tensor) -> None:
            self._apply(self.split[k], v.view(self.masters[self.split[k]].shape), lr, cfg)
        if self.exchange is not None:
            self.exchange.run(fill, use, self.masters[0].device)
        for i, (mom, grad, ortho) in enumerate(zip(self.momenta, self.grads, self.ortho)):
            if not ortho.split:
                self._apply(i, ortho(nesterov_(mom, grad, cfg.muon_momentum)), lr, cfg)
        self.publish()

    def _apply(self, i: int, update: torch.Tensor, lr: float, cfg: OptimConfig) -> None:
        self.masters[i].mul_(1.0 - lr * cfg.weight_decay).add_(update, alpha=-lr)

    def orthogonalisers(self) -> list[tuple[str, Orthogonaliser]]:
        """Every Muon matrix's Orthogonaliser (their `runs`: the Newton-Schulz calls on this rank)."""
        return list(zip(self.names, self.ortho))

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


class MuonAdamW:  # implements parallel.optim.adamw.Optimizer
    """Muon (`muon`: LocalMuon, or optim/zero_muon.ZeroMuon over ZeRO's shards) next to an AdamW optimizer
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
              group_key: Callable[[str], Hashable] | None = None, bucket_bytes: int | None = None) -> "MuonAdamW":
        """Without ZeRO: `make_optimizer` (parallel/optim/master.MasterOptimizer) on the parameters outside `muon`;
        `bucket_bytes`: the cap of the tp exchange's buckets (parallel.bucket_mb; None: one bucket)."""
        adamw = make_optimizer([(n, p) for n, p in named if n not in muon], cfg, device, group_key=group_key)
        return cls(adamw, LocalMuon([(n, p) for n, p in named if n in muon], cfg, table, comm_of, group_key,
                                    bucket_bytes), cfg)

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
