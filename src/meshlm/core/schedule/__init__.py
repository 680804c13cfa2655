"""Pipeline schedules as data (pure Python, no torch): per-rank `Action` lists, their checker,
simulator and drawer, and the stage split. The planner, `layout` and `meshlm schedule` read them; the
torch side lives in parallel/dims/pipeline/ (runtime.py executes the lists, build.py cuts the model).
"""
from .actions import Action, ScheduleError, stage_index, stage_owner
from .check import check_schedule
from .p2p import add_p2p
from .replay import p2p_batches
from .schedules import SCHEDULES, build_schedule, gpipe, interleaved, one_f_one_b, zb_h1
from .simulate import Timeline, simulate, textbook_bubble

__all__ = [
    "Action", "ScheduleError", "stage_index", "stage_owner", "check_schedule", "add_p2p", "p2p_batches",
    "SCHEDULES", "build_schedule", "gpipe", "interleaved", "one_f_one_b", "zb_h1",
    "Timeline", "simulate", "textbook_bubble",
]
