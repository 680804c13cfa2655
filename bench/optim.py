"""Optimizer step and gradient accumulation on the CPU: flat buffers (MasterOptimizer, GradBuckets) against
a per-tensor list (the masters one fp32 tensor per parameter, as torch.optim.AdamW is usually driven).

    .venv/bin/python bench/optim.py [--experts 64] [--layers 4] [--dim 64] [--expert-dim 32] [--reps 20] [--json]

Two parameter sets, bf16 parameters with fp32 masters (the GPU rows' precision):
- `per-expert`: every expert's three matrices a tensor of its own (layers × experts × 3, thousands);
- `stacked`: meshlm's MoE layout, each block's experts one [E, ...] tensor per matrix (tens of tensors).
Per row, the median over `reps` of
- `step`: the AdamW update (fused where torch has it for the CPU, else foreach) and the copy of the
  updated masters into the bf16 parameters;
- `accum`: one micro-batch's bf16 gradients into the fp32 buffer: a zero fill and an add per tensor
  (each bf16 gradient added to its fp32 view), against the copy of `grad_sync.accumulate_into_view` on a
  step's first backward.
ratio = list time / flat time (> 1: flat is faster). Speed goals are read from the printed ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def param_shapes(layers: int, experts: int, dim: int, expert_dim: int, stacked: bool) -> list[tuple[str, tuple]]:
    """An MoE model's parameter shapes: attention, norms, router and the experts' matrices."""
    out = [("embed", (8 * dim, dim))]
    for i in range(layers):
        b = f"layers.{i}."
        out += [(b + n, (dim, dim)) for n in ("wq", "wk", "wv", "wo")]
        out += [(b + "attn_norm", (dim,)), (b + "ffn_norm", (dim,)), (b + "router", (experts, dim))]
        if stacked:
            out += [(b + "w1", (experts, expert_dim, dim)), (b + "w3", (experts, expert_dim, dim)),
                    (b + "w2", (experts, dim, expert_dim))]
        else:
            for e in range(experts):
                out += [(f"{b}e{e}.w1", (expert_dim, dim)), (f"{b}e{e}.w3", (expert_dim, dim)),
                        (f"{b}e{e}.w2", (dim, expert_dim))]
    return out + [("norm", (dim,)), ("output", (8 * dim, dim))]


def make_params(shapes, seed: int = 0):
    import torch
    from torch import nn
    g = torch.Generator().manual_seed(seed)
    return [(n, nn.Parameter(torch.randn(s, generator=g).mul_(0.02).bfloat16())) for n, s in shapes]


class ListOptimizer:
    """The per-tensor baseline: one fp32 master per parameter, AdamW over the list, a foreach copy back."""

    def __init__(self, named, cfg):
        import torch

        from meshlm.parallel.dims.grad_sync import decays
        from meshlm.parallel.optim.adamw import fused_adamw_supported
        self.params = [p for _, p in named]
        self.masters = [p.detach().float() for p in self.params]
        self.fused = fused_adamw_supported("cpu")
        groups = [{"params": [m for m in self.masters if decays(m.shape) == d], "weight_decay": wd}
                  for d, wd in ((True, cfg.weight_decay), (False, 0.0))]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                     **({"fused": True} if self.fused else {"foreach": True}))

    def step(self) -> None:
        import torch
        with torch.no_grad():
            self.opt.step()
            torch._foreach_copy_(self.params, self.masters)


def _median(fn, reps: int) -> float:
    fn()  # warm-up (the optimizer's lazy state, first-touch pages)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_row(name: str, shapes, reps: int) -> dict:
    import torch

    from meshlm.core.config import OptimConfig
    from meshlm.parallel.dims.grad_sync import accumulate_into_view
    from meshlm.parallel.optim.master import MasterOptimizer
    cfg = OptimConfig()
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g).bfloat16() for _, s in shapes]

    # the per-tensor list: fp32 masters with fp32 grads of their own
    named = make_params(shapes)
    base = ListOptimizer(named, cfg)
    for m, gr in zip(base.masters, grads):
        m.grad = gr.float()
    list_step = _median(base.step, reps)

    # flat: MasterOptimizer's groups and one fp32 gradient buffer per group
    named = make_params(shapes)
    flat = MasterOptimizer(named, cfg, torch.device("cpu"))
    params = flat.params
    bufs = [torch.zeros(sum(params[i].numel() for i in grp)) for grp in flat.groups]
    views = [None] * len(params)
    for grp, buf in zip(flat.groups, bufs):
        off = 0
        for i in grp:
            views[i] = buf[off:off + params[i].numel()].view(params[i].shape)
            off += params[i].numel()
    for i, gr in enumerate(grads):
        views[i].copy_(gr)
    flat.bind_grads(bufs)
    flat_step = _median(lambda: flat.step(), reps)

    def accum_list():
        for b in bufs:
            b.zero_()
        for v, gr in zip(views, grads):
            v.add_(gr)

    def accum_flat():
        for p, v, gr in zip(params, views, grads):
            p.grad = gr
            accumulate_into_view(p, v, True)

    list_acc, flat_acc = _median(accum_list, reps), _median(accum_flat, reps)
    return {"row": name, "tensors": len(shapes), "groups": len(flat.groups),
            "params_m": sum(p.numel() for p in params) / 1e6, "fused": flat.fused,
            "list_step_ms": list_step * 1e3, "flat_step_ms": flat_step * 1e3, "step_ratio": list_step / flat_step,
            "list_accum_ms": list_acc * 1e3, "flat_accum_ms": flat_acc * 1e3, "accum_ratio": list_acc / flat_acc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--expert-dim", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    a = ap.parse_args()
    for key in ("layers", "experts", "dim", "expert_dim", "reps", "threads"):
        if getattr(a, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    import torch
    torch.set_num_threads(a.threads)
    rows = [run_row(name, param_shapes(a.layers, a.experts, a.dim, a.expert_dim, stacked), a.reps)
            for name, stacked in (("per-expert", False), ("stacked", True))]
    print(f"torch {torch.__version__}, CPU, {a.threads} thread(s), bf16 params + fp32 masters, "
          f"fused AdamW: {rows[0]['fused']}")
    print("| parameter set | tensors | flat groups | params (M) | step: list ms | flat ms | ratio "
          "| accum: fill+add ms | copy ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['row']} | {r['tensors']} | {r['groups']} | {r['params_m']:.2f} | {r['list_step_ms']:.2f} "
              f"| {r['flat_step_ms']:.2f} | {r['step_ratio']:.2f}x | {r['list_accum_ms']:.2f} "
              f"| {r['flat_accum_ms']:.2f} | {r['accum_ratio']:.2f}x |")
    if a.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
