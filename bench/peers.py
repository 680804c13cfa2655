"""Benchmark (not a test): meshlm's TP, PP and CP against PyTorch's own, as torchtitan applies them.

Same Llama (meshlm's, same name-seeded init), same batches, same AdamW, LR schedule and clipping (1.0),
fp32, the same world (2 gloo ranks on the CPU), one pair per row:

- tp2, tp2+sp: DTensor `parallelize_module` with torchtitan's Llama plan (wq/wk/wv/w1/w3
  ColwiseParallel, wo/w2 RowwiseParallel, the embedding RowwiseParallel and the head ColwiseParallel
  with `loss_parallel`; +sp: the norms SequenceParallel and the block halves' inputs gathered by
  PrepareModuleInput). DTensor's hooks need the block's linears called as modules, so this peer runs
  torch's own block ops (F.rms_norm, w2(silu(w1 x)·w3 x): torchtitan's model); meshlm runs its
  hand-written ones (model/ops.py), so these rows include what the smaller saved set buys.
- pp2 1f1b, pp2 interleaved (v=2), pp2 zbv: `torch.distributed.pipelining` (Schedule1F1B,
  ScheduleInterleaved1F1B, ScheduleZBVZeroBubble) on meshlm's own stage split (same blocks per stage,
  same stage placement), the model's own forward per stage, the grad norm all-reduced over the stages.
- cp2: `torch.distributed.tensor.experimental.context_parallel` around forward and backward, DDP over
  the two ranks for the gradients (meshlm's dp_cp all-reduce). Where it cannot run (the CPU), the
  row says why and is kept as "not comparable".

Each variant runs in fresh worker processes; variants alternate over rounds (bench/zero.py's
measurement: barrier before each step, the slowest rank's wall time, median over steps and rounds;
peak = rise of the peak RSS (VmHWM, reset after warm-up) over the RSS before the model was built,
max over ranks: CPU tensors have no allocator statistics).

    python bench/peers.py [--preset small --n-layers 8] [--seq-len 256] [--batch 4] [--microbatches 4]
                          [--steps 6] [--rounds 2] [--rows tp2 ...] [--json] [--smoke]
speed = peer step time / meshlm's (goal >= 1.0); memory = meshlm peak / peer's (<= 1.0).
"""
from __future__ import annotations

import json
import sys

from spawn import join_gloo  # noqa: E402  (bench/spawn.py)
from zero import (  # noqa: E402
    compare,
    make_cfg,
    measure,
    meshlm_runner,
    parser,
    plain_model,
    release_freed,
    run_variant,
    torch_step,
)

# row: (dimension, meshlm's parallel.* settings)
ROWS = {
    "tp2": ("tp", {"tp": 2}),
    "tp2+sp": ("tp", {"tp": 2, "sp": True}),
    "pp2 1f1b": ("pp", {"pp": 2, "pp_schedule": "1f1b"}),
    "pp2 interleaved": ("pp", {"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2}),
    "pp2 zbv": ("pp", {"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}),
    "cp2": ("cp", {"cp": 2}),
}


def row_cfg(a, row: str):
    dim, par = ROWS[row]
    mb = a.batch // a.microbatches if dim == "pp" else a.batch
    return make_cfg(a, {"training.micro_batch": mb, **{f"parallel.{k}": v for k, v in par.items()}})


# ----------------------------------------------------------------------------------------- peers

def tp_peer(cfg, rank: int, world: int):
    """parallelize_module with torchtitan's Llama plan; the loss under loss_parallel."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    sp = cfg.parallel.sp
    model = torch_block_model(cfg)
    mesh = init_device_mesh("cpu", (world,))
    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        **({"norm": SequenceParallel()} if sp else {})})
    for block in model.layers.values():
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:  # Block calls attention(x, cos, sin, cache, mask)
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                                         desired_input_layouts=(Replicate(), None, None, None, None)),
                         "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                            desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    if not sp:  # the norms stay plain replicas: make them replicated DTensors too, for clip and AdamW
        for norm in [model.norm] + [m for b in model.layers.values() for m in (b.attention_norm, b.ffn_norm)]:
            norm.weight = torch.nn.Parameter(DTensor.from_local(norm.weight.data, mesh, [Replicate()]))
            norm.forward = _local_norm(norm, F)
    positions = torch.arange(cfg.data.seq_len)  # under SP the embedding output is a sequence shard

    def fwd_bwd(x, y):
        with loss_parallel():
            loss = F.cross_entropy(model(x, positions).flatten(0, 1), y.flatten())
            loss.backward()
        return loss.detach().full_tensor()
    return torch_step(cfg, list(model.parameters()), fwd_bwd, clip=clip_dtensor)


def _local_norm(norm, F):
    """A replicated norm on plain activations: its DTensor weight's local tensor, its gradient kept Replicate."""
    def forward(x):
        return F.rms_norm(x, (x.shape[-1],), norm.weight.to_local(grad_placements=norm.weight.placements), norm.eps)
    return forward


def torch_block_model(cfg):
    """plain_model with torch's own norm and SwiGLU (torchtitan's block): the linears are called as modules."""
    import torch.nn.functional as F

    from meshlm.model.llama import FeedForward, RMSNorm

    class TorchRMSNorm(RMSNorm):
        def forward(self, x):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    class TorchFeedForward(FeedForward):
        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    model = plain_model(cfg)
    for m in model.modules():
        if type(m) is RMSNorm:
            m.__class__ = TorchRMSNorm
        elif type(m) is FeedForward:
            m.__class__ = TorchFeedForward
    return model


def clip_dtensor(params: list, max_norm: float, group=None):
    """torchtitan's clip_grad_norm_: the total norm of DTensor gradients as a full tensor; with `group`
    (pipeline stages) the squares summed over it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if group is not None:
        norm = norm ** 2
        dist.all_reduce(norm, group=group)
        norm = norm ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble"}


def pp_peer(cfg, rank: int, world: int):
    """torch.distributed.pipelining on meshlm's stage split and placement; each stage a pruned Llama."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from meshlm.model import Llama, materialize
    from meshlm.core.config.model import model_args
    from meshlm.parallel import cross_entropy
    from meshlm.parallel.model_plans.llama import LLAMA_PLAN
    from meshlm.core.schedule.actions import stage_index
    from meshlm.core.schedule.schedules import V_SHAPED
    from meshlm.core.schedule.stage import stage_blocks

    p, name = cfg.parallel, cfg.parallel.pp_schedule
    v, m = p.pp_virtual, cfg.training.global_batch // cfg.training.micro_batch
    args = model_args(cfg)
    blocks, n = stage_blocks(args, cfg.parallel, m), world * v
    stages, params = [], []
    for c in range(v):
        s = stage_index(rank, c, world, name in V_SHAPED)
        with torch.device("meta"):
            mod = Llama(args)
        LLAMA_PLAN.prune(mod, {str(i) for i in blocks[s]}, s == 0, s == n - 1)
        materialize(mod, cfg.training.seed, "cpu")
        params += list(mod.parameters())
        stages.append(pipelining.PipelineStage(mod, s, n, torch.device("cpu")))
    cls = getattr(pipelining, SCHEDULES[name])
    sched = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=cross_entropy)
    last = any(st.is_last for st in stages)

    def fwd_bwd(x, y):
        losses: list = []
        sched.step(x, target=y, losses=losses)
        return torch.stack(losses).detach().mean() if last else torch.zeros(())
    return torch_step(cfg, params, fwd_bwd, clip=lambda ps, mx: clip_dtensor(ps, mx, dist.group.WORLD))


def cp_peer(cfg, rank: int, world: int):
    """context_parallel over the world around forward and backward; DDP sums the gradients."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel

    from meshlm.parallel import cross_entropy

    mesh = init_device_mesh("cpu", (world,))
    model = DistributedDataParallel(plain_model(cfg))

    def fwd_bwd(x, y):
        pos = torch.arange(x.shape[1])
        with context_parallel(mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 0], no_restore_buffers={x, y, pos}):
            loss = cross_entropy(model(x, pos), y)
            loss.backward()
        return loss.detach()
    return torch_step(cfg, list(model.parameters()), fwd_bwd)


PEERS = {"tp": tp_peer, "pp": pp_peer, "cp": cp_peer}


# ----------------------------------------------------------------------------------------- runs

def worker(rank: int, world: int, port: int, variant: tuple[str, str], a, out) -> None:
    join_gloo(rank, world, port)
    import torch.distributed as dist

    import meshlm.train.trainer  # noqa: F401 - every variant imports the same modules before `base`
    row, side = variant
    cfg = row_cfg(a, row)
    try:
        build = ((lambda: meshlm_runner(cfg, world)) if side == "meshlm"
                 else (lambda: PEERS[ROWS[row][0]](cfg, rank, world)))
        out.put((rank, measure(build, a)))
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here: its reason goes in the table
        out.put((rank, {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
    dist.destroy_process_group()


def combine(row: str):
    """One loss per step from the ranks': pipeline ranks without the last stage report 0 (sum);
    TP ranks agree and CP ranks hold equal token shares (mean)."""
    if ROWS[row][0] == "pp":
        return lambda per_rank: [sum(xs) for xs in zip(*per_rank)]
    return lambda per_rank: [sum(xs) / len(xs) for xs in zip(*per_rank)]


def main() -> int:
    ap = parser(__doc__, 4, "sequences per step (pp: split into --microbatches)", 2, 6, n_layers=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: the debug preset, seq 32, 1 round of 2 steps")
    a = ap.parse_args()
    if a.smoke:
        a.preset, a.n_layers, a.seq_len, a.batch, a.microbatches = "debug", 4, 32, 4, 2
        a.warmup, a.steps, a.rounds = 1, 2, 1
    release_freed()
    runs: dict = {(r, s): [] for r in a.rows for s in ("meshlm", "peer")}
    errors: dict[str, str] = {}
    for _ in range(a.rounds):
        for row in a.rows:
            for side in ("meshlm", "peer"):
                if row in errors:
                    continue
                try:
                    runs[(row, side)].append(run_variant((row, side), a, worker, combine(row)))
                except RuntimeError as e:
                    errors[row] = f"{side}: {e}"
    report: dict = {"config": vars(a), "rows": {}}
    for row in a.rows:
        if row in errors:
            report["rows"][row] = {"dim": ROWS[row][0], "error": errors[row]}
        else:
            report["rows"][row] = {"dim": ROWS[row][0], **compare(runs[(row, "meshlm")], runs[(row, "peer")])}
    worst: dict = {}
    for r in report["rows"].values():
        if "error" not in r:
            w = worst.setdefault(r["dim"], {"speed": float("inf"), "memory": 0.0})
            w["speed"], w["memory"] = min(w["speed"], r["speed_ratio"]), max(w["memory"], r["memory_ratio"])
    for r in report["rows"].values():
        if "error" in r and r["dim"] not in worst:
            worst[r["dim"]] = {"speed": None, "memory": None, "not_comparable": r["error"]}
    print_table(report, a)
    if a.json:  # every row, then the summary: the worst row of each dimension
        print(json.dumps(report["rows"]))
        print(json.dumps(worst))
    return 0


def print_table(report: dict, a) -> None:
    print(f"{a.preset}, {a.n_layers} layers, seq {a.seq_len}, {a.batch} seq/step (pp: {a.microbatches} "
          f"micro-batches), world {a.world} gloo, {a.rounds}x{a.steps} steps; RSS peaks")
    print("| row | meshlm step | peer step | speed | meshlm peak | peer peak | memory | losses agree |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row, r in report["rows"].items():
        if "error" in r:
            print(f"| {row} | not comparable: {r['error']} ||||||")
            continue
        print(f"| {row} | {r['meshlm_step_s'] * 1e3:.1f} ms | {r['torch_step_s'] * 1e3:.1f} ms | "
              f"{r['speed_ratio']:.3f} (CPU {r['cpu_ratio']:.3f}) | {r['meshlm_peak_mib']:.1f} MiB | "
              f"{r['torch_peak_mib']:.1f} MiB | {r['memory_ratio']:.3f} | {r['loss_rel_diff']:.1e} |")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
