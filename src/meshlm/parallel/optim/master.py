"""AdamW over flat fp32 master weights: the optimizer of every layout without ZeRO (zero_adamw.py holds the
ZeRO one, muon.py Muon's); the trainer hands it to `parallelize` as the optimizer factory."""
from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch import nn

from ...core.config import OptimConfig
from ..dims.grad_sync import decays, flat_groups
from .adamw import adamw_step, fused_adamw_supported


class MasterOptimizer:  # implements parallel.optim.adamw.Optimizer
    """AdamW on fp32 masters kept in flat buffers, one per group of parameters that share weight decay
    (`grad_sync.decays`), dtype and the caller's `group_key` (parallelize passes the gradient reduction,
    so that each group's DP gradient buffer is one tensor, `bind_grads`), cut at `grad_sync.FLAT_MAX`
    elements. The step is then one fused call per weight-decay setting over a handful of buffers
    instead of a list over every tensor (a model may have thousands), and the parameters become views
    of one flat buffer per group: with fp32 compute that buffer *is* the master (no copy); with
    bf16/fp16 the updated masters reach it in one copy per group.

    Fused AdamW wherever torch has it for the device (see `fused_adamw_supported`), else foreach.
    Checkpoints see every parameter's own views (`state_storage`), so their format does not depend on
    the grouping.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig, device: torch.device,
                 group_key: Callable[[str], Hashable] | None = None):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        key = group_key or (lambda name: None)
        self.groups = flat_groups([(decays(p.shape), p.dtype, key(n)) for n, p in named_params],
                                  [p.numel() for p in self.params])
        self.fused = fused_adamw_supported(device)
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (flat parameters, flat master)
        self.flat_masters: list[torch.Tensor] = []
        self.views: list = [None] * len(self.params)  # per parameter: (master, exp_avg, exp_avg_sq)
        by_decay: dict[bool, list[torch.Tensor]] = {}  # torch param groups: one fused call each
        moments = []
        with torch.no_grad():
            for group in self.groups:
                flat = self._flatten([self.params[i] for i in group])
                master = flat if flat.dtype == torch.float32 else flat.float()
                if master is not flat:
                    self.copies.append((flat, master))
                # Adam's moments exist from the start, so memory is what it will be from the first
                # step on (and a checkpoint can be loaded into them before any step)
                m, v = torch.zeros_like(master), torch.zeros_like(master)
                off = 0
                for i in group:
                    shape, n = self.params[i].shape, self.params[i].numel()
                    self.views[i] = tuple(t[off:off + n].view(shape) for t in (master, m, v))
                    off += n
                self.flat_masters.append(master)
                moments.append((m, v))
                by_decay.setdefault(decays(self.params[group[0]].shape), []).append(master)
        self.masters = [v[0] for v in self.views]
        param_groups = [{"params": ms, "weight_decay": cfg.weight_decay if d else 0.0} for d, ms in by_decay.items()]
        self.opt = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                     **({"fused": True} if self.fused else {"foreach": True}))
        for master, (m, v) in zip(self.flat_masters, moments):
            self.opt.state[master] = {"step": torch.zeros((), dtype=torch.float32,
                                                          device=master.device if self.fused else "cpu"),
                                      "exp_avg": m, "exp_avg_sq": v}

    @staticmethod
    def _flatten(params: list[nn.Parameter]) -> torch.Tensor:
        """One buffer holding `params` back to back; each parameter becomes a view of it."""
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        off = 0
        for p in params:
            view = flat[off:off + p.numel()].view(p.shape)
            view.copy_(p)
            p.data = view
            off += p.numel()
        return flat

    def bind_grads(self, flat_grads: list[torch.Tensor]) -> None:
        """The gradient buffers of `groups` (GradBuckets.flat), one per flat master, as its `.grad`."""
        for master, g in zip(self.flat_masters, flat_grads, strict=True):
            if g.shape != master.shape:
                raise ValueError(f"gradient buffer of {g.numel()} elements for a master of {master.numel()}")
            master.grad = g

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage this rank keeps (ZeRO's optimizer returns its persistent shards)."""
        return self.params

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """`found_inf` (fp16 loss scaling): a device flag, 1.0 to skip this step (see `adamw_step`)."""
        if not adamw_step(self.opt, self.fused, found_inf):
            return
        self._publish()  # a skipped fused step copies the unchanged masters: same values

    def _publish(self) -> None:
        for flat, master in self.copies:
            flat.copy_(master)

    def state_storage(self) -> list[tuple[str, str, torch.Tensor]]:
        """(parameter name, kind, tensor) for the fp32 master and both Adam moments: this rank's own
        tensors (views of the flat buffers), which checkpoints write and load in place (see
        parallel/placement.py)."""
        out = []
        for name, (m, ea, eas) in zip(self.names, self.views):
            out += [(name, "master", m), (name, "exp_avg", ea), (name, "exp_avg_sq", eas)]
        return out

    def step_count(self) -> int:
        for st in self.opt.state.values():
            return int(st["step"])
        return 0

    @torch.no_grad()
    def loaded(self, step: int) -> None:
        """`state_storage` was filled from a checkpoint: set Adam's step, copy masters to the params."""
        for st in self.opt.state.values():
            st["step"].fill_(float(step))
        self._publish()

    def state_bytes(self) -> int:
        """Bytes of optimizer-only tensors: Adam moments plus separate fp32 masters."""
        tensors = [t for st in self.opt.state.values() for t in (st["exp_avg"], st["exp_avg_sq"])]
        return sum(t.numel() * t.element_size() for t in tensors + [m for _, m in self.copies])

    def backing(self, name: str, kind: str) -> None:
        return None  # the state is in memory: `state_storage` holds no meta tensors

    def close(self) -> None:
        pass  # nothing outside memory to release
