"""Pipeline parallelism: schedules as data, their checker, simulator and drawer.

Pure Python (no torch.distributed): a runtime executes the per-rank
`Action` lists from `build_schedule` following the p2p rules in p2p.py.
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
