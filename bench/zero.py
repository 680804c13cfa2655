"""Benchmark (not a test): meshlm zero=0 vs torch DDP, meshlm zero=3 vs torch FSDP2 (fully_shard per block
plus the root), dp ranks on gloo, same model (meshlm's Llama, same init), same batches, same AdamW and
LR schedule, clipping at 1.0, fp32.

Each variant runs in fresh worker processes (so memory high-water marks are its own): warm-up steps,
then timed steps with a barrier before each; the step time is the slowest rank's, the ratio is of medians.
The process CPU time per step (all threads) is reported beside it: on a loaded machine it is the steadier
measure of the work each framework does.
Peak memory is the rise of the process's peak resident set (VmHWM, reset after warm-up through
/proc/self/clear_refs) over its resident set before the model was built, max over ranks: CPU tensors
have no allocator statistics. glibc is told to mmap large blocks so freed tensors leave the RSS.
Variants alternate over several rounds so machine noise hits both sides alike.

    python bench/zero.py [--preset small] [--dim D --n-layers L --n-heads H --ffn-dim F] [--seq-len 256]
                         [--batch 8] [--steps 8] [--rounds 2] [--json]
speed ratio = torch median step time / meshlm's (goal >= 1.0); memory ratio = meshlm / torch (<= 1.0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from spawn import join_gloo, spawn_gloo  # noqa: E402  (bench/spawn.py)

PAIRS = [("meshlm-zero0", "torch-ddp"), ("meshlm-zero3", "torch-fsdp2")]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def make_cfg(a, overrides: dict):
    """The bench's model, batch and step count from the command line, plus `overrides` (the layout)."""
    from meshlm.core import config as C
    cfg = C.Config()
    for k, v in {"model.preset": a.preset, "data.seq_len": a.seq_len, "training.global_batch": a.batch,
                 "training.steps": a.warmup + a.steps, "training.eval_every": 0, "metrics.progress": False,
                 "checkpoint.resume": "never", "training.device": "cpu", **overrides}.items():
        C.apply(cfg, k, v)
    for key in ("dim", "n_layers", "n_heads", "ffn_dim"):
        if getattr(a, key) is not None:
            C.apply(cfg, f"model.{key}", getattr(a, key))
    if a.n_heads is not None:
        C.apply(cfg, "model.n_kv_heads", a.n_heads)
    return cfg


def dp_layout(a, zero: int) -> dict:
    return {"parallel.dp": a.world, "parallel.zero": zero, "training.micro_batch": a.batch // a.world}


def meshlm_runner(cfg, world: int):
    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.train.trainer import Trainer

    layout = build_layout(cfg, world)
    ctx = init_context(layout.shape(), pick_device("cpu"))
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-bench-"), ctx, layout)
    return lambda: float(tr.train_step()["loss_sum"]) / layout.accum  # this rank's mean micro-batch loss


def torch_runner(cfg, world: int, rank: int, kind: str):
    """What a torch user writes: DDP(model) or fully_shard per block + root, AdamW, clip_grad_norm_."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from meshlm.parallel import cross_entropy

    model = plain_model(cfg)
    if kind == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def fwd_bwd(x, y):
        loss = cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()
    return torch_step(cfg, list(model.parameters()), fwd_bwd, rank, world)


def plain_model(cfg):
    """meshlm's Llama as one process builds it (same name-seeded init), as a plain nn.Module."""
    import torch

    from meshlm.core.config.model import model_args
    from meshlm.model import Llama, materialize

    torch.manual_seed(cfg.training.seed)
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    materialize(model, cfg.training.seed, "cpu")
    return model


def torch_step(cfg, params: list, fwd_bwd, dp_rank: int = 0, dp: int = 1, clip=None):
    """A torch user's loop around `fwd_bwd(inputs, targets) -> detached loss` (which runs backward):
    meshlm's batches, AdamW (decay on matrices only), LR schedule, `clip(params, max_norm)`
    (clip_grad_norm_ unless given). Returns step()."""
    import torch

    from meshlm.data import default_data_dir
    from meshlm.data.dataset import open_data
    from meshlm.core.facts.course import lr_at

    o = cfg.optim
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    data = open_data(default_data_dir(), [], cfg.data.seq_len, cfg.training.global_batch, cfg.training.seed)
    state = {"step": 0}

    def step() -> float:
        batch = data.next_batch(dp_rank, dp)
        for g in opt.param_groups:
            g["lr"] = lr_at(state["step"], o, cfg.training.steps)
        loss = fwd_bwd(batch.inputs, batch.targets)
        (clip or torch.nn.utils.clip_grad_norm_)(params, cfg.training.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        return float(loss)
    return step


def measure(build, a) -> dict:
    """In a worker: `build()` returns step() -> loss; warm-up steps, then timed ones (barrier before
    each). Times, CPU times, the peak RSS rise over the RSS before `build`, and every loss."""
    import time

    import torch.distributed as dist

    base = _rss()
    step = build()
    losses = [step() for _ in range(a.warmup)]
    dist.barrier()
    _reset_hwm()
    times, cpu = [], []
    for _ in range(a.steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _hwm()
    dist.barrier()
    return {"times": times, "cpu": cpu, "peak": peak - base, "losses": losses}


def worker(rank: int, world: int, port: int, variant: str, a, out) -> None:
    join_gloo(rank, world, port)
    import torch.distributed as dist

    import meshlm.train.trainer  # noqa: F401 - every variant imports the same modules before `base`

    def build():
        cfg = make_cfg(a, dp_layout(a, 3 if variant == "meshlm-zero3" else 0))
        return (meshlm_runner(cfg, world) if variant.startswith("meshlm")
                else torch_runner(cfg, world, rank, variant))
    out.put((rank, measure(build, a)))
    dist.destroy_process_group()


def run_variant(variant: str, a, target=worker, losses=lambda per_rank: per_rank[0]) -> dict:
    """One variant on fresh workers: per step the slowest rank's time; the peak of the fullest rank;
    `losses` picks (or combines) the ranks' loss lists."""
    res = spawn_gloo(target, a.world, variant, a, timeout=900)
    errors = [res[r]["error"] for r in sorted(res) if "error" in res[r]]
    if errors:  # a worker that could not run this variant says why (bench/peers.py)
        raise RuntimeError(errors[0])
    step_times = [max(res[r]["times"][i] for r in res) for i in range(a.steps)]
    cpu = [max(res[r]["cpu"][i] for r in res) for i in range(a.steps)]
    return {"times": step_times, "cpu": cpu, "peak": max(res[r]["peak"] for r in res),
            "losses": losses([res[r]["losses"] for r in sorted(res)])}


def compare(mine: list[dict], theirs: list[dict]) -> dict:
    """Medians over all rounds of two variants' runs, their ratios, and how far their losses differ."""
    t_m = statistics.median(t for r in mine for t in r["times"])
    t_t = statistics.median(t for r in theirs for t in r["times"])
    c_m = statistics.median(t for r in mine for t in r["cpu"])
    c_t = statistics.median(t for r in theirs for t in r["cpu"])
    m_m = statistics.median(r["peak"] for r in mine)
    m_t = statistics.median(r["peak"] for r in theirs)
    la, lb = mine[0]["losses"], theirs[0]["losses"]
    worst = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    return {"meshlm_step_s": t_m, "torch_step_s": t_t, "speed_ratio": t_t / t_m, "meshlm_cpu_s": c_m,
            "torch_cpu_s": c_t, "cpu_ratio": c_t / c_m, "meshlm_peak_mib": m_m / 2 ** 20,
            "torch_peak_mib": m_t / 2 ** 20, "memory_ratio": m_m / m_t, "loss_rel_diff": worst,
            "meshlm_losses": la, "torch_losses": lb}


def parser(doc: str, batch: int, batch_help: str, warmup: int, steps: int, n_layers: int | None = None):
    """The command line shared with bench/peers.py: model overrides, shape, world, rounds, --json."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--preset", default="small")
    for key in ("dim", "n_layers", "n_heads", "ffn_dim"):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=n_layers if key == "n_layers" else None,
                        help=f"override model.{key}")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=batch, help=batch_help)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    return ap


def release_freed() -> None:
    """glibc: mmap blocks over 128 KiB, so freed tensors leave the RSS (inherited by the workers)."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")


def main() -> None:
    a = parser(__doc__, 8, "global batch (sequences); one micro-batch per rank", 3, 8).parse_args()
    release_freed()
    runs: dict[str, list[dict]] = {v: [] for pair in PAIRS for v in pair}
    for _ in range(a.rounds):
        for pair in PAIRS:
            for v in pair:
                runs[v].append(run_variant(v, a))
    report = {"config": vars(a), "pairs": []}
    for mine, theirs in PAIRS:
        report["pairs"].append({"meshlm": mine, "torch": theirs, **compare(runs[mine], runs[theirs])})
    if a.json:
        print(json.dumps(report, indent=1))
        return
    from meshlm.core.config.model import model_args
    psi = model_args(make_cfg(a, dp_layout(a, 0))).num_params()
    custom = ", ".join(f"{k} {getattr(a, k)}" for k in ("dim", "n_layers", "n_heads", "ffn_dim")
                       if getattr(a, k) is not None)
    name = f"{a.preset} with {custom}" if custom else a.preset
    print(f"{name} ({psi / 1e6:.1f}M params), seq {a.seq_len}, global batch {a.batch}, dp={a.world} gloo, "
          f"{a.rounds}×{a.steps} steps")
    for p in report["pairs"]:
        print(f"{p['meshlm']:>13} vs {p['torch']:<11}: step {p['meshlm_step_s'] * 1e3:7.1f} ms vs "
              f"{p['torch_step_s'] * 1e3:7.1f} ms -> speed ratio {p['speed_ratio']:.3f} (CPU time "
              f"{p['cpu_ratio']:.3f}); peak "
              f"{p['meshlm_peak_mib']:6.1f} MiB vs {p['torch_peak_mib']:6.1f} MiB -> memory ratio "
              f"{p['memory_ratio']:.3f}; losses agree to {p['loss_rel_diff']:.1e}")


if __name__ == "__main__":
    sys.exit(main())
