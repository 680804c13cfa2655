"""`MESHLM_PLUGINS=module[,module...]`: code that runs inside every worker around its Trainer
(instrumentation, custom metrics, fault injection). Each module is imported before the Trainer is
built and its `install(trainer)` is called once the Trainer is; it may wrap `trainer.runner` (a
StepRunner, parallel/step.py) or `trainer.data`, set `trainer.checkpointer.on_written`, read
`trainer.state`. The variable is in the environment, so torchrun's workers and their restarts see it."""
from __future__ import annotations

import importlib
import os

VARIABLE = "MESHLM_PLUGINS"


def load() -> list:
    """The plugin modules named by MESHLM_PLUGINS, imported; a clear error for a bad name."""
    out = []
    for name in (n.strip() for n in os.environ.get(VARIABLE, "").split(",")):
        if not name:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise RuntimeError(f"{VARIABLE}: cannot import {name} ({e})") from e
        if not callable(getattr(module, "install", None)):
            raise RuntimeError(f"{VARIABLE}: {name} has no install(trainer) function")
        out.append(module)
    return out
