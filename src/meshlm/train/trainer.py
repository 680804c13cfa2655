"""The training loop. One code path for 1 and N ranks: the layout only changes what `parallelize`
returns and which slice of the global batch this rank reads."""
from __future__ import annotations

import os
import time

import torch

from ..config import Config, to_dict
from ..data import default_data_dir
from ..data.dataset import open_data
from ..distributed.comm import Watchdog, exit_silent, merge_stats, reset_stats
from ..distributed.mesh import ParallelContext, init_context, join_world, pick_device, shutdown
from ..layout import Layout, model_args
from ..model import build_model
from ..parallel import Parallelized, parallelize
from ..plan.auto import resolve
from . import checkpoint as ckpt
from . import fault
from .metrics import MetricsLog, StepProfiler, device_peak, device_profile, peak_bytes, sched_seconds, tensor_bytes
from .spike import MAX_ROLLBACKS_TO_ONE_CHECKPOINT, SpikeDetector, SpikeError, rollback_target
from .straggler import StragglerWatch, describe, split
from .optim import LossScaler, MasterOptimizer, clip_, grad_norm, lr_at


def run(cfg: Config, run_dir: str, restarts: int | None = None, layout: Layout | None = None) -> dict:
    """Entry point of one worker (or of the only process); `restarts` and `layout` as in `start`."""
    try:
        return start(cfg, run_dir, restarts, layout).fit()
    finally:
        shutdown()


def start(cfg: Config, run_dir: str, restarts: int | None = None, layout: Layout | None = None) -> "Trainer":
    """One worker's start-up, in the order docs/fault_tolerance.md ("Growing back") needs: the world
    group and the job's restart count every rank agreed on (`restarts`, if the caller already joined),
    then the layout (its parallel.elastic message depends on that count; `layout`, if the caller already
    resolved it for this world and device, as cli.py does), then the mesh's groups."""
    device = pick_device(cfg.training.device)
    if restarts is None:
        restarts = join_world(device, cfg.parallel.timeout_s)
    if layout is None:
        layout = resolve(cfg, int(os.environ.get("WORLD_SIZE", "1")), device_profile(device), restarts)
    ctx = init_context(layout.shape(), device, cfg.parallel.timeout_s, restarts)
    trainer = Trainer(cfg, run_dir, ctx, layout)
    fault.TestHooks.install(trainer)  # failure injection for the test suite; nothing unless asked
    return trainer


def _log_auto(record: dict, run_dir: str) -> None:
    """parallel.auto: say what the planner chose and predicted (stdout and run_dir/auto_layout.json)."""
    import json
    key = "parallel.auto"
    if "replanned_from" in record:
        key = "parallel.elastic"
        print(f"{key}: {record['replanned_from']} does not fit {record['world']} ranks ({record['reason']}): "
              f"replanned", flush=True)
    print(f"{key}: {record['auto_layout']} on {record['world']} × {record['gpu']}: predicted "
          f"{record['predicted_step_s']:.3g} s/step, {record['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s per "
          f"device, MFU {record['predicted_mfu']:.1%}, {record['predicted_mem_gib']:.2f} GiB", flush=True)
    with open(os.path.join(run_dir, "auto_layout.json"), "w") as f:
        json.dump(record, f, indent=1)


class Trainer:
    def __init__(self, cfg: Config, run_dir: str, ctx: ParallelContext, layout: Layout):
        self.cfg, self.run_dir, self.ctx, self.layout = cfg, run_dir, ctx, layout
        t = cfg.training
        os.makedirs(run_dir, exist_ok=True)
        if ctx.rank == 0 and getattr(cfg, "auto_record", None):
            _log_auto(cfg.auto_record, run_dir)
        torch.manual_seed(t.seed)
        self.args = model_args(cfg)
        d = cfg.data
        self.data = open_data("" if d.mix else (d.path or default_data_dir()), d.mix, d.seq_len,
                              t.global_batch, t.seed, d.document_mask)
        if self.data.vocab_size > self.args.vocab_size:
            raise ValueError(f"model.vocab_size: {self.args.vocab_size} is smaller than the tokenizer's "
                             f"{self.data.vocab_size}")
        self.seq_len = d.seq_len
        self.sampler = self.data.sampler  # its step is the data position (checkpointed)
        with torch.device("meta"):
            model = build_model(self.args)
        self.par: Parallelized = parallelize(model, ctx, cfg, layout, MasterOptimizer)
        self.model = self.par.model
        self.scaler = LossScaler(t.precision == "fp16", device=ctx.device)
        self.step = 0
        self.saved_step: int | None = None  # newest checkpoint written or resumed from (for messages)
        self.resumed_record: dict | None = None  # the resumed step's metrics line, from its meta.json
        self.resumed_layout: dict | None = None  # the resumed checkpoint's world and layout, and ours
        self.step_line: dict | None = None  # this step's metrics line (None on unlogged steps)
        self.dp_comm = ctx.comm("dp_cp")  # loss sums: every data- and context-parallel rank's tokens
        self.checkpointer = ckpt.Checkpointer(os.path.join(run_dir, "checkpoints"), ctx.comm("world"),
                                              cfg.checkpoint.keep, cfg.checkpoint.async_)
        self.watchdog = Watchdog.for_job(ctx.rank, ctx.world_size, cfg.parallel.heartbeat_s, self._peer_lost)
        for c in ctx.all_comms():
            c.watchdog = self.watchdog
        # fault tolerance (train/fault.py): non-finite guard
        self.guard = fault.FiniteGuard(t.precision, ctx.device, ctx.comm("world"), run_dir, ctx.restarts)
        self.spikes = SpikeDetector(t.spike_zscore, t.spike_window, t.spike_action)
        self.rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it
        m = cfg.metrics
        self.stragglers = StragglerWatch(self.watchdog.store if self.watchdog else None, ctx.rank, ctx.world_size,
                                         m.straggler_factor, m.straggler_steps)
        self.data_s = 0.0  # seconds reading batches since the last metrics line
        self.peak_flops, self.peak_label = device_peak(ctx.device, t)
        self.flops_per_step = self.args.flops_per_token(self.seq_len) * t.global_batch * self.seq_len

    def _peer_lost(self, line: str) -> None:
        """The watchdog found a silent rank (distributed/comm.py): leave the line for the launcher, exit."""
        from .launch import record_error
        record_error(self.run_dir, self.ctx.rank, f"meshlm: {line}")
        exit_silent(line)

    # -- one step -----------------------------------------------------------------------------
    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        return self.par.loss_fn(self.model(inputs) if docs is None else self.model(inputs, docs=docs), targets)

    def train_step(self, measure: bool = True) -> dict:
        """One optimizer step. `measure`: count live memory before the optimizer step (log steps only).

        No host reads of device values: with fp16 the loss scale, the overflow flag
        and the skip all stay on the device (the fused optimizer skips itself, see optim.adamw_step).
        The returned tensors (`loss_sum`, `norm`, `skipped`) are read by `_record` on log steps only."""
        t, par, scaler = self.cfg.training, self.par, self.scaler
        t0 = time.perf_counter()
        batch = self.data.next_batch(self.ctx.index("dp"), self.layout.dp)
        inputs, targets, docs = (None if x is None else self._to_device(par.local_tokens(x)) for x in batch)
        self.data_s += time.perf_counter() - t0  # the data share of the step split (train/straggler.py)
        lr = lr_at(self.step, self.cfg.optim, t.steps)
        par.grads.begin_step()
        loss_sum = torch.zeros((), device=self.ctx.device)
        mb, accum = self.layout.micro_batch, self.layout.accum
        # fp16: a 0-dim device tensor (scale / accum); otherwise the plain 1 / accum
        scale = scaler.scale / accum if scaler.enabled else 1.0 / accum
        if par.moe is not None:  # the aux loss's gradient is scaled like the main loss's
            par.moe.begin_step(scale)
        if par.forward_backward is not None:  # pipeline: the schedule runs every micro-batch
            par.pipeline.timed = measure  # its timeline (bubble metric) is read on logged steps only
            loss_sum = par.forward_backward(inputs, targets, scale, docs)
        else:
            for i in range(accum):
                par.grads.set_sync(i == accum - 1)
                part = slice(i * mb, (i + 1) * mb)
                loss = self._loss(inputs[part], targets[part], None if docs is None else docs[part])
                (loss * scale).backward()
                loss_sum += loss.detach()
        par.grads.finish()
        grads = par.grads.grad_tensors()
        if scaler.enabled:
            torch._foreach_mul_(grads, scaler.inv_scale())
        norm = grad_norm(par.norm_grads(), par.world, self.ctx.device)
        self.guard.observe(self.step + 1, loss_sum, norm)  # device ops only; read on log steps
        found_inf = None
        if scaler.enabled:
            found_inf = torch.isfinite(norm).logical_not().float()  # 1.0: skip this step (every rank agrees)
            scaler.update(found_inf)
        spike = self._judge_spike(loss_sum, norm)
        if spike is not None:  # the update is not applied (train/spike.py): the same on every rank
            found_inf = torch.ones((), device=self.ctx.device)
        clip_(grads, norm, t.clip)  # harmless on a skipped step: the optimizer ignores the grads
        par.optimizer.set_lr(lr)
        mem = self.memory() if measure else None
        par.optimizer.step(found_inf)
        self.step += 1
        return {"loss_sum": loss_sum, "norm": norm, "lr": lr, "spike": spike,
                "skipped": found_inf if found_inf is not None else False, "mem": mem}

    def _judge_spike(self, loss_sum: torch.Tensor, norm: torch.Tensor) -> dict | None:
        """training.spike_zscore > 0: judge this step from the global loss and gradient norm (a host
        read every step, hence off by default)."""
        if not self.spikes.enabled:
            return None
        return self.spikes.judge(self.step + 1, self.global_loss(loss_sum), float(norm))

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA: an async host-to-device copy from pinned memory."""
        if self.ctx.device.type == "cuda":
            x = x.pin_memory()
        return x.to(self.ctx.device, non_blocking=True)

    def memory(self) -> dict:
        """Live bytes on this rank just before the optimizer step (README: metrics.jsonl `mem`)."""
        opt, grads = self.par.optimizer, self.par.grads
        return {"params": tensor_bytes(opt.param_tensors()),
                "grads": tensor_bytes(grads.held_tensors()),
                "optim": opt.state_bytes(),
                "peak": peak_bytes(self.ctx.device)}

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """Mean loss over the whole global batch: every micro-batch (and CP rank's share of it) has the
        same token count."""
        total = self.dp_comm.all_reduce_scalars([float(loss_sum)])[0]
        total = self.ctx.comm("pp").all_reduce_scalars([total])[0]  # pp > 1: only the last stage's is not 0
        return total / (self.layout.accum * self.layout.dp * self.layout.cp)

    @torch.no_grad()
    def evaluate(self) -> float:
        dp, r = self.layout.dp, self.ctx.index("dp")
        batches = self.data.eval_batches(self.layout.micro_batch * dp, self.cfg.training.eval_batches)
        total, count = 0.0, 0
        for inputs, targets, docs in batches:
            n = inputs.shape[0] // dp
            x, y, d = (None if t is None else self.par.local_tokens(t[r * n:(r + 1) * n]).to(self.ctx.device)
                       for t in (inputs, targets, docs))
            if n:
                total += float((self.par.eval_loss or self._loss)(x, y, d)) * n
            count += inputs.shape[0] - inputs.shape[0] % dp
        total = self.dp_comm.all_reduce_scalars([total])[0]
        total = self.ctx.comm("pp").all_reduce_scalars([total])[0]
        return total / max(count * self.layout.cp, 1)

    # -- state --------------------------------------------------------------------------------
    def checkpoint_state(self) -> tuple[dict[str, ckpt.Pieces], dict[str, tuple[int, ...]]]:
        """This rank's pieces of every checkpoint tensor (views of its own optimizer state, placed by
        the placement records), and the full shape of every key, in model order."""
        state, shapes = {}, {}
        places = self.par.placements
        opt = self.par.optimizer
        for name, kind, t in opt.state_storage():
            pl = places[name]
            key = f"{kind}/{name}"
            # offload = "nvme": `t` stands for a stretch of a state file, read and written through it
            state[key] = ckpt.Pieces(pl.full_shape, torch.float32,
                                     [(b.offsets, v) for b, v in pl.pieces(t)], pl.owner,
                                     opt.backing(name, kind) if t.is_meta else None)
            shapes[key] = pl.full_shape
        rng = torch.get_rng_state()
        state["rng/cpu"] = ckpt.Pieces(tuple(rng.shape), rng.dtype, [((0,), rng)], self.ctx.rank == 0)
        return state, shapes

    def save(self) -> dict:
        """Write a checkpoint of this step; returns what the metrics line reports (`ckpt`). The step's
        metrics line (`step_line`) goes into meta.json: it is written after the save, so a crash in
        between would lose it; a resume from this checkpoint puts it back (train/fault.py)."""
        meta = {"step": self.step, "sampler": self.sampler.state_dict(), "scaler": self.scaler.state_dict(),
                "optimizer_step": self.par.optimizer.step_count(), "layout": self.layout.shape(),
                "accum": self.layout.accum, "spikes": self.spikes.state_dict(), "config": to_dict(self.cfg)}
        if self.step_line is not None and self.step_line["step"] == self.step:
            meta["metrics"] = dict(self.step_line)
        state, _ = self.checkpoint_state()
        out = self.checkpointer.save(self.step, state, meta)
        self.saved_step = self.step
        if self.cfg.checkpoint.async_:
            out["async"] = True
        return out

    def maybe_resume(self) -> None:
        root = os.path.join(self.run_dir, "checkpoints")
        path = ckpt.find_resume(root, self.cfg.checkpoint.resume, self.ctx.restarts)
        if path is not None:
            self.load(path)

    def load(self, path: str) -> dict:
        """Every rank's state from the checkpoint at `path` (written by any layout); its meta.json."""
        state, shapes = self.checkpoint_state()
        meta = ckpt.load(path, state, shapes)
        self.par.optimizer.loaded(meta["optimizer_step"])
        torch.set_rng_state(state["rng/cpu"].parts[0][1])
        self.sampler.load_state_dict(meta["sampler"])
        self.scaler.load_state_dict(meta["scaler"])
        self.step = int(meta["step"])
        self.saved_step = self.step
        self.resumed_record = meta.get("metrics")
        self.resumed_layout = fault.resize_record(meta, self.layout.shape(), self.layout.accum)
        self.spikes.load_state_dict(meta.get("spikes"))
        return meta

    # -- loop ---------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Resume, then one named stage after another per step until training.steps."""
        self._start()
        try:
            while self.step < self.cfg.training.steps:
                self._heartbeat()
                logging = self._logging_step()
                with self.profiled(self.step + 1):  # metrics.profile_step: rank 0 profiles that step
                    out = self.train_step(measure=logging)
                if self._spiked(out):  # rolled back to a checkpoint: go on from there (a skip is logged only)
                    continue
                rec = self._measure(out, logging)
                self._checkpoint_if_due(rec)
                self._write(rec)
                self._evaluate_if_due()
            self._finish()
        finally:
            self._close()
        return self.last

    def _start(self) -> None:
        """Resume (or replay a non-finite stop), fix up metrics.jsonl, open the log and the cadence."""
        t, m = self.cfg.training, self.cfg.metrics
        self.guard.replay()
        self.maybe_resume()
        fault.on_start(self.run_dir, self.step, self.ctx.is_logger, self.ctx.restarts, self.resumed_record,
                       self.resumed_layout)
        self.log = MetricsLog(self.run_dir, self.ctx.is_logger, t.steps, self.step, m.progress, m.tensorboard,
                              self.cfg)
        self.profiled = StepProfiler(self.run_dir, m.profile_step, self.ctx.is_logger, self.ctx.device)
        self.comms = self.ctx.all_comms()
        reset_stats(self.comms)
        self.last: dict = {}
        self.window_start, self.window_steps = time.perf_counter(), 0  # since the last metrics line
        self._sched = sched_seconds()
        self.cadence = fault.Cadence(self.cfg.checkpoint.every, self.cfg.checkpoint.mtbf_hours, self.step,
                                     self.ctx.comm("world"), self.log)

    def _heartbeat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(self.step)

    def _spiked(self, out: dict) -> bool:
        """A spike was judged: log it; `rollback` reloads the newest checkpoint before it and skips the
        data windows from there through the spike (PaLM's recipe). True when the loop restarts from
        the checkpoint; a skipped step (or a rollback with no checkpoint before it) goes on as usual."""
        spike = out["spike"]
        if spike is None:
            return False
        if spike["action"] == "rollback":
            self.checkpointer.wait()
            target = rollback_target(ckpt.list_checkpoints(self.checkpointer.root), spike["step"])
            if target is not None:
                self._rollback(spike, *target)
                return True
            spike = dict(spike, action="skip", why="no checkpoint before the spike")
        self.log.write({"step": self.step, "spike": spike})
        self.log.message(f"step {self.step}: {spike['on']} {spike['value']:.4g} is a spike "
                         f"(window mean {spike['mean']:.4g}, std {spike['std']:.3g}): update skipped")
        return False

    def _rollback(self, spike: dict, to_step: int, path: str) -> None:
        self.rollbacks[to_step] = self.rollbacks.get(to_step, 0) + 1
        if self.rollbacks[to_step] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise SpikeError(f"training.spike_action: {self.rollbacks[to_step]} rollbacks to the step {to_step} "
                             f"checkpoint, the last for a spike at step {spike['step']}: stopped (lower optim.lr)")
        end = self.sampler.state_dict()["step"]  # the data position after the spiking step's windows
        self.load(path)
        first = self.sampler.state_dict()["step"]
        self.sampler.load_state_dict({**self.sampler.state_dict(), "step": end})
        self.log.truncate_after(self.step)  # the steps after the checkpoint run again, on later data
        windows = [first, end - 1]  # global batches (data positions) never trained on
        self.log.write({"step": self.step, "spike": dict(spike, action="rollback"), "rollback_to": self.step,
                        "skipped_batches": windows})
        self.log.message(f"step {spike['step']}: {spike['on']} {spike['value']:.4g} is a spike: rolled back to "
                         f"step {self.step}, skipping global batches {windows[0]}..{windows[1]}")
        self.window_start, self.window_steps = time.perf_counter(), 0
        reset_stats(self.comms)

    def _logging_step(self) -> bool:
        """Whether the step about to run writes a metrics line."""
        every, steps = self.cfg.metrics.every, self.cfg.training.steps
        return (self.step + 1) % every == 0 or self.step + 1 == steps

    def _measure(self, out: dict, logging: bool) -> dict | None:
        """The step's metrics line (logged steps), over the steps since the last line."""
        self.window_steps += 1
        if not logging:
            return None
        return self._record(out, self.comms, self.window_start, self.window_steps,
                            self.cfg.training.global_batch * self.seq_len)

    def _checkpoint_if_due(self, rec: dict | None) -> None:
        """Save when the cadence or an export asks; a bad state (non-finite) is never saved."""
        self.step_line = rec
        due = self.cadence.due(self.step, self.step == self.cfg.training.steps)
        self.exporting = self.export_due()
        if rec is not None or due or self.exporting:  # read the non-finite record
            self._check_finite(rec, self.log)
        if not (due or self.exporting):  # an export streams this step's checkpoint
            return
        ck = self.save()
        self.cadence.saved(self.step, ck["save_s"])
        for done in self._saves_done():  # a synchronous save has just finished
            if done["step"] == self.step:
                ck.update(write_s=done["write_s"], bytes=done["bytes"])
            else:
                self.log.write({"step": done["step"], "ckpt": done})
        if rec is None:
            self.log.write({"step": self.step, "ckpt": ck})
        else:
            rec["ckpt"] = ck

    def _write(self, rec: dict | None) -> None:
        """The step's metrics line and progress; an export after it (its line says where it went)."""
        self.log.advance()
        if rec is not None:
            self.last = rec
            self.log.write(rec)
        if self.exporting:
            self.export_hf(self.log)
        if rec is not None:  # the next window starts after this line (and its save, export)
            self.window_start, self.window_steps = time.perf_counter(), 0

    def _evaluate_if_due(self) -> None:
        every, steps = self.cfg.training.eval_every, self.cfg.training.steps
        if every and (self.step % every == 0 or self.step == steps):
            ev = self.evaluate()
            self.last = dict(self.last, eval_loss=ev)
            self.log.write({"step": self.step, "eval_loss": ev})
            self.log.message(f"step {self.step}: eval loss {ev:.4f}")

    def _finish(self) -> None:
        """The last background checkpoint write, committed and logged."""
        self.checkpointer.close()
        for done in self._saves_done():
            self.log.write({"step": done["step"], "ckpt": done})

    def _close(self) -> None:
        if hasattr(self, "log"):
            self.log.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if hasattr(self.par.optimizer, "close"):  # offload = "nvme": its scratch files go
            self.par.optimizer.close()

    def export_due(self) -> bool:
        """checkpoint.export_hf: "end" on the last step; N every N steps and on the last."""
        every, last = self.cfg.checkpoint.export_hf, self.step == self.cfg.training.steps
        return every == "end" and last or not isinstance(every, str) and (self.step % every == 0 or last)

    def export_hf(self, log: MetricsLog) -> None:
        """RUN_DIR/hf/step_N, a transformers directory, from the sharded checkpoint just written: rank 0
        streams it one tensor at a time (convert.to_hf), so no rank ever holds more than one full
        tensor and the layout's shards are never gathered. A directory already there (a resumed run
        exporting the same step again) is kept. Every rank learns whether it worked."""
        from .convert import to_hf
        self.checkpointer.wait()  # async: the checkpoint is committed
        world = self.ctx.comm("world")
        out = os.path.join(self.run_dir, "hf", f"step_{self.step:08d}")
        failed, t0 = 0.0, time.perf_counter()
        if self.ctx.rank == 0 and not os.path.isdir(out):
            try:
                os.makedirs(os.path.dirname(out), exist_ok=True)
                to_hf(os.path.join(self.checkpointer.root, f"step_{self.step:08d}"), out,
                      self.cfg.checkpoint.export_dtype)
            except (ValueError, OSError, ckpt.CheckpointError) as e:
                failed, error = 1.0, e
        if world.all_reduce_scalars([failed])[0]:
            if self.ctx.rank == 0:
                raise RuntimeError(f"checkpoint.export_hf: step {self.step}: {error}") from error
            raise RuntimeError(f"checkpoint.export_hf: step {self.step}: failed on rank 0")
        log.message(f"step {self.step}: exported {out} ({time.perf_counter() - t0:.1f} s)")

    def _check_finite(self, rec: dict | None, log: MetricsLog) -> None:
        """Stop on a non-finite loss or grad norm (train/fault.py); the step's metrics line is still
        written and a checkpoint still being written (async, checked before it was taken) is committed."""
        try:
            self.guard.check(self.saved_step)
        except fault.NonFiniteError:
            if rec is not None:
                log.write(rec)
            self.checkpointer.wait()
            raise

    def _time_split(self, rec: dict, comm_s: float, window_steps: int) -> None:
        """This rank's step split into the store; rank 0 names ranks slow for several logged steps."""
        rec["time_split"] = parts = split(rec["step_s"], comm_s, self.data_s / window_steps)
        self.data_s = 0.0
        if not self.stragglers.enabled:
            return
        self.stragglers.publish(self.step, parts)
        if self.ctx.is_logger:
            named = self.stragglers.judge(self.step, self.stragglers.gather(self.step))
            if named:
                rec["stragglers"] = named
            for s in named:
                if s["steps"] == self.stragglers.steps:  # once per slow spell
                    self.log.message(f"step {self.step}: {describe(s)}")

    def _saves_done(self) -> list[dict]:
        """Checkpoints committed since the last call (rank 0 measures their bytes)."""
        done, self.checkpointer.done = self.checkpointer.done, []
        return done

    def _record(self, out: dict, comms, window_start: float, window_steps: int, tokens_per_step: int) -> dict:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        step_s = (time.perf_counter() - window_start) / window_steps
        stats = merge_stats(comms)
        reset_stats(comms)
        tps = tokens_per_step / step_s
        mfu = self.flops_per_step / step_s / (self.peak_flops * self.ctx.world_size) if self.peak_flops else 0.0
        rec = {"step": self.step, "loss": self.global_loss(out["loss_sum"]), "grad_norm": float(out["norm"]),
               "lr": out["lr"], "tokens": self.step * tokens_per_step, "tokens_per_s": tps, "mfu": mfu,
               "step_s": step_s, "mem": out["mem"] or self.memory(), "peak_flops": self.peak_flops,
               "peak_label": self.peak_label, "world": self.ctx.world_size,
               "comm": {k: {"calls": s.calls / window_steps, "bytes": s.bytes / window_steps,
                            "seconds": s.seconds / window_steps} for k, s in stats.items()}}
        if self.ctx.device.type == "cpu":  # ranks share the cores: --calibrate prices that (docs/planner.md)
            rec["threads"] = torch.get_num_threads()
            rec["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            now, before = sched_seconds(), self._sched
            if now is not None and before is not None:  # on a core / waiting for one, per step
                rec["cpu_s"], rec["wait_s"] = ((a - b) / window_steps for a, b in zip(now, before))
            self._sched = now
        self._time_split(rec, sum(s.seconds for s in stats.values()) / window_steps, window_steps)
        if self.sampler.drawn() is not None:  # data.mix: tokens drawn per source so far
            rec["data"] = self.sampler.drawn()
        if self.par.moe is not None:
            rec["moe"] = self.par.moe.record(self.ctx.comm("world"), self.ctx.device)
        if self.par.pipeline is not None:  # measured bubble; rank 0 writes the step's Chrome trace
            path = os.path.join(self.run_dir, "pipeline_trace.json") if self.ctx.is_logger else None
            rec["bubble"] = self.par.pipeline.record(path, self.step)
        if bool(out["skipped"]):  # a device flag with fp16: read here, where the step has synced anyway
            rec["skipped"] = True
            if self.scaler.enabled:
                rec["loss_scale"] = float(self.scaler.scale)
        return rec

