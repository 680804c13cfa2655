"""Memory + communication + compute -> one estimate (the dict that `meshlm estimate --json` prints).

Time model, per step on the slowest pipeline stage:
  slot   = t_F + t_B + t_recompute + exposed per-micro-batch communication
  step   = m · slot · (1 + bubble) + exposed per-step communication + optimizer (+ offload)
           + the wait for the slowest of the step's ranks (plan/cost/scale.py; per-operation model)
Compute time comes from the per-operation model (plan/cost/ops.py: GEMMs by shape, attention by kernel,
element-wise work at HBM bandwidth, launches), or with `efficiency` set from FLOPs / (peak ×
efficiency) (the flat model). Overlap: TP and EP traffic is exposed (it sits on
the critical path of every block); PP sends overlap the next micro-batch except on the fill and drain
path; ring-CP hides behind the attention kernels; ZeRO-3 gathers hide
behind the forward/backward they prefetch for, ZeRO-2/3 reduce-scatters behind the backward, plain
DP / ZeRO-1 gradient reduction behind the last micro-batch's backward (DP's last bucket, filled when
that backward ends, stays exposed: all of it when the gradients fit one bucket); parameter all-gathers after
a sharded optimizer step and HSDP replica all-reduces are exposed.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

from ...core.choices import HELD
from ...core.facts.ramp import BatchRamp
from . import comm as C
from ..hardware import GPU
from .activations import vocab_rows
from .memory import stage_memory, state_bytes_per_param
from .muon import muon_step
from .options import Options
from .scale import STEP_JITTER_S, straggler_s
from ..spec import Shape, Spec, allgather_mask, check
from .stages import block_params_local, pipeline_roles, stage_params


# ---------------------------------------------------------------------------------- pipeline bubble

def bubble_formula(schedule: str, p: int, m: int, v: int, f: float = 1.0, b: float = 2.0,
                   w: float | None = None) -> float:
    """Idle time of the pipeline as a fraction of its busy time m·(F+B) (Narayanan et al.; Qi et al.)."""
    if p <= 1:
        return 0.0
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule in ("zb-h1", "zbv"):  # with m < p, fewer deferred W's than ranks fill the warm-up gaps
        w = b / 2 if w is None else w   # zbv: the same warm-up at half-size chunks (simulate.textbook_bubble)
        idle = (p - 1) * max(0.0, f + (b - w) - w) / (2 if schedule == "zbv" else 1)
        return (idle + max(0, p - m) * w) / (m * (f + b))
    return (p - 1) / m


def _simulator():
    """The pipeline package's schedules and simulator: plain Python, importable without torch."""
    from ...core.schedule import build_schedule, simulate
    return build_schedule, simulate


SIM_MAX_UNITS = 2048  # p·m·v above which the simulator (~1 s at 8k units) gives way to the formula


@lru_cache(maxsize=256)
def built_schedule(schedule: str, p: int, m: int, v: int, fbw: tuple | None = None):
    """The schedule's actions; `fbw` (F, B, W per micro-batch) for schedules whose compute order
    depends on the costs (ZB-V's list scheduling)."""
    if fbw is None:
        return _simulator()[0](schedule, p, m, v)
    from ...core.schedule.simulate import action_costs  # the bubble only: ZB-V's memory search is skipped
    return _simulator()[0](schedule, p, m, v, costs=action_costs(v, *fbw), least_memory=False)


def _v_shaped(schedule: str) -> bool:
    from ...core.schedule.schedules import V_SHAPED
    return schedule in V_SHAPED


@lru_cache(maxsize=4096)
def bubble_simulated(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """The same ratio from the schedule simulator, or None when it cannot run this case.
    With equal stage costs it reproduces the formulas; it matters for zb-h1, whose bubble depends on
    the F : B : W ratio, and as a cross-check (tests/test_plan.py)."""
    if (p <= 1 or schedule not in SIMULATED or p * m * v > SIM_MAX_UNITS):
        return None
    try:
        tl = schedule_timeline(schedule, p, m, v, f, b, w)
    except Exception:  # noqa: BLE001 - a simulator bug must not break the planner; fall back
        return None
    return tl.makespan / (m * (f + b)) - 1.0


SIMULATED = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")  # schedules the simulator times


def schedule_timeline(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float, name: str = ""):
    """The simulator's Timeline of `schedule` with these per-micro-batch costs (ZB-V placed in its V,
    its compute order from the costs): what the bubble and the explorer's drawing both come from."""
    vs = _v_shaped(schedule)
    return _simulator()[1](built_schedule(schedule, p, m, v, (f, b, w) if vs else None), p, m, v, cost_f=f, cost_b=b,
                           cost_w=w, name=name, vshape=vs)


# ---------------------------------------------------------------------------------- compute

# Bytes per parameter the kernels of one optimizer step move, after the profiled step of the shared
# H100 run (shared/gpu/h100-2026-11-25/run-llama3-1b/profile.json, kernel name: measured ms for 1.236e9
# parameters; at 0.85 of 3.35 TB/s the bytes below take within 10% of each): clipping's norm reads
# the fp32 gradient (LpNorm multi_tensor_apply: 4 B, 1.87 ms) and its scaling reads and writes it
# (TensorListMetadata<1> mul: 8 B, 3.66 ms); fused AdamW reads and writes master, m and v and reads the
# gradient (FusedOptimizerTensorListMetadata<4>: 28 B, 13.2 ms); the compute copy is written from the
# master (TensorListMetadata<2> copy: 4 + 2 B, 2.73 ms); the gradients are zeroed for the next step
# (FillFunctor<float>: 4 B, 1.57 ms). fp32 (the master is the parameter) has no copy.
# The GPU's idle time per step between kernels (host launches, the optimizer's and the clip's host work):
# the shared H100 run's median step (0.5029 s, metrics.jsonl steps 3-10 less the profiled 8) less the
# kernel time of its profiled step (0.4903 s). Taken as the trainer's, on any GPU.
STEP_GAP_S = 0.5029 - 0.4903
OPT_KERNEL_BYTES = {"norm": 4, "clip": 8, "adamw": 28, "copy": 6, "zero_grad": 4}
# Gradient accumulation: each micro-batch's bf16 gradient is added into the fp32 buffer, every
# parameter including experts no token reached (CUDAFunctor_add<float>: read 4 + 4, write 4; 5.71 ms
# for 1.236e9 parameters in the same profile; 9.65 ms for deepseek-moe's 2.27e9, bench-deepseek-moe-4blocks)
GRAD_ACCUM_BYTES = 12


def optimizer_bytes_per_param(precision: str) -> float:
    """Bytes the optimizer's kernels move per parameter; no copy kernel without a master (fp32)."""
    return sum(b for k, b in OPT_KERNEL_BYTES.items() if k != "copy" or HELD[precision].master)


def grad_accum_seconds(params: float, bw: float) -> float:
    return params * GRAD_ACCUM_BYTES / bw


def _bandwidth(gpu: GPU, o: Options) -> float:
    """Element-wise bytes/s of the per-operation model: a calibrated machine's, else HBM × hbm_eff."""
    return o.rates.ew_bytes_s if o.rates is not None else gpu.hbm_bw * gpu.hbm_eff


def fwd_flops_per_token(shape: Shape, s: Spec, layers: int, head: bool) -> tuple[float, float]:
    """(forward FLOPs per local token on one rank of the stage, of which attention scores·values)."""
    return _fwd_flops(shape, s.tp, s.seq_len, layers, head)


@lru_cache(maxsize=65536)
def _fwd_flops(shape: Shape, t: int, seq_len: int, layers: int, head: bool) -> tuple[float, float]:
    a = shape.args
    dense, experts = block_params_local(shape, t, 1)
    active = dense + (experts * shape.top_k / shape.num_experts if shape.moe else 0.0)  # routed: top_k
    attn = 4.0 * a.dim * seq_len / t
    f = layers * (2.0 * active + attn)
    if head:
        f += 2.0 * (vocab_rows(a, t) + 1) * a.dim  # the head multiplies its padded rows too
    return f, layers * attn


def compute_times(shape: Shape, t: int, seq_len: int, layers: int, head: bool, tokens: float, ac: str,
                  rate: float, overhead: float = 0.0) -> tuple[float, float, float, float]:
    """(forward, backward, recompute, attention-kernel) seconds of one micro-batch on one stage rank.
    Backward is twice the forward; full AC re-runs the blocks' forward, selective the attention core.
    `overhead` (per block, forward + backward) is what small shapes pay in launches, not FLOPs."""
    fwd, attn = _fwd_flops(shape, t, seq_len, layers, head)
    t_f = tokens * fwd / rate + layers * overhead / 3
    if ac == "full":
        t_rc = tokens * (fwd - _fwd_flops(shape, t, seq_len, 0, head)[0]) / rate + layers * overhead / 3
    elif ac == "selective":
        t_rc = tokens * attn / rate
    else:
        t_rc = 0.0
    return t_f, 2 * t_f, t_rc, tokens * attn / rate * (3 + (1 if ac != "none" else 0))


@lru_cache(maxsize=65536)
def micro_times(shape: Shape, tp: int, sp: bool, ep: int, cp: int, seq_len: int, layers: int, head: bool,
                micro_batch: int, ac: str, precision: str, gpu: GPU, o: Options) -> dict:
    """t_f, t_b, t_rc, t_attn (and `ops`, the per-operation breakdown) of one micro-batch on one rank.
    Cached (the search's bound and its time model ask for the same stages): callers must not change it."""
    tokens = micro_batch * seq_len / cp
    if o.efficiency is None:
        from .ops import stage_of_blocks
        return stage_of_blocks(_one_block(shape, tp, sp, ep, cp, seq_len, head, micro_batch, precision, gpu, o),
                               layers, head, ac)
    t_f, t_b, t_rc, t_attn = compute_times(shape, tp, seq_len, layers, head, tokens, ac,
                                           gpu.peak(precision) * o.efficiency, o.block_overhead_s)
    return {"t_f": t_f, "t_b": t_b, "t_rc": t_rc, "t_attn": t_attn, "ops": None}


def micro_seconds(shape: Shape, tp: int, sp: bool, ep: int, cp: int, seq_len: int, layers: int, head: bool,
                  micro_batch: int, ac: str, precision: str, gpu: GPU, o: Options) -> tuple[float, float, float]:
    """micro_times' (t_f, t_b, t_rc) without its breakdown: the search's bound asks for many stage lengths."""
    if o.efficiency is None:
        from .ops import stage_times
        return stage_times(_one_block(shape, tp, sp, ep, cp, seq_len, head, micro_batch, precision, gpu, o),
                           layers, head, ac)
    mt = micro_times(shape, tp, sp, ep, cp, seq_len, layers, head, micro_batch, ac, precision, gpu, o)
    return mt["t_f"], mt["t_b"], mt["t_rc"]


@lru_cache(maxsize=16384)
def _one_block(shape: Shape, tp: int, sp: bool, ep: int, cp: int, seq_len: int, head: bool, micro_batch: int,
               precision: str, gpu: GPU, o: Options) -> tuple:
    """ops.block_compute of one block (and the head, if `head`) of these degrees: every stage length and AC
    mode the search prices is a multiple of it (ops.stage_of_blocks)."""
    from .ops import StageWork, block_compute
    return block_compute(StageWork(shape, tp, sp, ep, seq_len, cp, 1, head, micro_batch * seq_len / cp, "none",
                                   precision, o.compiled, o.flash, o.attn_kernel, o.attn_dropout, o.recompute_gemms,
                                   o.attn_mask, o.doc_tokens, o.loss_chunks), gpu, o.rates)


def stage_time(shape: Shape, s: Spec, stage: str, gpu: GPU, o: Options) -> dict:
    sp = stage_params(shape, s, stage)
    # a context-parallel attention core is never recomputed by selective AC (memory.block_activation_bytes)
    ac = "none" if s.ac == "selective" and s.cp_enabled else s.ac
    mt = micro_times(shape, s.tp, s.sp, s.ep, s.cp, s.seq_len, sp.layers, sp.head, s.micro_batch, ac,
                     s.precision, gpu, o)
    t_f, t_b, t_rc, t_attn = mt["t_f"], mt["t_b"], mt["t_rc"], mt["t_attn"]
    ops = mt["ops"]
    if ops is not None:  # per-operation model: gradients accumulate into the fp32 buffer every micro-batch
        acc = grad_accum_seconds(sp.dense + sp.expert, _bandwidth(gpu, o))
        ops = dict(ops, grad_accum_s=acc)
        t_b += acc
    colls = C.collectives(shape, s, sp.dense, sp.expert, sp.layers, sp.embed, sp.head, gpu, o.comm_efficiency)
    muon_s = 0.0
    if s.optim == "muon":
        muon_s, extra = muon_step(shape, s, sp.layers, gpu, o.comm_efficiency)
        colls += extra
    m = s.accum
    windows = {"forward": m * t_f, "backward": m * (t_b + t_rc), "attention": m * t_attn}
    last_bwd = t_b + t_rc
    exposed_mb = exposed_step = overlap_mb = overlap_step = 0.0
    by_window: dict[tuple[str, str], list] = {}
    for c in colls:
        by_window.setdefault((c.window, c.per), []).append(c)
    for (window, per), cs in by_window.items():
        total = sum(c.seconds for c in cs)
        if window in ("none", "step"):
            hidden = 0.0
        elif window == "pipeline":  # fill + drain: 2(p·v - 1) hops of one transfer stay exposed
            one = total / max(1.0, sum(c.calls for c in cs))
            hidden = max(0.0, total - max(2 * (s.pp * s.pp_virtual - 1) * one, total - m * (t_f + t_b + t_rc)))
        elif per == "step":
            hidden = last_bwd
        else:
            hidden = windows[window]
        tail = sum(c.seconds * min(c.tail_calls, c.calls) / c.calls for c in cs if c.calls)
        exposed = max(0.0, total - hidden, tail)
        for c in cs:
            c.exposed_s = exposed * (c.seconds / total) if total > 0 else 0.0
        # the compute beside the hidden part runs slower (GPU.overlap_slowdown; docs/planner.md)
        slowed = gpu.overlap_slowdown * max(0.0, total - exposed)
        if per == "step":
            exposed_step += exposed
            overlap_step += slowed
        else:
            exposed_mb += exposed
            overlap_mb += slowed
    return {"t_f": t_f, "t_b": t_b, "t_rc": t_rc, "exposed_mb": exposed_mb, "exposed_step": exposed_step,
            "overlap_mb": overlap_mb, "overlap_step": overlap_step, "collectives": colls, "params": sp,
            "ops": ops, "muon_s": muon_s}


def step_terms(s: Spec, sp, gpu: GPU, o: Options) -> tuple[float, float, float, float]:
    """(optimizer, offload, offload disk I/O, per-step overhead) seconds of one step on a rank holding
    the parameters `sp` (stages.StageParams) on `gpu`: what follows the last backward."""
    # optimizer step: read master, m, v, grad; write master, m, v and the compute copy (HBM bound); the
    # per-op model also reads the gradients once more for the clipping norm (train_step clips first)
    pb, gb, ob = state_bytes_per_param(s.precision)
    n = s.shard_group
    shard = sp.dense / n + sp.expert / (max(1, n // s.ep) if s.zero else 1)
    offload_s = opt_s = io_s = 0.0
    if s.offload == "optimizer":
        offload_s = shard * (gb + pb) / gpu.pcie_bw + shard / gpu.cpu_adam_params_per_s
    elif s.offload == "nvme":
        # read master, m, v (12 B) and write them back (12 B) per parameter; the read-ahead and
        # write-behind threads overlap that with the host's staging and AdamW (docs/zero.md)
        io_s = 12 * shard / gpu.disk_read_bw + 12 * shard / gpu.disk_write_bw
        offload_s = max(io_s, shard * (gb + pb) / gpu.pcie_bw + shard / gpu.cpu_adam_params_per_s)
    elif o.efficiency is not None:  # the flat model: read and write the state, read the gradient once
        opt_s = shard * (2 * ob + gb + (pb if HELD[s.precision].master else 0)) / gpu.hbm_bw
    else:
        opt_s = shard * optimizer_bytes_per_param(s.precision) / _bandwidth(gpu, o)
    overhead_s = 0.0
    if o.efficiency is None:
        overhead_s = o.rates.step_overhead_s if o.rates is not None else \
            STEP_GAP_S if o.step_overhead_s is None else o.step_overhead_s
    return opt_s, offload_s, io_s, overhead_s


def straggler_seconds(s: Spec, o: Options) -> float:
    """The step's wait for the slowest of its ranks (scale.straggler_s over the world): the per-operation
    model on a GPU profile, whose jitter is our GPU rows' (Options.step_jitter_s: None for that);
    a calibrated machine (`rates`) and the flat model price none unless a jitter is given."""
    sigma = o.step_jitter_s
    if sigma is None:
        sigma = STEP_JITTER_S if o.efficiency is None and o.rates is None else 0.0
    return straggler_s(sigma, s.world_size)


def time_model(shape: Shape, s: Spec, gpu: GPU, o: Options, simulate: bool | None = None) -> dict:
    stages = pipeline_roles(s.pp)
    times = [stage_time(shape, s, st, gpu, o) for st in stages]

    def slot(x: dict) -> float:
        return x["t_f"] + x["t_b"] + x["t_rc"] + (x["exposed_mb"] + x["overlap_mb"]) / s.accum

    worst = max(times, key=slot)
    m, p, v = s.accum, s.pp, s.pp_virtual
    x = (worst["exposed_mb"] + worst["overlap_mb"]) / m
    f, b = worst["t_f"] + x / 2, worst["t_b"] + worst["t_rc"] + x / 2
    w = worst["t_b"] / 2
    bubble, source = bubble_formula(s.pp_schedule, p, m, v, f, b, w), "formula"
    if s.pp_enabled and (o.simulate if simulate is None else simulate):
        sim = bubble_simulated(s.pp_schedule, p, m, v, round(f, 12), round(b, 12), round(min(w, b), 12))
        if sim is not None:
            bubble, source = sim, "simulator"
    busy = m * slot(worst)
    step_exposed = max(t["exposed_step"] + t["overlap_step"] for t in times)
    step_overlap = max(t["overlap_step"] for t in times)
    opt_s, offload_s, io_s, overhead_s = step_terms(s, worst["params"], gpu, o)
    muon_s = max(t["muon_s"] for t in times)  # Newton-Schulz, after the step's gradients (plan/cost/muon.py)
    straggler = straggler_seconds(s, o)
    step = busy * (1 + bubble) + step_exposed + opt_s + muon_s + offload_s + overhead_s + straggler
    tokens = s.global_batch * s.seq_len
    model_flops = shape.flops_per_token(s.seq_len) * tokens
    world = s.world_size
    comm = [c.as_dict() for c in worst["collectives"]]
    depth = sum(c.depth_s * c.exposed_s / c.seconds for c in worst["collectives"] if c.seconds > 0)
    return {
        "step_s": step,
        "tokens_per_s_per_gpu": tokens / step / world,
        "mfu": model_flops / (step * world * gpu.peak(s.precision)),
        "time": {"forward_s": m * worst["t_f"], "backward_s": m * worst["t_b"], "recompute_s": m * worst["t_rc"],
                 "exposed_comm_microbatch_s": worst["exposed_mb"], "bubble_s": busy * bubble,
                 "overlap_slowdown_s": worst["overlap_mb"] + step_overlap,
                 "overlap_microbatch_s": worst["overlap_mb"],
                 "bubble_fraction": bubble, "bubble_source": source, "exposed_comm_step_s": step_exposed - step_overlap,
                 "optimizer_s": opt_s, "muon_ns_s": muon_s, "offload_s": offload_s, "offload_io_s": io_s,
                 "overhead_s": overhead_s, "straggler_s": straggler, "latency_depth_s": depth},
        "ops": None if worst["ops"] is None else {k: m * v for k, v in worst["ops"].items()},
        "comm": comm,
        "comm_bytes_per_step": sum(c["bytes"] for c in comm),
        "flops_per_step": model_flops,
    }


def run_time(shape: Shape, s: Spec, gpu: GPU, o: Options, steps: int, rampup: list[int] = (),
             step_s: float | None = None) -> dict:
    """A run of `steps` optimizer steps: each batch size training.batch_rampup uses, priced by the time
    model at that batch (the same layout, fewer micro-batches per replica), times its steps
    (`step_s`: the full batch's step, already priced). `ramp_extra`: the run's time over the same
    tokens at the full batch's throughput, less one (what the ramp's smaller steps cost)."""
    ramp = BatchRamp(s.global_batch, rampup)
    per_step = s.micro_batch * s.dp  # sequences per micro-batch of every replica (no dp_weights with a ramp)
    parts = []
    for batch, n in ramp.steps_at(steps):
        t = step_s if batch == s.global_batch and step_s is not None else \
            time_model(shape, dataclasses.replace(s, accum=batch // per_step), gpu, o)["step_s"]
        parts.append({"global_batch": batch, "steps": n, "step_s": t})
    full = step_s if step_s is not None else time_model(shape, s, gpu, o)["step_s"]
    seconds = sum(p["steps"] * p["step_s"] for p in parts)
    tokens = ramp.consumed(steps) * s.seq_len
    at_full = tokens / (s.global_batch * s.seq_len) * full
    return {"steps": steps, "seconds": seconds, "tokens": tokens, "ramp_steps": min(ramp.ramp_steps, steps),
            "ramp_extra": seconds / at_full - 1 if at_full else 0.0, "batches": parts}


def describe_run(r: dict) -> str:
    """`meshlm estimate`'s run line."""
    line = f"run: {r['steps']:,} steps, {r['seconds'] / 3600:.3g} h"
    if r["ramp_steps"]:
        line += f" (ramp: first {r['ramp_steps']:,} steps at smaller batches, {r['ramp_extra']:+.1%})"
    return line


# the step's categories in the order `meshlm estimate` prints them (step_categories)
CATEGORIES = {"gemm": "GEMM", "attention": "attention", "elementwise": "element-wise", "launch": "launch / dispatch",
              "loss": "loss", "grad_accum": "grad accumulation", "recompute": "recompute", "compute": "compute (flat)",
              "optimizer": "optimizer", "comm": "communication exposed",
              "depth": "comm latency depth", "overlap": "compute beside comm", "bubble": "bubble",
              "overhead": "per-step overhead", "straggler": "slowest of N ranks"}


def step_categories(r: dict) -> dict:
    """An estimate's step seconds by category, adding up to `step_s`: the per-operation breakdown
    (`ops`: GEMM with the head, attention, element-wise, launches, loss, gradient accumulation,
    recompute) or, with a flat --efficiency, the compute as one; then the optimizer, exposed
    communication (less its latency hops beyond a two-rank call's, shown apart: they grow with the
    group), pipeline bubble, per-step overhead and the wait for the slowest rank (docs/planner.md)."""
    t, ops = r["time"], r["ops"]
    if ops is None:
        out = {"compute": t["forward_s"] + t["backward_s"] + t["recompute_s"]}
    else:
        out = {"gemm": ops["gemm_s"] + ops["head_s"], "attention": ops["attention_s"],
               "elementwise": ops["elementwise_s"], "launch": ops["launch_s"], "loss": ops["loss_s"],
               "grad_accum": ops["grad_accum_s"], "recompute": ops["recompute_s"]}
    comm = t["exposed_comm_microbatch_s"] + t["exposed_comm_step_s"]
    depth = min(comm, t["latency_depth_s"])
    out.update(optimizer=t["optimizer_s"] + t["muon_ns_s"] + t["offload_s"], comm=comm - depth, depth=depth,
               overlap=t["overlap_slowdown_s"], bubble=t["bubble_s"], overhead=t["overhead_s"],
               straggler=t["straggler_s"])
    return out


def estimate(shape: Shape, s: Spec, gpu: GPU | None = None, o: Options | None = None, validate: bool = True,
             simulate: bool | None = None) -> dict:
    """The full estimate of one layout; `fits` is None when no memory size is known."""
    o = o or Options()
    if validate:
        check(shape, s)
    if s.cp_enabled and s.cp_impl == "allgather":
        o = dataclasses.replace(o, attn_mask=allgather_mask(o.attn_mask, o.attn_impl))
    stages = pipeline_roles(s.pp)
    mems = [stage_memory(shape, s, st, o).breakdown() for st in stages]
    worst = max(mems, key=lambda x: x["total"])
    usable = o.usable(gpu)
    out = {
        "model": shape.name,
        "params": shape.num_params(),
        "gpus": s.world_size,
        "gpu": gpu.name if gpu else None,
        "layout": s.layout_dict(),
        "per_gpu": {k: worst[k] for k in ("params", "grads", "optim", "activations", "buffers", "total",
                                          "cpu_optim", "disk_optim")},
        "memory_detail": worst["detail"],
        "flash": o.flash,
        "compiled": o.compiled,
        "attn_mask": o.attn_mask,  # how attention is masked, as priced (ops.StageWork.attn_mask)
        "hbm_bytes": gpu.hbm_bytes if gpu else None,
        "usable_bytes": usable,
        "fits": None if usable is None else worst["total"] <= usable,
    }
    if gpu is not None and gpu.peak_flops > 0:
        out.update(time_model(shape, s, gpu, o, simulate))
    return out
