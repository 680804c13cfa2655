"""The test harness itself: pool workers must not accumulate gloo groups (tests/harness.py)."""
from __future__ import annotations

import os

from harness import make_config, run_layout


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_pool_workers_do_not_accumulate_group_threads(pools):
    # dp2 x tp2: groups of 2 out of 4 ranks along each dimension (a group of one or of the world is
    # never built, so a 2-rank case would prove nothing)
    cfg = make_config(parallel__dp=2, parallel__tp=2, training__steps=2)
    run_layout(pools, cfg, 4)
    after_one = pools(4).run(_threads)
    for _ in range(3):
        run_layout(pools, cfg, 4)
    after_four = pools(4).run(_threads)
    # each case builds 4 groups per rank (3 gloo threads each): kept, three more cases add 36 threads.
    # Dropped, one group's threads per case still stay (3 per case, not found which holds it: see
    # tests/harness.py _drop_sub_groups), so the bound is 3 per case.
    assert all(b - a <= 9 for a, b in zip(after_one, after_four)), (after_one, after_four)
