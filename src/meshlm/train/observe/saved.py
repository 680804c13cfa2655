"""What autograd keeps for backward: the one meter the tests, benchmarks and planner checks use to measure
activation memory (docs/planner.md compares its numbers with the planner's formulas).

Counted once per storage (views share one), at the end of the forward: a storage that ZeRO-3 frees
(resizes to nothing) after the forward costs nothing, as on the device. Each storage is booked under
the innermost labelled module running when it was saved, or under a label of its own (`named`: e.g. the
RoPE tables, read by every block).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Saved:
    by_label: dict[str, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # every distinct storage's bytes

    @property
    def total(self) -> int:
        return sum(self.by_label.values())

    def __getitem__(self, label: str) -> int:
        return self.by_label.get(label, 0)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_bytes(run: Callable[[], object], skip: Iterable[torch.Tensor] = (),
                parts: Mapping[nn.Module, str] | None = None, named: Mapping[str, Iterable[torch.Tensor]] | None = None,
                keep: Callable[[torch.Tensor], bool] | None = None, outside: str = "other") -> Saved:
    """Run `run()` (a forward) and meter the storages autograd saved: `skip` (parameters) not counted,
    `parts` {module: label} attributes the rest by the innermost labelled module running (`outside`
    when none), `named` {label: tensors} books those storages under their label wherever saved, `keep`
    filters tensors (e.g. compile's uint8 RNG state)."""
    skipped = {_key(t) for t in skip}
    named_of = {_key(t): label for label, ts in (named or {}).items() for t in ts}
    stack: list[str] = []
    booked: dict[int, tuple[str, torch.UntypedStorage]] = {}
    handles = []
    for mod, label in (parts or {}).items():
        handles.append(mod.register_forward_pre_hook(lambda m, a, label=label: stack.append(label)))
        handles.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None))

    def pack(t: torch.Tensor):
        k = _key(t)
        if k not in skipped and k not in booked and (keep is None or keep(t)):
            booked[k] = (named_of.get(k) or (stack[-1] if stack else outside), t.untyped_storage())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    out = Saved()
    for label, st in booked.values():
        n = st.nbytes()
        out.by_label[label] = out.by_label.get(label, 0) + n
        if n:
            out.sizes.append(n)
    return out


def block_saved_bytes(block: nn.Module, run: Callable[[], object], plan) -> dict[str, int]:
    """What `block` saves while `run()` does a forward through it, split by the model plan's
    `block_parts` (Llama: `norm`, the RMSNorms, i.e. the residual stream they read, `attention`,
    `feed_forward`) and `other`. Op-level checkpointing keeps its matmul outputs in a cache of its own
    (`kept_bytes`), not through saved-tensor hooks: those count as `other`."""
    parts = {block: "other", **plan.block_parts(block)}
    labels = tuple(dict.fromkeys(parts.values()))
    got = saved_bytes(run, skip=block.parameters(), parts=parts, outside="outside")
    out = {k: got[k] for k in labels}
    out["other"] += sum(getattr(m, "kept_bytes", 0) for m in block.modules())
    return out
