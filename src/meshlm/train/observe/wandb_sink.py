"""metrics.wandb: every metrics.jsonl record and the resolved config, also sent to Weights & Biases.

wandb is an optional dependency (`pip install 'meshlm[wandb]'`); `check` refuses a run that asks for it
without the package before any worker starts. Only global rank 0 logs, as it alone writes metrics.jsonl.
`WANDB_MODE=offline` keeps the run under RUN_DIR/wandb/ for a later `wandb sync`.
"""
from __future__ import annotations

import os

from ...core.config import Config, ConfigError, to_dict


def check(cfg: Config) -> None:
    """One line, before any worker starts, when metrics.wandb is on and the package is missing."""
    if not cfg.metrics.wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("metrics.wandb: needs the `wandb` package (pip install 'meshlm[wandb]')") from None


def flatten(record: dict, prefix: str = "") -> dict:
    """A metrics line as W&B history keys: nested tables joined with '/' (`mem/peak`,
    `comm/all_reduce/bytes`); numbers, booleans and strings kept, lists (stragglers) left to the JSONL."""
    out = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
    return out


INIT_TIMEOUT_S = 300.0  # wandb's service process can take minutes to answer on a busy shared machine


class WandbSink:
    """A MetricsLog sink: `write` each record at its step, `close` at the end of the run."""

    def __init__(self, run_dir: str, cfg: Config):
        import wandb
        m = cfg.metrics
        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(project=m.wandb_project or None, entity=m.wandb_entity or None,
                              name=m.wandb_run or os.path.basename(os.path.abspath(run_dir)),
                              dir=run_dir, config=to_dict(cfg),
                              settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S))
        self.step = -1

    def write(self, record: dict) -> None:
        step = int(record.get("step", 0))
        if step < self.step:  # W&B history only moves forward: a rollback's replayed steps stay in the JSONL
            return
        self.step = step
        self.run.log({k: v for k, v in flatten(record).items() if k not in ("step", "time")}, step=step)

    def close(self) -> None:
        """finish() returns before wandb's service process has written the run's last records;
        teardown() waits for it, so the files are complete when training returns (and offline, a
        `wandb sync` right after sees every step)."""
        import wandb
        self.run.finish()
        wandb.teardown()
