"""Checkpoint cost and goodput in the planner (plan/cost/goodput.py): the Young/Daly interval and the
Llama 3 failure rate as the documented example."""
import json
import math

from meshlm.cli import main
from meshlm.plan.cost.goodput import LLAMA3_FAILURES_PER_GPU_HOUR, Resilience, goodput, save_seconds


def test_llama3_rate_gives_a_failure_every_three_hours():
    g = goodput(405 * 10 ** 9, 16384, 8, Resilience())
    assert abs(g["mtbf_h"] - 54 * 24 / 419) < 1e-9  # 16,384 GPUs: the job's own MTBF in the paper
    assert g["checkpoint_bytes"] == 12 * 405 * 10 ** 9
    assert math.isclose(g["interval_s"], math.sqrt(2 * g["save_s"] * g["mtbf_h"] * 3600))
    assert 0.85 < g["goodput"] < 0.97


def test_goodput_falls_with_failures_and_slow_storage():
    base = goodput(8 * 10 ** 9, 1024, 8, Resilience())
    worse = goodput(8 * 10 ** 9, 1024, 8, Resilience(failures_per_gpu_hour=10 * LLAMA3_FAILURES_PER_GPU_HOUR))
    slow = goodput(8 * 10 ** 9, 1024, 8, Resilience(storage_gbps=1.0, node_write_gbps=1.0))
    assert worse["goodput"] < base["goodput"] and slow["goodput"] < base["goodput"]
    assert goodput(8 * 10 ** 9, 1024, 8, Resilience(failures_per_gpu_hour=0))["goodput"] == 1.0
    # nodes write in parallel until the file system's bandwidth is the limit
    r = Resilience(node_write_gbps=5, storage_gbps=100)
    assert save_seconds(1e12, 8, 8, r) == 1e12 / 5e9 and save_seconds(1e12, 8 * 64, 8, r) == 1e12 / 100e9


def test_plan_reports_checkpoint_and_goodput(capsys):
    assert main(["plan", "--model", "small", "--gpus", "8", "--gpu", "h100", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint" in out and "goodput" in out and "Young/Daly" in out
    assert main(["plan", "--model", "small", "--gpus", "8", "--gpu", "h100", "--top", "2", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert all(0 < r["resilience"]["goodput"] <= 1 for r in ranked)
    assert main(["plan", "--model", "small", "--gpus", "8", "--gpu", "h100", "--storage-gbps", "0"]) == 2
    assert "--storage-gbps" in capsys.readouterr().err


def test_resize_beats_waiting_for_a_slow_spare():
    """A lost node: waiting for a spare costs its arrival time per failure, resizing costs a second
    restart and the missing node's share until it is back; the planner picks the better."""
    hot = goodput(8 * 10 ** 9, 1024, 8, Resilience())
    assert hot["policy"] == "wait" and hot["goodput"] == hot["goodput_wait"] > hot["goodput_resize"]
    slow = goodput(8 * 10 ** 9, 1024, 8, Resilience(spare_min=120))
    assert slow["policy"] == "resize" and slow["goodput"] == slow["goodput_resize"] > slow["goodput_wait"]
    assert slow["goodput_resize"] == hot["goodput_resize"]  # resizing never waits for the spare
    tau, mtbf = slow["interval_s"], slow["mtbf_h"] * 3600
    expect = 1 - slow["save_s"] / tau - (2 * (tau / 2 + 600) + 4 * 3600 * 8 / 1024) / mtbf
    assert math.isclose(slow["goodput_resize"], expect)
    assert goodput(8 * 10 ** 9, 8, 8, Resilience(spare_min=120))["policy"] == "wait"  # one node: no resize
