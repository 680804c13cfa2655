"""AdamW on this rank's shard of every ZeRO unit, on the device or in CPU memory (parallel.offload).

Each unit's fp32 master shard is a flat tensor of the shard size, its Adam moments the same less the
pieces another optimizer steps (`skip`: Muon's matrices, which keep one momentum of their own); the
optimizer sees one view per run of neighbouring pieces with the same weight decay (`Unit.decay_runs`,
units.py), so weight decay stays per tensor (`grad_sync.decays`, as in parallel/optim/master.MasterOptimizer),
results match the unsharded optimizer element for element, and the step's list is a few tensors per unit.
With fp32 compute and no offload the master *is* the parameter shard (no copy). With offload the
masters, moments and a gradient staging buffer live in (pinned) host memory, the step runs on the CPU
and the updated shards are copied back asynchronously. Fused AdamW wherever torch has it for the
device the step runs on, else foreach: the same choice as MasterOptimizer (parallel/optim/adamw
`fused_adamw_supported`), so ZeRO and one process do the same arithmetic, and an fp16 overflow skips
the step on the device (`found_inf`) without a host read.
Checkpoints take each parameter's range of the flat master / moments as it is (`state_storage`):
the placement records say where that range lies in the full tensor, so nothing is gathered.
"""
from __future__ import annotations

import torch

from ...core.config import OptimConfig
from ..dims.zero.sync import ZeroSync
from ..dims.zero.units import Unit
from .adamw import adamw_step, fused_adamw_supported


class ZeroOptimizer:
    """The optimizer `parallelize` returns for zero >= 1 (same interface as MasterOptimizer)."""

    def __init__(self, zero: ZeroSync, cfg: OptimConfig, offload: bool, skip: frozenset[str] = frozenset()):
        """`skip`: parameters another optimizer steps (optim/zero_muon.py): no AdamW update or checkpoint state."""
        self.zero, self.offload, self.skip = zero, offload, skip
        self.params = [p for u in zero.units for p in u.params]
        self.names = [n for u in zero.units for n in u.names]
        dev = zero.units[0].device
        pin = offload and torch.cuda.is_available()
        host = torch.device("cpu") if offload else dev
        # per unit: (unit, master, grad the optimizer reads, exp_avg, exp_avg_sq)
        self.slots: list[tuple[Unit, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        decay, no_decay, segs = [], [], []
        self.bind: list[tuple[Unit, int, int, torch.Tensor]] = []  # segments whose grad is per step
        for u in zero.units:
            if not offload and u.shard.dtype == torch.float32:
                master = u.shard
            else:
                master = torch.empty(u.shard_size, dtype=torch.float32, device=host, pin_memory=pin)
                master.copy_(u.shard)
            # the optimizer's gradient: a host staging buffer (offload), the persistent shard (zero 1),
            # or the shard of the step, bound in step() (zero 2-3 free it between steps)
            grad = torch.zeros(u.shard_size, device=host, pin_memory=pin) if offload else u.grad_shard
            width = u.shard_size - sum(seg.end - seg.start for seg in _skipped(u, skip))
            m = torch.zeros(width, device=host, pin_memory=pin)
            v = torch.zeros(width, device=host, pin_memory=pin)
            self.slots.append((u, master, grad, m, v))
            for d, s0, s1 in u.decay_runs(skip):
                seg = master[s0:s1]
                if grad is not None:
                    seg.grad = grad[s0:s1]
                else:
                    self.bind.append((u, s0, s1, seg))
                (decay if d else no_decay).append(seg)
                o = _moment_offset(u, skip, s0)
                segs.append((seg, m[o:o + s1 - s0], v[o:o + s1 - s0]))
        self.masters = [s[1] for s in self.slots]
        self.fused = fused = fused_adamw_supported(host)
        # offload: the step's found_inf flag, staged to the host with the gradients
        self.found_inf_host = torch.zeros((), device="cpu", pin_memory=pin) if offload else None
        groups = [{"params": g, "weight_decay": wd} for g, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) if g]
        if not groups:  # a rank whose shards hold only padding still needs an optimizer
            groups = [{"params": [torch.zeros(0, device=host)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                     **({"fused": True} if fused else {"foreach": True}))
        step_dev = host if fused else torch.device("cpu")
        for seg, m, v in segs:  # moments exist from the start: memory is what it will be, loads fit
            self.opt.state[seg] = {"step": torch.zeros((), dtype=torch.float32, device=step_dev),
                                   "exp_avg": m, "exp_avg_sq": v}

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """`found_inf` (fp16 loss scaling): a device flag, 1.0 to skip this step. Fused, the kernel
        skips on the device and the unchanged shards are published as after any step; otherwise it
        is read on the host (parallel/optim/adamw `adamw_step`)."""
        if self.offload:
            for u, _, grad, _, _ in self.slots:
                grad.copy_(u.grad_shard, non_blocking=True)
            if found_inf is not None:  # a pinned host copy, complete after the synchronize below
                self.found_inf_host.copy_(found_inf, non_blocking=True)
                found_inf = self.found_inf_host
            if self.slots and self.slots[0][0].device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        for u, s0, s1, seg in self.bind:
            seg.grad = u.grad_shard[s0:s1]
        stepped = adamw_step(self.opt, self.fused, found_inf)
        for *_, seg in self.bind:
            seg.grad = None
        self.zero.release_grads()
        if stepped:
            self._publish()

    def _publish(self) -> None:
        """Masters -> compute shards (host-to-device, async from pinned memory), then zero 1-2 gather."""
        for u, master, _, _, _ in self.slots:
            if master is not u.shard:
                u.shard.copy_(master, non_blocking=True)
        self.zero.publish()

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter memory this rank keeps (train/observe/metrics.py `memory`): full flat buffers for zero 1-2, the
        shards for zero 3 (gathered blocks are transient and show in the peak only)."""
        return [u.shard if self.zero.switches.shard_params else u.full for u, *_ in self.slots]

    def state_bytes(self) -> int:
        """Adam moments, separate fp32 masters and the offload gradient staging buffers."""
        seen, total = set(), 0
        for u, master, grad, m, v in self.slots:
            for t in (m, v, master if master is not u.shard else None, grad if self.offload else None):
                if t is not None and (t.data_ptr(), t.device) not in seen:
                    seen.add((t.data_ptr(), t.device))
                    total += t.untyped_storage().nbytes()
        return total

    def backing(self, name: str, kind: str) -> None:
        return None  # the state is in memory: `state_storage` holds no meta tensors

    def close(self) -> None:
        pass  # nothing outside memory to release

    def step_count(self) -> int:
        for st in self.opt.state.values():
            return int(st["step"])
        return 0

    def state_storage(self) -> list[tuple[str, str, torch.Tensor]]:
        """(parameter name, kind, this rank's flat range of it) for the fp32 master and both Adam
        moments: views into the optimizer's own buffers (empty where the rank holds none of it)."""
        self.zero.wait_params()
        out = []
        for u, master, _, m, v in self.slots:
            for seg, name in zip(u.pieces, u.names):
                if name in self.skip:  # its master and momentum: optim/zero_muon.py
                    continue
                o = _moment_offset(u, self.skip, seg.start)
                out += [(name, "master", master[seg.start:seg.end])]
                out += [(name, kind, t[o:o + seg.end - seg.start]) for kind, t in (("exp_avg", m), ("exp_avg_sq", v))]
        return out

    @torch.no_grad()
    def loaded(self, step: int) -> None:
        """`state_storage` was filled from a checkpoint: set Adam's step, refresh the parameters."""
        for st in self.opt.state.values():
            st["step"].fill_(float(step))
        self._publish()


def _skipped(u: Unit, skip: frozenset[str]) -> list:
    return [seg for seg in u.segments if u.names[seg.param] in skip]


def _moment_offset(u: Unit, skip: frozenset[str], start: int) -> int:
    """Where shard element `start` (outside the skipped pieces) lies in the unit's moments, which
    leave the skipped pieces out."""
    return start - sum(seg.end - seg.start for seg in _skipped(u, skip) if seg.end <= start)
