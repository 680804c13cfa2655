"""Pipeline schedules as data: textbook bubbles, peak memory, checker, CLI."""
import argparse
import json

import pytest

from meshlm.core.schedule import (Action, ScheduleError, add_p2p, build_schedule, check_schedule, p2p_batches, simulate,
                             textbook_bubble)
from meshlm.core.schedule import command as schedule_cmd
from meshlm.core.schedule.draw import render_png, render_text
from meshlm.core.schedule.p2p import STEER_COSTS
from meshlm.core.schedule.schedules import _interleaved_compute, _zb_h1_compute, _zbv_compute

UNIT = dict(cost_f=1.0, cost_b=1.0)          # F and B both cost 1
ZB = dict(cost_f=1.0, cost_b=2.0, cost_w=1.0)  # F = I = W = 1


def run(name, p, m, v=1, **costs):
    actions = build_schedule(name, p, m, v)
    check_schedule(actions, p, m, v)
    return simulate(actions, p, m, v, name=name, **costs)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 5)])
def test_gpipe_1f1b_bubble_is_textbook(name, p, m):
    tl = run(name, p, m, **UNIT)
    assert tl.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert tl.makespan == pytest.approx(2 * (m + p - 1))
    # unequal F/B keeps the same fraction for both
    assert run(name, p, m, cost_f=1.0, cost_b=2.0).bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4)])
def test_interleaved_bubble_is_textbook(p, m, v):
    tl = run("interleaved", p, m, v, **UNIT)
    assert tl.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert tl.bubble == pytest.approx(textbook_bubble("interleaved", p, m, v))


@pytest.mark.parametrize("p,m,ratio", [(4, 8, 11 / 27), (4, 16, 19 / 51), (8, 32, 39 / 103)])
def test_zb_h1_has_a_third_of_1f1b_bubble(p, m, ratio):
    zb, base = run("zb-h1", p, m, **ZB), run("1f1b", p, m, **ZB)
    # idle time per rank: (p-1)*(F+I-W) = p-1 against 1F1B's (p-1)*(F+B) = 3(p-1): exactly 1/3
    zb_idle = zb.makespan * p - sum(zb.busy)
    base_idle = base.makespan * p - sum(base.busy)
    assert zb_idle / base_idle == pytest.approx(1 / 3)
    # as fractions: (p-1)/(3m+p-1) vs (p-1)/(m+p-1); p=4, m=8 gives 0.1111 / 0.2727 = 0.407
    assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
    assert zb.bubble / base.bubble == pytest.approx(ratio)
    assert 0.25 <= zb.bubble / base.bubble <= 0.42
    assert zb.bubble == pytest.approx(textbook_bubble("zb-h1", p, m, 1, **ZB))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (4, 2)])
def test_peak_inflight(p, m):
    assert run("gpipe", p, m).peak_inflight == [m] * p
    one = run("1f1b", p, m).peak_inflight
    assert one == [min(p - r, m) for r in range(p)]
    if m >= p:
        assert one[0] == p
    # zb-h1 holds activations until W, and still never more than 1F1B's peak
    assert max(run("zb-h1", p, m).peak_inflight) <= max(one)


def test_every_built_schedule_passes_the_checker():
    for p in range(1, 6):
        for m in range(1, 10):
            for name in ("gpipe", "1f1b", "zb-h1"):
                check_schedule(build_schedule(name, p, m), p, m, 1)
            for v in (2, 3):
                if m % p == 0:
                    check_schedule(build_schedule("interleaved", p, m, v), p, m, v)


# ------------------------------------------------------------------ ZB-V (issue #17)

def test_zbv_v_placement():
    from meshlm.core.schedule.actions import local_target, message_of, stage_index, stage_owner
    assert [stage_index(r, c, 4, True) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(stage_owner(stage_index(r, c, 4, True), 4, True) == (r, c) for r in range(4) for c in (0, 1))
    # the V's turn (stage 3 -> 4) stays on rank 3 (no p2p); rank 0's chunk 1 is the loss stage
    assert message_of(Action("F", 0, 0), 3, 4, 2, True) is None
    assert local_target(Action("F", 0, 0), 3, 4, 2, True) == ("F", 1)
    assert local_target(Action("I", 0, 1), 3, 4, 2, True) == ("B", 0)
    assert message_of(Action("F", 0, 1), 0, 4, 2, True) is None and local_target(Action("F", 0, 1), 0, 4, 2, True) is None
    assert message_of(Action("F", 0, 1), 1, 4, 2, True) == ("F", 0, 1)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 32), (3, 7)])
def test_zbv_bubble_and_memory_against_1f1b_and_zb_h1(p, m):
    """Peak activations of 1F1B's first rank on every rank (one loss-stage micro-batch on rank 0);
    half of ZB-H1's warm-up idle when F = I = W (the closed form in textbook_bubble); p2p placement
    stalls nobody under rendezvous."""
    acts = build_schedule("zbv", p, m, 2)
    stats = check_schedule(acts, p, m, 2, vshape=True)
    assert stats["peak_activations"] == [float(p)] * p
    from meshlm.core.schedule.check import inflight_by_chunk
    assert inflight_by_chunk(acts)[0][1] == 1
    tl = simulate(acts, p, m, 2, vshape=True, **ZB)
    if p <= 4:  # beyond, running the loss stage's W early (one micro-batch of logits held) costs a little
        assert tl.bubble == pytest.approx(textbook_bubble("zbv", p, m, 2, **ZB), abs=1e-9)
    assert tl.bubble >= textbook_bubble("zbv", p, m, 2, **ZB) - 1e-9
    assert tl.bubble < run("zb-h1", p, m, **ZB).bubble < run("1f1b", p, m, **ZB).bubble
    assert simulate(acts, p, m, 2, vshape=True, p2p="blocking", **ZB).makespan == pytest.approx(tl.makespan)


def _held_and_deferred(acts, p):
    """Per rank, the peak of chunk activations held until W plus W's deferred past their I on stages
    other than 0 (each keeps its boundary gradients, parallel/dims/pipeline/backward.py)."""
    from meshlm.core.schedule.actions import stage_index
    peaks = []
    for r, row in enumerate(acts):
        held = deferred = peak = 0
        for a in row:
            if a.kind not in ("F", "I", "W"):
                continue
            later = stage_index(r, a.chunk, p, True) != 0
            held += {"F": 1, "I": 0, "W": -1}[a.kind]
            deferred += {"F": 0, "I": 1, "W": -1}[a.kind] if later else 0
            peak = max(peak, held + deferred)
        peaks.append(peak)
    return max(peaks)


@pytest.mark.parametrize("p,m,before,after", [(2, 4, 7, 6), (2, 8, 7, 6), (3, 7, 10, 9), (4, 8, 14, 14),
                                              (8, 32, 27, 22)])
def test_zbv_defers_fewest_weight_grads_at_the_same_bubble(p, m, before, after):
    """Of the list-scheduled orders, ZB-V keeps the one holding the fewest deferred W's without more
    simulated bubble (pp2 zbv in bench/peers.py: one W's captured gradients less at the peak)."""
    free, _ = _zbv_compute(p, m, STEER_COSTS)
    acts = build_schedule("zbv", p, m, 2)
    assert (_held_and_deferred(free, p), _held_and_deferred(acts, p)) == (before, after)
    unlimited = simulate(add_p2p(free, p, 2, vshape=True), p, m, 2, vshape=True, **ZB).bubble
    assert simulate(acts, p, m, 2, vshape=True, **ZB).bubble <= unlimited + 1e-9


def test_zbv_builds_and_checks_for_all_small_cases():
    for p in range(1, 6):
        for m in range(1, 10):
            check_schedule(build_schedule("zbv", p, m, 2), p, m, 2, vshape=True)
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        build_schedule("zbv", 4, 8, 3)
    # checked against the looping placement, the V's messages go to the wrong stages
    with pytest.raises(ScheduleError):
        check_schedule(build_schedule("zbv", 4, 8, 2), 4, 8, 2)


def test_zbv_cli_json(capsys):
    assert schedule_cmd.main(["--schedule", "zbv", "--pp", "4", "-m", "8", "--cost-b", "2", "--cost-w", "1",
                              "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["virtual"] == 2 and rep["peak_activations"] == [4.0] * 4
    assert rep["bubble"] == pytest.approx(rep["textbook_bubble"])


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (3, 6, 3)])
def test_eager_placement_is_also_repaired_to_deadlock_free(p, m, v):
    # SEND right after the producer / RECV right before the consumer deadlocks
    # interleaved 1F1B under rendezvous; add_p2p must repair it.
    check_schedule(add_p2p(_interleaved_compute(p, m, v), p, v, p2p_at="eager"), p, m, v)
    check_schedule(add_p2p(_zb_h1_compute(p, m), p, 1, p2p_at="eager"), p, m, 1)


def test_p2p_shape_of_1f1b():
    # rank 1 of 3: receive from 0 before each F, send to 2 after; grads the other way
    acts = build_schedule("1f1b", 3, 4)[1]
    assert acts[:3] == [Action("RECV_F", 0, 0, 0), Action("F", 0), Action("SEND_F", 0, 0, 2)]
    batches = [b for b in p2p_batches(acts) if isinstance(b, tuple)]
    assert (Action("SEND_F", 1, 0, 2), Action("RECV_B", 0, 0, 2)) in batches
    assert str(Action("F", 3, 1)) == "F3c1"


def test_placement_keeps_rendezvous_free_for_1f1b_and_zb():
    for name, p, m, costs in [("1f1b", 4, 8, UNIT), ("gpipe", 4, 8, UNIT), ("zb-h1", 4, 8, ZB)]:
        acts = build_schedule(name, p, m)
        free = simulate(acts, p, m, 1, **costs)
        blocking = simulate(acts, p, m, 1, p2p="blocking", **costs)
        assert blocking.makespan == pytest.approx(free.makespan)
    acts = build_schedule("interleaved", 4, 8, 2)
    assert simulate(acts, 4, 8, 2, p2p="blocking").makespan >= simulate(acts, 4, 8, 2).makespan - 1e-9


# ------------------------------------------------------------------ checker rejects


def test_checker_rejects_missing_backward():
    acts = build_schedule("1f1b", 2, 2)
    acts[0] = [a for a in acts[0] if a != Action("B", 1)]
    with pytest.raises(ScheduleError, match="needs one B"):
        check_schedule(acts, 2, 2, 1)


def test_checker_rejects_deadlock():
    # rank 0 waits for the grad of mb 0 before it has sent mb 0's activation
    acts = [[Action("F", 0), Action("RECV_B", 0, 0, 1), Action("B", 0), Action("SEND_F", 0, 0, 1)],
            [Action("RECV_F", 0, 0, 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0, 0, 0)]]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 blocked at action #1 RECV_B0<1"):
        check_schedule(acts, 2, 1, 1)


def test_checker_rejects_swapped_recvs():
    acts = build_schedule("gpipe", 2, 3)
    row = acts[1]
    i, j = row.index(Action("RECV_F", 0, 0, 0)), row.index(Action("RECV_F", 1, 0, 0))
    row[i], row[j] = row[j], row[i]   # F0 would now run before its input arrived
    with pytest.raises(ScheduleError, match="no RECV_F"):
        check_schedule(acts, 2, 3, 1)


def test_checker_rejects_mismatched_channel_order():
    # rank 0 sends F1 before F0 while rank 1 receives F0 first: NCCL would
    # hand F1's activation to F0, so the checker must refuse it
    acts = build_schedule("gpipe", 2, 3)
    row = acts[0]
    row.remove(Action("SEND_F", 0, 0, 1))
    row.insert(row.index(Action("SEND_F", 1, 0, 1)) + 1, Action("SEND_F", 0, 0, 1))
    with pytest.raises(ScheduleError, match="different tensor"):
        check_schedule(acts, 2, 3, 1)


@pytest.mark.parametrize("mutate,msg", [
    (lambda a: a[0].insert(0, Action("B", 0)), "backward before its forward"),
    (lambda a: a[0].insert(0, Action("W", 0)), "W before its I"),
    (lambda a: a[0].append(Action("F", 0)), "duplicate F"),
])
def test_checker_rejects_misordered(mutate, msg):
    acts = build_schedule("zb-h1", 2, 2)
    mutate(acts)
    with pytest.raises(ScheduleError, match=msg):
        check_schedule(acts, 2, 2, 1)


@pytest.mark.parametrize("args,msg", [
    (("nope", 2, 4), "unknown schedule"),
    (("1f1b", 0, 4), "p \\(pipeline ranks\\)"),
    (("1f1b", 2, 0), "m \\(micro-batches\\)"),
    (("1f1b", 2, 4, 2), "one chunk per rank"),
    (("interleaved", 4, 6, 2), "not a multiple of p=4"),
    (("interleaved", 4, 8, 1), "v >= 2"),
])
def test_build_schedule_rejects_bad_input(args, msg):
    with pytest.raises(ValueError, match=msg):
        build_schedule(*args)


# ------------------------------------------------------------------ drawing and CLI


def test_render_text_rows_and_legend():
    tl = run("1f1b", 2, 3, **UNIT)
    text = render_text(tl)
    lines = text.splitlines()
    assert lines[2].startswith("rank 0 |[F0][F1]") and lines[3].startswith("rank 1 |....[F0][B0]")
    assert "idle" in text and f"{tl.bubble:.1%}" in text
    assert len(render_text(tl, width=30).splitlines()[2]) <= len("rank 0 |") + 31


def _cli(argv):
    parser = argparse.ArgumentParser(prog="meshlm")
    schedule_cmd.add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["schedule", *argv])
    return args.func(args)


def test_cli_json(capsys):
    assert _cli(["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--virtual", "2",
                 "--cost-b", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("bubble", "peak_inflight", "makespan", "schedule", "pp", "microbatches", "virtual"):
        assert key in out
    assert out["bubble"] == pytest.approx(3 / 19) and len(out["peak_inflight"]) == 4
    assert (out["schedule"], out["pp"], out["microbatches"], out["virtual"]) == ("interleaved", 4, 8, 2)


def test_cli_text_and_png(tmp_path, capsys):
    png = tmp_path / "tl.png"
    assert _cli(["--pp", "2", "--microbatches", "4", "--schedule", "zb-h1", "--cost-w", "1",
                 "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 1 |" in out and "textbook bubble" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_input_returns_2(capsys):
    assert schedule_cmd.main(["--pp", "4", "--microbatches", "6", "--schedule", "interleaved"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "multiple" in err


def test_render_png_direct(tmp_path):
    path = tmp_path / "x.png"
    render_png(run("interleaved", 2, 4, 2), path)
    assert path.stat().st_size > 0
