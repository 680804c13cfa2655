"""AdamW over fp32 master weights, the LR schedule, global grad-norm clipping and fp16 loss scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig
from ..distributed.comm import Comm
from ..parallel.adamw import adamw_step, fused_adamw_supported


class MasterOptimizer:  # implements parallel.adamw.Optimizer
    """AdamW on fp32 masters. With fp32 compute the master *is* the parameter (no copy); with bf16/fp16
    compute each parameter gets an fp32 master and the update is copied back after the step.

    Weight decay skips 1-D tensors (norm gains), as Megatron and most Llama recipes do. Fused AdamW
    wherever torch has it for the device (see `fused_adamw_supported`), else foreach.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig, device: torch.device):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.copies = [(m, p) for m, p in zip(self.masters, self.params) if m is not p]
        decay = [m for m in self.masters if m.dim() >= 2]
        no_decay = [m for m in self.masters if m.dim() < 2]
        self.fused = fused_adamw_supported(device)
        kw = {"fused": True} if self.fused else {"foreach": True}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kw)
        # Allocate Adam's moments now rather than at the first step, so memory is what it will be
        # from the start (and a checkpoint can be loaded into them before any step).
        for m in self.masters:
            self.opt.state[m] = {"step": torch.zeros((), dtype=torch.float32,
                                                     device=m.device if "fused" in kw else "cpu"),
                                 "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}

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
        if self.copies:  # a skipped fused step copies the unchanged masters: same values
            torch._foreach_copy_([p for _, p in self.copies], [m for m, _ in self.copies])

    def state_storage(self) -> list[tuple[str, str, torch.Tensor]]:
        """(parameter name, kind, tensor) for the fp32 master and both Adam moments: this rank's own
        tensors, which checkpoints write and load in place (see parallel/placement.py)."""
        out = []
        for name, m in zip(self.names, self.masters):
            st = self.opt.state[m]
            out += [(name, "master", m), (name, "exp_avg", st["exp_avg"]), (name, "exp_avg_sq", st["exp_avg_sq"])]
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
        if self.copies:
            torch._foreach_copy_([p for _, p in self.copies], [m for m, _ in self.copies])

    def state_bytes(self) -> int:
        """Bytes of optimizer-only tensors: Adam moments plus separate fp32 masters."""
        seen, total = set(), 0
        tensors = [t for st in self.opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        tensors += [m for m, _ in self.copies]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def backing(self, name: str, kind: str) -> None:
        return None  # the state is in memory: `state_storage` holds no meta tensors

    def close(self) -> None:
        pass  # nothing outside memory to release


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr × min_lr_ratio` at the last step."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, total_steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def grad_norm(grads: list[torch.Tensor], world: Comm, device: torch.device | str | None = None) -> torch.Tensor:
    """Global L2 norm. `grads`: the gradient pieces this rank owns (`Parallelized.norm_grads`: the
    placement records give every element exactly one owner over the world), so one all-reduce of the
    sum of squares over every rank counts each element once, whatever the layout."""
    sq = torch._foreach_norm(grads, 2.0) if grads else []
    part = torch.stack([n.float() for n in sq]).pow(2).sum() if sq else torch.zeros((), device=device)
    world.all_reduce(part)
    return part.sqrt()


@torch.no_grad()
def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    if max_norm <= 0:
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device) if grads else coef)


class LossScaler:
    """Dynamic loss scaling for fp16: skip the step on inf/nan and halve (never below 1), double after
    `growth_interval` clean steps in a row.

    The scale (fp32, 0-dim) and the clean-step counter (int32) live on the training device and
    `update` runs there (`torch._amp_update_scale_`, as torch.amp.GradScaler), so a step never waits
    for the host to learn whether it overflowed. Disabled (bf16/fp32): the scale is 1.0 and the
    trainer neither multiplies by it nor unscales. `state_dict` reads the device values (checkpoints).
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.growth_interval = growth_interval
        self._scale = torch.full((), init_scale if enabled else 1.0, dtype=torch.float32, device=device)
        self._good_steps = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        """The current scale: a 0-dim fp32 tensor on the device (1.0 when disabled)."""
        return self._scale

    @scale.setter
    def scale(self, value: float | torch.Tensor) -> None:
        self._scale.fill_(value)

    def inv_scale(self) -> torch.Tensor:
        return self._scale.reciprocal()

    def update(self, found_inf: torch.Tensor) -> None:
        """`found_inf`: fp32 0-dim on the scale's device, 1.0 if this step's gradients overflowed."""
        if not self.enabled:
            return
        torch._amp_update_scale_(self._scale, self._good_steps, found_inf, 2.0, 0.5, self.growth_interval)
        self._scale.clamp_(min=1.0)

    def state_dict(self) -> dict:
        return {"scale": float(self._scale), "good_steps": int(self._good_steps)}

    def load_state_dict(self, d: dict) -> None:
        self._scale.fill_(float(d["scale"]))
        self._good_steps.fill_(int(d["good_steps"]))
