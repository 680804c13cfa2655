"""What a run reports: MFU against the device's peak, per-rank memory, collective bytes and time,
one JSON line per logged step (global rank 0), a progress bar and optional TensorBoard."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import TYPE_CHECKING

import torch

from ...core import cards
from ...distributed.comm import merge_stats, reset_stats
from .energy import EnergyMeter
from .straggler import StragglerWatch, split

if TYPE_CHECKING:
    from ..state import TrainState



def device_peak(device: torch.device, training=None) -> tuple[float, str]:
    """(peak FLOP/s per device, where the number comes from). `training` (a TrainingConfig) brings
    `peak_tflops` (> 0 overrides every device) and `precision` (the dtype a CPU peak is measured in).

    A CPU has no datasheet peak worth trusting, so the run measures it; MFU is only meaningful if
    that measurement is an upper bound, hence `measure_cpu_peak` takes the best of several tries."""
    override = float(getattr(training, "peak_tflops", 0.0) or 0.0)
    if override > 0:
        return override * 1e12, f"training.peak_tflops = {override:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        family = cards.family(name)
        if family:
            return cards.PEAK_FLOPS[family], f"{name} (datasheet bf16)"
        return 0.0, f"{name} (unknown peak; set training.peak_tflops)"
    dtypes = [torch.float32]
    low = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(getattr(training, "precision", "fp32"))
    if low is not None:  # the run's matmuls are low precision, its norms and loss fp32: take the faster
        dtypes.append(low)
    best, label = 0.0, ""
    for dt in dtypes:
        flops, tries = measure_cpu_peak(dtype=dt)
        if flops > best:
            best, label = flops, (f"cpu (measured: {str(dt).replace('torch.', '')} matmul, best of {tries} tries, "
                                  f"{torch.get_num_threads()} threads)")
    return best, label


def measure_cpu_peak(n: int = 1024, tries: int = 7, seconds: float = 0.06,
                     dtype: torch.dtype = torch.float32) -> tuple[float, int]:
    """(best FLOP/s over `tries` timed bursts of n×n matmuls, tries) at torch's current thread count,
    which is the run's (torchrun sets OMP_NUM_THREADS per worker). One busy moment on a shared machine
    slows some bursts; the best burst is the closest to what the cores can do."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: thread pool, packing buffers
    best = 0.0
    for _ in range(tries):
        reps, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        best = max(best, 2.0 * n ** 3 * reps / dt)
    return best, tries


def record_peak(run_dir: str, flops: float, label: str) -> None:
    """Note the peak behind the MFU numbers in RUN_DIR/config.toml as a comment (the key itself stays
    as configured: 0 means "measure again" when the config is reused on another machine)."""
    path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if not ln.startswith(PEAK_COMMENT)]
    lines.append(f"{PEAK_COMMENT} {flops / 1e12:.6g} TFLOP/s per device, {label}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


PEAK_COMMENT = "# peak used for MFU:"


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views and tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def sched_seconds() -> tuple[float, float] | None:
    """(seconds on a core, seconds runnable but waiting for one) summed over this process's threads, from
    Linux's /proc/self/task/*/schedstat; None where it does not exist. On a shared CPU their ratio is the
    share of a core the ranks got, which `--calibrate` needs (docs/planner.md, "Calibration from a run")."""
    base = "/proc/self/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return None
    on = wait = 0
    for tid in tids:
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                fields = f.read().split()
        except OSError:  # a thread that just ended
            continue
        on, wait = on + int(fields[0]), wait + int(fields[1])
    return on / 1e9, wait / 1e9


PROFILE_FILE = "profile.json"


class StepProfiler:
    """metrics.profile_step = N: rank 0 runs step N under torch.profiler and writes RUN_DIR/profile.json,
    each op name's calls, self seconds (host; `device_s` on a GPU), input elements and FLOPs over that
    step. `--calibrate` splits the step into GEMM, attention, element-wise and dispatch time from it
    (docs/planner.md, "Calibration from a run"). Only rank 0: in DP and TP the ranks run the same ops."""

    def __init__(self, run_dir: str, step: int, enabled: bool, device: torch.device):
        self.path, self.step, self.enabled, self.device = os.path.join(run_dir, PROFILE_FILE), step, enabled, device

    def __call__(self, step: int):
        import contextlib
        if not (self.enabled and step == self.step):
            return contextlib.nullcontext()
        return self._profile()

    def _profile(self):
        import contextlib

        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])

        @contextlib.contextmanager
        def run():
            with profile(activities=acts, record_shapes=True, with_flops=True) as prof:
                t0 = time.perf_counter()
                yield
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                wall = time.perf_counter() - t0
            self._write(prof, wall)
        return run()

    def _write(self, prof, wall: float) -> None:
        ops: dict[str, dict] = {}
        for ev in prof.events():
            o = ops.setdefault(ev.name, {"calls": 0, "self_s": 0.0, "device_s": 0.0, "elems": 0, "flops": 0})
            o["calls"] += 1
            o["self_s"] += ev.self_cpu_time_total / 1e6
            o["device_s"] += getattr(ev, "self_device_time_total", 0) / 1e6
            o["flops"] += int(getattr(ev, "flops", 0) or 0)
            for shape in ev.input_shapes or ():
                if isinstance(shape, (list, tuple)) and all(isinstance(x, int) for x in shape):
                    n = 1
                    for x in shape:
                        n *= x
                    o["elems"] += n if shape else 0
        with open(self.path, "w") as f:
            json.dump({"step": self.step, "rank": 0, "device": self.device.type, "wall_s": wall,
                       "threads": torch.get_num_threads(), "ops": ops}, f, indent=0)


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(kb) * 1024


def sinks(run_dir: str, cfg) -> list:
    """Where else each metrics line goes, from the config's metrics section (rank 0 only): objects with
    `write(record)` and `close()`."""
    out = []
    if cfg.metrics.wandb:
        from .wandb_sink import WandbSink
        out.append(WandbSink(run_dir, cfg))
    return out


class MetricsLog:
    """Rank 0 writes; other ranks hold a disabled instance so call sites need no rank checks."""

    def __init__(self, run_dir: str, enabled: bool, total_steps: int, start_step: int,
                 progress: bool = True, tensorboard: bool = False, cfg=None):
        self.enabled = enabled
        self.run_dir = run_dir
        self.noted_peak: tuple | None = None  # (flops, label) last written to config.toml
        self.raised = (0.0, "")  # (peak FLOP/s, why) once the run outran its measured peak
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a") if enabled else None
        self.bar = None
        self.tb = None
        if enabled and progress:
            from tqdm import tqdm

            class Bar(tqdm):
                monitor_interval = 0  # no tqdm_monitor thread: it outlives the run (launch.teardown names it)
            self.bar = Bar(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                           file=sys.stderr, disable=None)
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("metrics.tensorboard: needs the `tensorboard` package "
                                   "(pip install 'meshlm[tensorboard]')") from e
            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.sinks = sinks(run_dir, cfg) if enabled and cfg is not None else []

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._bound_mfu(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(k, v, record["step"])
                elif isinstance(v, dict) and k == "mem":
                    for mk, mv in v.items():
                        self.tb.add_scalar(f"mem/{mk}", mv, record["step"])
        for sink in self.sinks:
            sink.write(record)
        if self.bar is not None and "loss" in record:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%", refresh=False,
                                 **({"W": f"{record['power_w']:.0f}"} if record.get("power_w") else {}))

    def _bound_mfu(self, record: dict) -> None:
        """Keep MFU <= 100% with a measured peak. A run faster than the measured matmul proves the
        measurement caught a busy moment (on a shared two-core machine a start-up burst can read a fifth
        of the truth), so the matmul is measured again now, once, and the peak becomes the best of that,
        the first measurement and the run's own rate. A datasheet or training.peak_tflops peak is left
        alone. The peak in use is noted in config.toml."""
        peak = record.get("peak_flops") or 0.0
        if not peak or "mfu" not in record:
            return
        label = record.get("peak_label", "")
        if "measured" in label:
            rate = record["mfu"] * peak  # FLOP/s per device over this window
            best, note = self.raised
            if rate > max(peak, best):
                if not note:  # first time: measure again, the machine is evidently less busy now
                    dtype = torch.bfloat16 if "bfloat16" in label else torch.float32
                    fresh = measure_cpu_peak(dtype=dtype)[0]
                    best, note = max(fresh, rate), f"measured again at step {record['step']}"
                if rate > best:
                    best, note = rate, f"raised to the run's own rate at step {record['step']}"
                self.raised = (best, note)
            if best > peak:
                record["mfu"] = rate / best
                record["peak_flops"] = best
                record["peak_label"] = f"{label}; {note}"
        noted = (record["peak_flops"], record["peak_label"])
        if noted != self.noted_peak:
            record_peak(self.run_dir, *noted)
            self.noted_peak = noted

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step` (a rollback runs them again)."""
        if not self.enabled:
            return
        self.file.close()
        path = os.path.join(self.run_dir, "metrics.jsonl")
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
        self.file = open(path, "a")
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.file is not None:
            self.file.close()


def memory(par, device: torch.device) -> dict:
    """Live bytes on this rank just before the optimizer step (README: metrics.jsonl `mem`)."""
    opt, grads = par.optimizer, par.grads
    return {"params": tensor_bytes(opt.param_tensors()), "grads": tensor_bytes(grads.held_tensors()),
            "optim": opt.state_bytes(), "peak": peak_bytes(device)}


class StepMeter:
    """Builds the metrics line of a logged step: wall time, throughput, MFU and collectives averaged
    over the steps since the previous line (the window), plus what the layout reports (MoE routing,
    the pipeline's bubble and trace), the job's energy since the previous line (energy.py) and, from every
    rank's time split, the ranks named stragglers."""

    def __init__(self, ctx, cfg, args, layout, par, run_dir: str, store):
        t, m = cfg.training, cfg.metrics
        self.ctx, self.par, self.comms = ctx, par, ctx.all_comms()
        self.loss_comms = (ctx.comm("dp_cp"), ctx.comm("pp"))  # pp > 1: only the last stage's is not 0
        self.loss_divisor = layout.step_microbatches * layout.cp  # micro-batches of equal token counts
        self.layout = layout
        self.micro_batch, self.cp, self.seq_len = layout.micro_batch, layout.cp, cfg.data.seq_len
        self.global_batch, self.ramped = t.global_batch, bool(t.batch_rampup)
        self.flops_per_token = args.flops_per_token(cfg.data.seq_len)
        self.tokens_per_step = t.global_batch * cfg.data.seq_len  # a full step's (bench/gpu.py reads these)
        self.flops_per_step = self.flops_per_token * self.tokens_per_step
        self.peak_flops, self.peak_label = device_peak(ctx.device, t)
        self.trace = os.path.join(run_dir, "pipeline_trace.json") if ctx.is_logger else None
        self.data_s = 0.0  # seconds reading batches since the last line (the step's time split)
        self.window_start, self.window_steps, self.window_seqs = time.perf_counter(), 0, 0
        self.sched = sched_seconds()
        self.stragglers = StragglerWatch(store, ctx.job_rank, ctx.job_world, m.straggler_factor, m.straggler_steps)
        self.energy = EnergyMeter(ctx.device.type, ctx.device.index or 0, store, ctx.job_rank, ctx.job_world)

    def count_step(self, sequences: int) -> None:
        """One more step, of `sequences` (its global batch), in this window (a step undone by a
        rollback is not counted)."""
        self.window_steps += 1
        self.window_seqs += sequences

    def new_window(self) -> None:
        """The next line averages the steps from now on."""
        self.window_start, self.window_steps, self.window_seqs = time.perf_counter(), 0, 0

    def restart(self) -> None:
        """The loop starts (or goes on from a rollback): what was counted so far is not a step's."""
        self.new_window()
        self.sched = sched_seconds()
        reset_stats(self.comms)

    def global_loss(self, loss_sum: torch.Tensor, batch: int | None = None) -> float:
        """Mean loss over the whole global batch (`batch` sequences: training.batch_rampup's step; None:
        training.global_batch) from each rank's sum of micro-batch losses."""
        total = float(loss_sum)
        for comm in self.loss_comms:
            total = comm.all_reduce_scalars([total])[0]
        divisor = self.loss_divisor if batch in (None, self.global_batch) else \
            self.layout.step_accum(batch) * self.layout.dp * self.cp  # one island's micro-batches of that step
        return total / divisor

    def line(self, state: "TrainState", out: dict, message) -> dict:
        """The metrics line of `state.step`, whose `train_step` returned `out`; stragglers named on
        rank 0 are also told through `message`."""
        device, n = self.ctx.device, self.window_steps
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = (time.perf_counter() - self.window_start) / n
        stats = merge_stats(self.comms)
        reset_stats(self.comms)
        world = self.ctx.world_size
        step_tokens = self.window_seqs * self.seq_len / n  # per step of the window (a ramp's differ)
        mfu = self.flops_per_token * step_tokens / step_s / (self.peak_flops * world) if self.peak_flops else 0.0
        rec = {"step": state.step, "loss": self.global_loss(out["loss_sum"], out["global_batch"]),
               "grad_norm": float(out["norm"]), "lr": out["lr"],
               "tokens": state.sampler.ramp.consumed(state.step) * self.seq_len,
               "tokens_per_s": step_tokens / step_s, "mfu": mfu, "step_s": step_s,
               "mem": out["mem"] or memory(self.par, device), "peak_flops": self.peak_flops,
               "peak_label": self.peak_label, "world": world,
               "comm": {k: {"calls": s.calls / n, "bytes": s.bytes / n, "seconds": s.seconds / n}
                        for k, s in stats.items()}}
        if device.type == "cpu":  # ranks share the cores: --calibrate prices that (docs/planner.md)
            rec["threads"] = torch.get_num_threads()
            rec["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            now, before = sched_seconds(), self.sched
            if now is not None and before is not None:  # on a core / waiting for one, per step
                rec["cpu_s"], rec["wait_s"] = ((a - b) / n for a, b in zip(now, before))
            self.sched = now
        if self.ramped:  # training.batch_rampup: the step's own global batch (sequences)
            rec["global_batch"] = out["global_batch"]
        rec.update(self.energy.record(state.step, self.window_seqs * self.seq_len, message))  # time, energy_j, ...
        rec["time_split"] = split(step_s, sum(s.seconds for s in stats.values()) / n, self.data_s / n)
        self.data_s = 0.0
        if state.sampler.drawn() is not None:  # data.mix: tokens drawn per source so far
            rec["data"] = state.sampler.drawn()
        if self.par.mtp is not None:  # the unweighted MTP loss; `loss` is the main head's alone
            total = self.par.mtp.total
            rec["mtp_loss"] = self.global_loss(total if total is not None else torch.zeros((), device=device),
                                               out["global_batch"])
        if self.par.zloss is not None:  # z · mean log² Z (training.z_loss); `loss` stays the cross-entropy
            total = self.par.zloss.total
            rec["z_loss"] = self.global_loss(total if total is not None else torch.zeros((), device=device),
                                             out["global_batch"])
        if self.par.moe is not None:
            rec["moe"] = self.par.moe.record(self.ctx.comm("island"), device)
        if self.par.pipeline is not None:  # measured bubble; rank 0 writes the step's Chrome trace
            rec["bubble"] = self.par.pipeline.record(self.trace, state.step)
        if bool(out["skipped"]):  # a device flag with fp16: read here, where the step has synced anyway
            rec["skipped"] = True
            if state.scaler.enabled:
                rec["loss_scale"] = float(state.scaler.scale)
        named = self.stragglers.report(state.step, rec["time_split"], self.ctx.is_logger, message)
        if named:
            rec["stragglers"] = named
        return rec
