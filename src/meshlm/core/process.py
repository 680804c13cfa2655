"""How a meshlm process ends: the `meshlm` command, every worker, the benchmarks' children
(docs/fault_tolerance.md, "Exit status")."""
from __future__ import annotations

import gc
import sys
from typing import NoReturn


def freeze_for_exit() -> None:
    """Just before the process ends: collect what it made and dropped (its finalizers run), then freeze
    what is still alive, so that the interpreter's exit does not walk and free torch's and dynamo's
    objects one by one (0.9 CPU-s in a process that imported both; 0.3 with this). atexit handlers, the
    streams' flushes and C++ destructors run as before."""
    gc.collect()
    gc.freeze()


def exit_frozen(code: int | None = 0) -> NoReturn:
    """`sys.exit(code)` after `freeze_for_exit`."""
    freeze_for_exit()
    sys.exit(code)
