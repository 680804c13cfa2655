"""The entry of a training process (docs/architecture.md, "The two buildings"): what `meshlm train`
settles and checks before any worker starts, so that bad input is one line and exit
2 with nothing written: the config and its overrides, the world and whether this process trains, the
layout for the device that trains, then every input the run will read or write (Hugging Face weights,
data shards, W&B, offload directories, the checkpoint it resumes and the room for the ones it writes)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from .core import config as C
from .core import cards
from .core.layout import Layout


@dataclass
class Start:
    """A run that passed its checks: what `cmd_train` writes, prints and launches."""
    cfg: C.Config
    layout: Layout
    world: int
    worker: bool  # started by a launcher (torchrun, Slurm, meshlm's own --nproc)
    restarts: int | None  # the job's agreed restart count, once the world group formed
    run_dir: str
    overrides: list  # the command line's --section.key pairs
    asked_attn: str  # model.attn_impl as given, before "auto" resolved
    auto_record: dict | None = None  # parallel.auto / elastic replan: the planner's choice (plan/search/auto.py)


def settle(config_path: str | None, extra: list[str], nproc: int | None, max_restarts: int, worker_flag: bool,
           run_dir: str | None) -> Start:
    """The resolved run, or a ValueError / RuntimeError whose message is the one line to print."""
    from .core.config.model import model_args, pin_model_shape
    from .model.fp8_kernels import check_fp8_device
    from .plan.search.auto import layout_for_run
    from .distributed.link import job_world
    from .distributed.mesh import device_defaults
    from .train.launch import under_launcher

    pairs, rest = C.parse_overrides(extra)
    if rest:
        raise C.ConfigError(f"unrecognised argument: {rest[0]}")
    cfg = C.load(config_path, pairs)
    settle_anneal(cfg, pairs, run_dir)  # optim.anneal_steps: the run's end and decay from the checkpoint
    asked_attn = cfg.model.attn_impl
    device_defaults(cfg)  # training.precision / compile "auto": this machine's values, into config.toml
    pin_model_shape(cfg)  # model.init_from: the HF model's shape goes into config.toml
    worker = worker_flag or under_launcher()
    world = job_world() if worker else (nproc or 1)  # island jobs: the islands' ranks together
    if worker and nproc:
        raise C.ConfigError("--nproc: leave it out under torchrun or Slurm (the launcher starts the workers)")
    if max_restarts < 0:
        raise C.ConfigError(f"--max-restarts: must be >= 0, got {max_restarts}")
    if worker and max_restarts and not worker_flag:
        raise C.ConfigError("--max-restarts: under torchrun pass torchrun's own --max-restarts")
    _check_island_jobs(cfg, worker)
    restarts, gpu = None, None
    if worker or not (world > 1 or max_restarts):  # this process trains: its layout is final
        from .distributed.mesh import join_world, pick_device
        device = pick_device(cfg.training.device)
        gpu = device_profile(device)  # auto / replan choose for the device that trains
        if worker:  # the world group forms and agrees on the job's restart count before the layout
            restarts = join_world(device, cfg.parallel.timeout_s)  # (docs/fault_tolerance.md, "Growing back")
    layout, record = layout_for_run(cfg, world, gpu, restarts=restarts or 0)
    check_fp8_device(cfg.training, model_args(cfg).moe)  # what this device's torch can run (docs/fp8.md)
    run_dir = run_dir or os.path.join("runs", f"{cfg.model.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_inputs(cfg, layout, int(os.environ.get("LOCAL_WORLD_SIZE", world)) if worker else world, run_dir,
                 restarts or 0)
    check_energy(cfg, world, gpu, run_dir)
    return Start(cfg, layout, world, worker, restarts, run_dir, pairs, asked_attn, record)


def pick_layout(cfg: C.Config, world: int, device, restarts: int = 0, run_dir: str | None = None) -> Layout:
    """The layout of a process that resolves its own (trainer.py `start`'s `pick`, the tests' harness):
    `layout_for_run` for this torch device's profile, its choice logged into `run_dir` by rank 0."""
    from .distributed.mesh import device_defaults
    from .plan.search.auto import layout_for_run, log_choice
    device_defaults(cfg)  # as `settle`: "auto" device keys for this device first
    layout, record = layout_for_run(cfg, world, device_profile(device), restarts)
    if record and run_dir and int(os.environ.get("RANK", "0")) == 0:
        log_choice(record, run_dir)
    return layout


def device_profile(device):
    """The planner's GPU profile of the torch device this process trains on (parallel.auto), or None
    for a CPU or an unknown GPU (plan/search/auto.py then uses its CPU profile)."""
    if device.type != "cuda":
        return None
    import torch
    from .plan.hardware import get_gpu
    card = cards.device_card(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    return get_gpu(card) if card else None


def settle_anneal(cfg: C.Config, pairs: list, run_dir: str | None) -> None:
    """optim.anneal_steps N with checkpoint.resume PATH (docs/training.md, "Annealing"): the run goes on
    from the checkpoint's step S to S + N (training.steps is derived: a --training.steps that disagrees is
    refused), as a WSD schedule whose decay is those N steps, so the rate stays a function of the step and
    the config alone (a restart of the anneal keeps it). Its own run directory: never the source's."""
    o = cfg.optim
    if not o.anneal_steps:
        return
    from .train.checkpoint import find_resume
    C.check_schedule(o, cfg)  # a resume path, a flat schedule
    path = find_resume("", cfg.checkpoint.resume)
    try:
        with open(os.path.join(path, "meta.json")) as f:
            step = int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise C.ConfigError(f"checkpoint.resume: cannot read the step of {path}/meta.json ({e})") from None
    if step < o.warmup:
        raise C.ConfigError(f"optim.anneal_steps: the checkpoint's step {step} is inside the warmup "
                            f"(optim.warmup {o.warmup}): anneal a checkpoint of the stable phase")
    end = step + o.anneal_steps
    asked = [v for k, v in pairs if k == "training.steps"]
    if asked and int(asked[-1]) != end:
        raise C.ConfigError(f"training.steps: the anneal ends at step {end} (checkpoint step {step} + "
                            f"optim.anneal_steps {o.anneal_steps}), not {asked[-1]}; leave training.steps out")
    source = os.path.dirname(os.path.dirname(os.path.abspath(path)))  # RUN/checkpoints/step_N
    if run_dir and os.path.abspath(run_dir) == source:
        raise C.ConfigError(f"--run-dir: an anneal writes a run directory of its own, not the source run's "
                            f"{run_dir}")
    cfg.training.steps = end
    cfg.optim.schedule, cfg.optim.decay_steps = "wsd", float(o.anneal_steps)


def check_inputs(cfg: C.Config, layout: Layout, local_world: int, run_dir: str, restarts: int) -> None:
    """Everything outside the config the run will read or write, each check its owner's."""
    from .core.config.model import model_args
    from .parallel.optim.nvme import preflight as offload_preflight
    from .train.checkpoint import check_room
    from .train.checkpoint import preflight as resume_preflight
    from .train.observe.wandb_sink import check as check_wandb

    check_init_weights(cfg)
    cfg.data.check_files()
    check_wandb(cfg)
    offload_preflight(cfg.parallel, layout, local_world, model_args(cfg).num_params())
    resume_preflight(cfg, run_dir, restarts)
    check_room(cfg, run_dir)


def check_energy(cfg: C.Config, world: int, gpu, run_dir: str) -> None:
    """training.energy.trace (docs/energy.md, "Scheduling in time"): a trace that cannot be read, that
    does not cover the run, or a deadline the run cannot meet even running throughout, refused here.
    The run's length: the measured step time of the run it resumes (metrics.jsonl), else the planner's
    for the device that trains (the parent of local workers asks torch which one that is)."""
    if not cfg.training.energy.trace:
        return
    from .core.facts.energy_trace import schedule_for
    from .plan.search.auto import predicted_step_s
    done, step_s = measured_step(run_dir) if cfg.checkpoint.resume != "never" else (0, None)
    if step_s is None:
        if gpu is None and cfg.training.device != "cpu":
            from .distributed.mesh import pick_device
            gpu = device_profile(pick_device(cfg.training.device))
        step_s = predicted_step_s(cfg, world, gpu)
    schedule_for(cfg.training.energy, time.time(), step_s, max(cfg.training.steps - done, 0))


def measured_step(run_dir: str) -> tuple[int, float | None]:
    """(the last step logged, the median step_s of the last lines) of a run directory, (0, None) if none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0, None
    with open(path) as f:
        recs = [r for r in (json.loads(line) for line in f if '"step_s"' in line) if r.get("step_s")]
    if not recs:
        return 0, None
    times = sorted(r["step_s"] for r in recs[-16:])
    return int(recs[-1]["step"]), times[len(times) // 2]


def check_init_weights(cfg: C.Config) -> None:
    """model.init_from: Hugging Face weights that do not match their config.json (headers only),
    refused before workers start."""
    if cfg.model.init_from:
        from .core.config.model import model_args
        from .model.hf import HFWeights
        try:
            HFWeights(cfg.model.init_from[3:]).check(model_args(cfg))
        except ValueError as e:
            raise C.ConfigError(f"model.init_from: {e}") from None


def write_config(start: Start, config_path: str | None) -> None:
    """The resolved config as `run_dir/config.toml` (what workers and resumes read), unless the run was
    started from that very file with no overrides."""
    resolved = os.path.join(start.run_dir, "config.toml")
    os.makedirs(start.run_dir, exist_ok=True)
    if config_path and os.path.abspath(config_path) == os.path.abspath(resolved) and not start.overrides:
        return
    with open(resolved, "w") as f:
        rec = start.auto_record  # parallel.auto: the planner's pick (this process's view)
        if rec:
            f.write(f"# parallel.auto chose {rec['auto_layout']} (predicted {rec['predicted_step_s']:.3g} s/step, "
                    f"MFU {rec['predicted_mfu']:.1%} on {rec['gpu']}); the trainer re-plans on its device\n")
        f.write(C.to_toml(start.cfg))



def _check_island_jobs(cfg: C.Config, worker: bool) -> None:
    """training.outer.on_island_loss = "continue" runs one job per island, which meshlm's launcher starts
    (train/island_jobs.py): under an outside torchrun or Slurm job the islands would be one job."""
    from .distributed.link import island_job
    if cfg.training.outer.on_island_loss != "continue":
        return
    if cfg.parallel.islands < 2:
        raise C.ConfigError("training.outer.on_island_loss: continue needs parallel.islands > 1")
    if worker and island_job() is None:
        raise C.ConfigError("training.outer.on_island_loss: continue runs one job per island: start it with "
                            "meshlm's launcher (meshlm train --nproc N), not under torchrun or Slurm")


def link_server_config(config_path: str | None, extra: list[str]) -> C.Config:
    """The config `meshlm train --link-server` serves: island jobs (on_island_loss = continue), checked."""
    pairs, rest = C.parse_overrides(extra)
    if rest:
        raise C.ConfigError(f"unrecognised argument: {rest[0]}")
    cfg = C.load(config_path, pairs)
    if cfg.training.outer.on_island_loss != "continue" or cfg.parallel.islands < 2:
        raise C.ConfigError("--link-server: serves island jobs: set parallel.islands > 1 and "
                            "training.outer.on_island_loss = continue")
    return cfg
