"""DiLoCo islands in the planner (plan/cost/islands.py, docs/diloco.md "The planner"): the cross-island bytes, the
smallest H that hides the outer sync, the delay that covers one; `meshlm estimate` / `plan` with `--islands`;
the payoff bench's smoke run."""
import os
import tempfile

import pytest

from meshlm.core import config as C
from harness import build_layout
from meshlm.plan.cost.islands import bytes_per_step


def test_planner_traffic_and_the_smallest_hiding_h():
    from meshlm.plan.cost.islands import (
        fragment_sizes,
        outer_plan,
        outer_sync_bytes,
        sync_seconds,
    )
    n = 10_000_000
    assert bytes_per_step([n], 2, 50, "none") * 50 == outer_sync_bytes(n, 2, "none") == 8 * n  # DP's all-reduce of n
    assert bytes_per_step(fragment_sizes(n, 4), 2, 50, "int8") <= 8 * n / (2 * 50)
    assert bytes_per_step(fragment_sizes(n, 4), 2, 50, "bf16") == 8 * n / (2 * 50)
    p = outer_plan(n, 2, step_s=0.5, link_gbps=0.1, latency_ms=30, quantize="none")
    assert p.hidden and sync_seconds(n // p.fragments, 2, "none", 0.1, 30) <= 0.5 * p.sync_every / p.fragments
    smaller = p.sync_every // 2
    assert all(sync_seconds(max(fragment_sizes(n, k)), 2, "none", 0.1, 30) > 0.5 * smaller / k
               for k in (1, 2, 4, 8, 16) if k <= smaller)
    # training.outer.delay: the τ that covers a sync, and the step then (compute alone when the link keeps up)
    from meshlm.plan.cost.islands import overlapped
    assert overlapped(1.0, 0.5, 8, 1) == {"delay": 2, "delayed_step_s": 0.5}
    assert overlapped(1.0, 0.5, 8, 8) == {"delay": 2, "delayed_step_s": 1.0}  # a sync every step: the link's pace
    assert overlapped(10.0, 0.5, 8, 1) == {"delay": 7, "delayed_step_s": 0.5 + 6.5 / 8}  # τ ≤ H − 1: it waits


def test_meshlm_estimate_prints_the_islands_lines(capsys):
    from meshlm.cli import main
    code = main(["estimate", "--gpu", "h100", "--gpus", "16", "--model.preset", "llama3-8b", "--islands", "2",
                 "--link-gbps", "1.25", "--link-latency-ms", "50", "--training.global_batch", "64",
                 "--training.micro_batch", "2", "--training.outer.sync_every", "32"])
    out = capsys.readouterr().out
    assert code == 0 and "islands: 2; the outer sync moves" in out and "(H 32, 1 fragment(s), none)" in out
    assert "as synchronous DP over the link" in out and "the smallest H that" in out
    assert "with training.outer.delay = " in out and "(each sync overlapped with the next inner steps)" in out
    assert main(["estimate", "--gpu", "h100", "--gpus", "16", "--islands", "3"]) == 2
    assert capsys.readouterr().err.strip() == "meshlm: --islands: must be >= 1 and divide --gpus 16, got 3"


@pytest.mark.slow
def test_payoff_bench_smoke():
    """bench/diloco.py end to end on a few steps: DiLoCo's cross-island bytes are 1/H of synchronous DP's."""
    from test_bench import run_json
    out = run_json("bench/diloco.py", "--json", "--steps", "8", "--eval-every", "4", "--batch", "4", "--rows", "sync",
                   "h8", "--png", os.path.join(tempfile.mkdtemp(), "d.png"))
    sync, h8 = out["rows"]
    assert (sync["row"], h8["row"]) == ("sync", "h8") and 0.12 < h8["bytes_vs_sync"] <= 0.125
    assert os.path.isfile(out["png"]) and len(out["rows"]) == 2


def test_meshlm_plan_with_islands_searches_one_island_and_emits_a_config_for_the_job(tmp_path, capsys):
    from meshlm.cli import main
    path = tmp_path / "islands.toml"
    assert main(["plan", "--gpu", "h100", "--gpus", "32", "--model", "llama3-1b", "--islands", "4", "--top", "1",
                 "--link-gbps", "1", "--emit-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "islands: 4; the outer sync moves" in out and "the smallest H that" in out
    cfg = C.load(str(path))
    lay = build_layout(cfg, 32)
    assert (cfg.parallel.islands, lay.islands, lay.world_size) == (4, 4, 32)
    assert lay.global_batch * cfg.data.seq_len == 2 ** 22  # the job's tokens per step, over the four islands
