"""Pipeline parallelism: schedules as data, their checker, simulator and drawer.

What this package exports is pure Python (no torch.distributed), and so is stage.py (the stage
split). The torch side is imported only where needed: build.py cuts the model and attaches
runtime.py, which executes the per-rank `Action` lists from `build_schedule` following the p2p
rules in p2p.py (backward.py: the zero-bubble I/W split; trace.py: measured timelines).
"""
from .actions import Action, ScheduleError, stage_index, stage_owner
from .check import check_schedule
from .p2p import add_p2p, p2p_batches
from .schedules import SCHEDULES, build_schedule, gpipe, interleaved, one_f_one_b, zb_h1
from .simulate import Timeline, simulate, textbook_bubble

__all__ = [
    "Action", "ScheduleError", "stage_index", "stage_owner", "check_schedule", "add_p2p", "p2p_batches",
    "SCHEDULES", "build_schedule", "gpipe", "interleaved", "one_f_one_b", "zb_h1",
    "Timeline", "simulate", "textbook_bubble",
]
