"""The training loop. One code path for 1 and N ranks: the layout only changes what `parallelize`
returns (its step runner among it) and which slice of the global batch this rank reads.

`Trainer.__init__` builds everything and resumes; `fit` runs the steps; `train_step` is one optimizer
step. What a checkpoint holds is `TrainState` (state.py); a logged step's metrics line is built by
`StepMeter` (metrics.py)."""
from __future__ import annotations

import os
import time
from functools import partial
from typing import Callable

import torch

from ..core.config import Config
from ..core.config.model import model_args
from ..core.facts.course import lr_at
from ..core.layout import Layout, build_layout
from ..data import default_data_dir
from ..data.dataset import open_data
from ..distributed.link import island_job, job_world
from ..distributed.mesh import ParallelContext, device_defaults, init_context, join_world, pick_device, shutdown
from ..model import build_model
from ..parallel import Parallelized, parallelize, slices
from ..parallel.dims.island_link import linked, meet_islands
from ..parallel.dims.islands import outer_sync
from ..parallel.optim.master import MasterOptimizer
from ..parallel.model_plans.moe import model_plan_for
from ..parallel.step import local_batch
from . import checkpoint as ckpt
from . import plugins
from .evaluate import evaluate
from .launch import record_error
from .observe.metrics import MetricsLog, StepMeter, StepProfiler, memory
from .optim import LossScaler, clip_, grad_norm
from .resilience import fault, preempt
from .resilience.saving import Saving
from .resilience.spike import SpikeDetector, SpikeHandler
from .state import TrainState


def start(cfg: Config, run_dir: str, restarts: int | None = None, layout: Layout | None = None,
          pick: Callable | None = None) -> "Trainer":
    """One worker's start-up, in the order docs/fault_tolerance.md ("Growing back") needs: the world
    group and the job's restart count every rank agreed on (`restarts`, if the caller already joined),
    then the layout (its parallel.elastic message depends on that count), then the mesh's groups.
    `layout`: the one the entry resolved for this world and device (preflight.py); without it
    `pick(cfg, world, device, restarts)` chooses one (the entry's `pick_layout`, which asks the planner),
    else `build_layout`. MESHLM_PLUGINS (plugins.py) are imported first and installed on the Trainer."""
    extensions = plugins.load()
    device = pick_device(cfg.training.device)
    if restarts is None:
        restarts = join_world(device, cfg.parallel.timeout_s)
    if layout is None:
        layout = pick(cfg, job_world(), device, restarts) if pick else build_layout(device_defaults(cfg), job_world())
    ctx = init_context(layout.shape(), device, cfg.parallel.timeout_s, restarts)
    try:
        trainer = Trainer(cfg, run_dir, ctx, layout)
    except BaseException:
        shutdown(ctx)
        raise
    for ext in extensions:
        ext.install(trainer)
    return trainer


class Trainer:
    """One rank's run: built and resumed by the constructor, trained by `fit`. Plugins (plugins.py) may
    wrap `runner` and `data`; everything else is read, not replaced."""

    def __init__(self, cfg: Config, run_dir: str, ctx: ParallelContext, layout: Layout):
        self.cfg, self.run_dir, self.ctx, self.layout = cfg, run_dir, ctx, layout
        t, m = cfg.training, cfg.metrics
        os.makedirs(run_dir, exist_ok=True)
        # data and this rank's part of the model
        torch.manual_seed(t.seed)
        self.args = model_args(cfg)
        d = cfg.data
        self.data = open_data("" if d.mix else (d.path or default_data_dir()), d.mix, d.seq_len,
                              t.global_batch, t.seed, d.document_mask, t.batch_rampup)
        if self.data.vocab_size > self.args.vocab_size:
            raise ValueError(f"model.vocab_size: {self.args.vocab_size} is smaller than the tokenizer's "
                             f"{self.data.vocab_size}")
        with torch.device("meta"):
            model = build_model(self.args)
        self.par: Parallelized = parallelize(model, ctx, layout, MasterOptimizer, **slices(cfg))
        self.model = self.par.model
        self.runner = self.par.runner
        # parallel.islands > 1: DiLoCo's outer step across islands (docs/diloco.md); None otherwise
        island, job = ctx.coords["islands"], island_job() is not None
        self.rounds = linked(ctx, cfg.parallel.timeout_s) if job else None  # island jobs: rounds over the link
        self.outer = outer_sync(self.par, ctx, layout, t.outer, model_plan_for(self.model), self.args.n_layers,
                                self.rounds)
        # what checkpoints hold, and what keeps a run alive (watchdog, non-finite guard, preemption)
        # island jobs (training.outer.on_island_loss = "continue"): this island's state is its job's own,
        # saved as island 0's in checkpoints/island{k} (island 0: checkpoints/; docs/diloco.md)
        self.state = TrainState(self.par, self.data.sampler, LossScaler(t.precision == "fp16", device=ctx.device),
                                SpikeDetector(t.spike_zscore, t.spike_window, t.spike_action), cfg, layout, ctx.job_rank,
                                self.outer, 0 if job else island, island_job=island if job else None)
        root = os.path.join(run_dir, "checkpoints", *([f"island{island}"] if job and island else []))
        self.checkpointer = ckpt.Checkpointer(root, ctx.comm("world"), cfg.checkpoint.keep, cfg.checkpoint.async_,
                                              cfg.checkpoint.on_error)
        self.watchdog = fault.watch(ctx, cfg.parallel.heartbeat_s, partial(record_error, run_dir))
        self.guard = fault.FiniteGuard(t.precision, ctx.device, ctx.comm("world"), run_dir, ctx.restarts)
        self.preempt = preempt.Preemption(cfg.checkpoint.on_signal, ctx.device)
        self.meter = StepMeter(ctx, cfg, self.args, layout, self.par, run_dir,
                               self.watchdog.store if self.watchdog else None)
        # resume, then the metrics log and the checkpoint cadence from the resumed step
        try:
            self.guard.replay()  # a restart after a non-finite stop stops at once
            self.resumed = self._resume()  # meta.json of the checkpoint resumed from, or None
            if job:  # meet the other islands: a restarted island leaves with their state
                meet_islands(self.rounds, self.outer, ctx, self.state, t.steps)
        except BaseException:
            self._release()
            raise
        self.log = MetricsLog(run_dir, ctx.is_logger, t.steps, self.state.step, m.progress, m.tensorboard, cfg)
        self.profiled = StepProfiler(run_dir, m.profile_step, ctx.is_logger, ctx.device)
        cadence = fault.Cadence(cfg.checkpoint.every, cfg.checkpoint.mtbf_hours, self.state.step,
                                ctx.comm("world"), self.log)
        self.saving = Saving(cfg, self.checkpointer, self.guard, cadence, self.log, ctx.comm("world"), run_dir)
        self.spike_handler = SpikeHandler(self.checkpointer, self.log)

    def _resume(self) -> dict | None:
        """Load the checkpoint `checkpoint.resume` (or a restart) asks for, then fix up metrics.jsonl."""
        path = ckpt.find_resume(self.checkpointer.root, self.cfg.checkpoint.resume, self.ctx.restarts)
        meta = self.state.load(path) if path is not None else None
        fault.on_start(self.run_dir, self.state.step, self.ctx.is_logger, self.ctx.restarts,
                       meta and meta.get("metrics"),
                       meta and fault.resize_record(meta, self.layout.shape(), self.layout.accum))
        return meta

    # -- the loop -------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> dict:
        """Run the steps until training.steps (`stop_at`: end after that step, as if it were the last
        one run, with the schedule and cadence of the whole run). Returns the last metrics line."""
        t, state, log, last = self.cfg.training, self.state, self.log, {}
        end = t.steps if stop_at is None else min(stop_at, t.steps)
        self.saving.resume_pause(state)  # killed while paused for energy: the rest of that pause first
        self.meter.restart()
        try:
            while state.step < end:
                if self.watchdog is not None:
                    self.watchdog.beat(state.step)
                logging = (state.step + 1) % self.cfg.metrics.every == 0 or state.step + 1 == t.steps
                with self.profiled(state.step + 1):  # metrics.profile_step: rank 0 profiles that step
                    out = self.train_step(measure=logging)
                if self.spike_handler.rolled_back(out["spike"], state):  # go on from the checkpoint
                    self.meter.restart()
                    continue
                self.meter.count_step(out["global_batch"])
                rec = self.meter.line(state, out, log.message) if logging else None
                exporting = self.saving.after_step(state, rec)  # a checkpoint, if due
                log.advance()
                if rec is not None:
                    last = rec
                    log.write(rec)
                if exporting and not state.island_job:  # island jobs: island 0 exports
                    self.saving.export(state.step)
                if rec is not None:  # the next window starts after this line (and its save, export)
                    self.meter.new_window()
                if self.preempt.agreed(out["stop"]):  # every rank: a signal reached one of them
                    signal = self.preempt.name(self.ctx.comm("world"))
                    last = dict(last, preempted=self.saving.preempted(state, rec, signal))
                    break
                if t.eval_every and (state.step % t.eval_every == 0 or state.step == t.steps):
                    last = dict(last, eval_loss=self._evaluate())
            self.saving.finish()
            if self.outer is not None:
                self.outer.drain()
            if self.rounds is not None:  # island jobs: this island is done (out, not lost)
                self.rounds.link.finish()
        finally:
            self.close()
        return last

    def train_step(self, measure: bool = True) -> dict:
        """One optimizer step. `measure`: count live memory before the optimizer step (log steps only).

        No host reads of device values: with fp16 the loss scale, the overflow flag and the skip all
        stay on the device (the fused optimizer skips itself, see optim.adamw_step). The returned
        tensors (`loss_sum`, `norm`, `skipped`) are read by the metrics line on logged steps only."""
        t, par, state, scaler = self.cfg.training, self.par, self.state, self.state.scaler
        t0 = time.perf_counter()
        size = self.data.sampler.batch_size()  # this step's global batch (training.batch_rampup: while ramping, fewer)
        batch = local_batch(self.data.next_batch(self.ctx.data_index(), self.layout.dp * self.layout.islands,
                                                 self.layout.dp_rows),
                            par.local_tokens, self.ctx.device)
        self.meter.data_s += time.perf_counter() - t0  # the data share of the step (train/observe/straggler.py)
        lr = lr_at(state.step, self.cfg.optim, t.steps)  # a function of the step, ramp or not (docs/training.md, "Batch-size ramp-up")
        # fp16: a 0-dim device tensor (scale / accum); otherwise the plain 1 / accum (dp_weights: the mean
        # accumulation count, so the dp average is the mean over every micro-batch: docs/heterogeneous.md);
        # the step's own count, so the gradient is the mean over the step's tokens under a ramp too
        accum = self.layout.step_accum(size)
        scale = scaler.scale / accum if scaler.enabled else 1.0 / accum
        if par.moe is not None:  # the aux loss's gradient is scaled like the main loss's
            par.moe.begin_step(scale)
        if par.mtp is not None:
            par.mtp.begin_step()
        if par.zloss is not None:
            par.zloss.begin_step()
        loss_sum = self.runner.run(batch, scale, timed=measure)  # gradients reduced on return
        grads = par.grads.grad_tensors()
        if scaler.enabled:
            torch._foreach_mul_(grads, scaler.inv_scale())
        stop = self.preempt.flag()  # checkpoint.on_signal: summed over the world with the norm
        norm = grad_norm(par.norm_grads(), par.world, self.ctx.device, carry=stop)
        if self.outer is not None:  # stopping is the job's decision, across islands too (a step late)
            stop = self.outer.agree_stop(stop)
        self.guard.observe(state.step + 1, loss_sum, norm)  # device ops only; read on log steps
        found_inf = None
        if scaler.enabled:
            found_inf = torch.isfinite(norm).logical_not().float()  # 1.0: skip this step (every rank agrees)
            scaler.update(found_inf)
        spike = None
        if state.spikes.enabled:  # a host read of the global loss every step, hence off by default
            spike = state.spikes.judge(state.step + 1, self.meter.global_loss(loss_sum, size), float(norm))
        if spike is not None:  # the update is not applied (train/resilience/spike.py): the same on every rank
            found_inf = torch.ones((), device=self.ctx.device)
        clip_(grads, norm, t.clip)  # harmless on a skipped step: the optimizer ignores the grads
        par.optimizer.set_lr(lr)
        mem = memory(par, self.ctx.device) if measure else None
        par.optimizer.step(found_inf)
        if par.moe is not None:  # auxiliary-loss-free balancing: every step, from the step's global counts
            par.moe.update_biases(par.world, self.ctx.device, found_inf)
        state.step += 1
        if self.outer is not None:  # every H inner steps (per fragment): the islands' outer step
            self.outer.after_step(state.step)
        return {"loss_sum": loss_sum, "norm": norm, "lr": lr, "spike": spike, "global_batch": size,
                "skipped": found_inf if found_inf is not None else False, "mem": mem, "stop": stop}

    def _evaluate(self) -> float:
        ev = evaluate(self.runner, self.par.local_tokens, self.data, self.ctx, self.layout,
                      self.cfg.training.eval_batches)
        self.log.write({"step": self.state.step, "eval_loss": ev})
        self.log.message(f"step {self.state.step}: eval loss {ev:.4f}")
        return ev

    def close(self) -> None:
        """The metrics file, the watchdog's thread and the optimizer's files (offload = "nvme")."""
        self.log.close()
        self._release()

    def _release(self) -> None:
        self.checkpointer.close(finished=False)  # after a failure: its thread is not waited for
        self.preempt.close()
        if self.watchdog is not None:
            self.watchdog.close()
        self.par.optimizer.close()  # offload = "nvme": its scratch files go
