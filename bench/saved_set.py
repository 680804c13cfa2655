"""Issue 17: the minimal saved set against plain autograd (step time, saved bytes), and the AC modes.

A/B (default): (A) the block as it was before issue 17 (plain-autograd RMSNorm
`(x.float()·rsqrt(mean(x²)+eps)).type_as(x)·w` and FFN `w2(silu(w1 x)·w3 x)`; under SP the region-entry
all-gather hook `gather_seq` instead of `gather_linears`) against (B) the current runtime (model/ops.py,
the fused SP linears). Same model, init and batches, each stepped by the trainer's own `train_step`
(forward, backward, clip, AdamW). A is built here, by swapping module forwards and the TP plan's
`fused_entry`, not by a switch in src/. Rounds alternate A/B so machine noise hits both alike.
ratio = median step B / median step A (goal <= 1.05). Saved bytes: saved-tensor hooks during one
forward + loss, distinct storages, no parameters, RoPE tables apart.

--ac-table: training.ac none / op / selective / full side by side (B only, tp = 1): saved activation
bytes per block and per step (hooks + op mode's cache, `Checkpointed.kept_bytes`), median step time,
and the planner's prediction (plan.activations.block_activation_bytes, memory.stage_memory's activations).

    python bench/saved_set.py [--precision bf16,fp32] [--tp 2 --sp] [--rounds 5] [--json]
    python bench/saved_set.py --ac-table [--precision bf16,fp32] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from spawn import join_gloo, spawn_gloo  # noqa: E402  (bench/spawn.py)

from meshlm.train.observe.saved import saved_bytes  # noqa: E402

AC_ORDER = ("none", "op", "selective", "full")


# ---------------------------------------------------------------------------------- variant A

def _legacy_norm(self, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    return xf.type_as(x) * self.gain()  # gain(): SP sums the weight's gradient over the group


def _legacy_ffn(self, x: torch.Tensor) -> torch.Tensor:
    return self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_legacy(model: torch.nn.Module) -> None:
    """Plain-autograd norms and SwiGLU on this model's instances (the pre-issue-17 forwards)."""
    from meshlm.model.llama import FeedForward, RMSNorm
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = types.MethodType(_legacy_norm, m)
        elif isinstance(m, FeedForward):
            m.forward = types.MethodType(_legacy_ffn, m)


@contextlib.contextmanager
def unfused_entry():
    """While building: every TP region keeps the entry hook (gather_seq under SP), as before issue 17."""
    from meshlm.parallel.model_plans.llama import LlamaModelPlan
    fused = LlamaModelPlan.tp_regions
    LlamaModelPlan.tp_regions = lambda self, model: [dataclasses.replace(r, fused_entry=False)
                                                for r in fused(self, model)]
    try:
        yield
    finally:
        LlamaModelPlan.tp_regions = fused


# ---------------------------------------------------------------------------------- building, measuring

def make_cfg(a, precision: str, ac: str = "none"):
    from meshlm.core import config as C
    cfg = C.Config()
    total = a.warmup + a.rounds * a.steps + 1
    over = {"model.preset": a.preset, "data.seq_len": a.seq_len, "training.global_batch": a.batch,
            "training.micro_batch": a.batch, "training.steps": total, "training.eval_every": 0,
            "training.precision": precision, "training.ac": ac, "metrics.progress": False,
            "checkpoint.resume": "never", "training.device": "cpu", "parallel.tp": a.tp, "parallel.sp": a.sp,
            # no MFU here: a stated peak spares each Trainer the CPU peak measurement (~20 s in bf16)
            "training.peak_tflops": 1.0}
    over.update({f"model.{k}": v for k, v in (("dim", a.dim), ("n_layers", a.n_layers), ("ffn_dim", a.ffn_dim))
                 if v is not None})
    if a.dim is not None or a.n_layers is not None:
        over["model.max_seq_len"] = a.seq_len
    for k, v in over.items():
        C.apply(cfg, k, v)
    return cfg


def build(cfg, ctx, layout, legacy: bool):
    from meshlm.train.trainer import Trainer
    with unfused_entry() if legacy else contextlib.nullcontext():
        tr = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-saved-set-"), ctx, layout)
    if legacy:
        make_legacy(tr.model)
    return tr


def saved_by_part(tr, seed: int = 0) -> dict:
    """Bytes one forward + loss keeps for backward on this rank: per block (saved-tensor hooks + the op
    cache), outside the blocks (embedding ids, final norm, head, loss) and the RoPE tables apart."""
    model, cfg = tr.model, tr.cfg
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, model.args.vocab_size, (cfg.training.micro_batch, cfg.data.seq_len), generator=g)
            for _ in range(2))
    model.rope(cfg.data.seq_len, x.device)
    blocks = list(model.layers.values())
    saved = saved_bytes(lambda: tr.par.runner.loss(x, y), skip=model.parameters(),
                        parts={b: str(i) for i, b in enumerate(blocks)}, named={"rope": model.rope_cache},
                        outside="rest")
    per_block = [saved[str(i)] for i in range(len(blocks))]
    other = {"rest": saved["rest"], "rope": saved["rope"]}
    kept = [sum(getattr(m, "kept_bytes", 0) for m in b.modules()) for b in blocks]
    hooks = sum(per_block)
    return {"block": (hooks + sum(kept)) / len(blocks), "block0": per_block[0] + kept[0], "op_cache": sum(kept),
            "step": hooks + sum(kept) + other["rest"], "rest": other["rest"], "rope": other["rope"]}


def timed(tr, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tr.train_step(measure=False)
        out.append(time.perf_counter() - t0)
    return out


def alternate(trainers: dict, a) -> dict:
    """Warm each up, then `rounds` rounds of `steps` steps each, the order rotating every round; the
    first `skip` steps of each run are dropped (the switch from the other trainer's working set)."""
    first_loss = {name: float(tr.train_step(measure=False)["loss_sum"]) for name, tr in trainers.items()}
    for tr in trainers.values():
        timed(tr, a.warmup - 1)
    times = {name: [] for name in trainers}
    names = list(trainers)
    for r in range(a.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].extend(timed(trainers[name], a.steps)[a.skip:])
    return {name: {"median_s": statistics.median(t), "steps": len(t), "first_loss": first_loss[name]}
            for name, t in times.items()}


# ---------------------------------------------------------------------------------- the two benches

def ab_run(a, ctx=None) -> list[dict]:
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    out = []
    for precision in a.precision.split(","):
        cfg = make_cfg(a, precision)
        layout = build_layout(cfg, a.tp)
        ctx = ctx or init_context(layout.shape(), pick_device("cpu"))
        trainers = {"A": build(cfg, ctx, layout, True), "B": build(cfg, ctx, layout, False)}
        saved = {name: saved_by_part(tr) for name, tr in trainers.items()}
        t = alternate(trainers, a)
        out.append({"precision": precision, "ratio": t["B"]["median_s"] / t["A"]["median_s"],
                    "A": {**t["A"], **saved["A"]}, "B": {**t["B"], **saved["B"]},
                    "saved_ratio": saved["B"]["block"] / saved["A"]["block"]})
        del trainers
    return out


def ac_table(a) -> list[dict]:
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.plan.cost.activations import block_activation_bytes
    from meshlm.plan.cost.memory import stage_memory
    from meshlm.plan.spec import shape_from_config, spec_from_config
    out = []
    for precision in a.precision.split(","):
        trainers, pred = {}, {}
        for ac in AC_ORDER:
            cfg = make_cfg(a, precision, ac)
            layout = build_layout(cfg, 1)
            trainers[ac] = build(cfg, init_context(layout.shape(), pick_device("cpu")), layout, False)
            shape, spec = shape_from_config(cfg), spec_from_config(cfg, 1)
            e = 4 if precision == "fp32" else 2
            pred[ac] = {"block": block_activation_bytes(shape, a.batch * a.seq_len, a.seq_len, e, ac=ac),
                        "step": stage_memory(shape, spec, "only").breakdown()["activations"]}
        saved = {ac: saved_by_part(tr) for ac, tr in trainers.items()}
        t = alternate(trainers, a)
        for ac in AC_ORDER:
            m, p = saved[ac], pred[ac]
            out.append({"precision": precision, "ac": ac, **t[ac], **m,
                        "pred_block": p["block"], "pred_step": p["step"],
                        "block_ratio": m["block"] / p["block"], "step_ratio": m["step"] / p["step"]})
        del trainers
    return out


def _tp_worker(rank: int, world: int, port: int, a, q) -> None:
    join_gloo(rank, world, port)
    from meshlm.distributed.mesh import shutdown
    try:
        res = ab_run(a)
        q.put((rank, res if rank == 0 else None))
    finally:
        shutdown()


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.2f}"


def report_ab(res: list[dict], a) -> None:
    where = f"tp={a.tp}{' sp' if a.sp else ''}"
    print("| precision | layout | A step ms | B step ms | B/A time | A KiB/block | B KiB/block | B/A bytes | "
          "A loss | B loss |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in res:
        A, B = r["A"], r["B"]
        print(f"| {r['precision']} | {where} | {A['median_s'] * 1e3:.1f} | {B['median_s'] * 1e3:.1f} | "
              f"{r['ratio']:.3f} | {A['block'] / 1024:.0f} | {B['block'] / 1024:.0f} | {r['saved_ratio']:.3f} | "
              f"{A['first_loss']:.4f} | {B['first_loss']:.4f} |")


def report_ac(res: list[dict]) -> None:
    print("| precision | ac | step ms | block MiB (meas.) | block MiB (planner) | meas./pred. | "
          "op cache MiB/step | step MiB (meas.) | step MiB (planner) | meas./pred. |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['precision']} | {r['ac']} | {r['median_s'] * 1e3:.1f} | {_mib(r['block'])} | "
              f"{_mib(r['pred_block'])} | {r['block_ratio']:.3f} | {_mib(r['op_cache'])} | {_mib(r['step'])} | "
              f"{_mib(r['pred_step'])} | {r['step_ratio']:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--n-layers", type=int)
    ap.add_argument("--ffn-dim", type=int)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", default="bf16,fp32", help="comma-separated: bf16, fp32")
    ap.add_argument("--steps", type=int, default=8, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip", type=int, default=1, help="steps dropped at the start of every run")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--ac-table", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    bad = [p for p in a.precision.split(",") if p not in ("bf16", "fp32")]
    if bad or a.steps <= a.skip or a.warmup < 1 or a.rounds < 1 or a.tp < 1 or (a.sp and a.tp < 2) \
            or (a.ac_table and a.tp != 1):
        ap.error("need --precision from bf16,fp32, --steps > --skip, --warmup >= 1, --rounds >= 1, "
                 "--sp only with --tp >= 2, --ac-table only with --tp 1")
    from meshlm.data import default_data_dir
    default_data_dir()  # prepare the corpus before any timing
    if a.ac_table:
        res = ac_table(a)
    elif a.tp > 1:
        res = spawn_gloo(_tp_worker, a.tp, a)[0]
    else:
        res = ab_run(a)
    info = {"mode": "ac-table" if a.ac_table else "ab", "results": res, "preset": a.preset, "seq_len": a.seq_len,
            "batch": a.batch, "tp": a.tp, "sp": a.sp, "steps_per_run": a.steps, "rounds": a.rounds,
            "torch": torch.__version__, "threads": 1 if a.tp > 1 else torch.get_num_threads(),
            "load": os.getloadavg()[0]}
    if a.json:
        print(json.dumps(info))
    elif a.ac_table:
        report_ac(res)
    else:
        report_ab(res, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
