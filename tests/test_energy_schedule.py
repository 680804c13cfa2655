"""Scheduling in time (docs/energy.md, "Scheduling in time"; issue #63 item 4): the trace and its
schedule (core/facts/energy_trace.py), the training.energy section, the run that checkpoints and pauses
outside the cheap windows with every loss equal to an uninterrupted run's (one process and dp2 ZeRO-3),
a job killed while paused, bad input refused in one line, and `meshlm estimate`'s print.

A run's trace is cheap for the hour around now until the fault plugin (MESHLM_TEST_DEAR_AT) rewrites it
as checkpoint DEAR_STEP is written: expensive for DEAR_S seconds from then, cheap after. The run reads
the changed file at its plan of that step and pauses through the expensive window: the pause is placed
by an event, so a loaded machine's slow steps cannot move it."""
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest

from fault_plugin import plugin_env
from harness import TINY, assert_same_losses, make_config, reference, train_hooked, train_in
from meshlm.core import config as C
from meshlm.core.facts.energy_trace import parse_trace, plan

DEAR_STEP, DEAR_S = 2, 2.0
CASE = dict(training__steps=6, checkpoint__every=DEAR_STEP)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def write_trace(path, rows, kind="price") -> str:
    with open(path, "w") as f:
        f.write(f"time,{kind}\n" + "".join(f"{iso(t)},{v}\n" for t, v in rows))
    return str(path)


def cheap_hour(tmp_path) -> str:
    now = time.time()
    return write_trace(tmp_path / "trace.csv", [(now - 3600, 10), (now + 3600, 10)])


def dear_env(trace: str, seconds: float = DEAR_S) -> dict:
    return {"MESHLM_TEST_DEAR_AT": f"{DEAR_STEP}:{seconds}:{trace}"}


# -- the facts -------------------------------------------------------------------------------------
HOURLY = "time,price\n2024-01-01T00:00:00+01:00,0.10\n2024-01-01T01:00:00+01:00,0.50\n2024-01-01T02:00:00+01:00,0.05\n"


def test_windows_hold_until_the_next_row_and_the_last_as_long_as_the_one_before():
    tr = parse_trace(HOURLY, "t.csv")
    assert tr.kind == "price" and [w.value for w in tr.windows] == [0.10, 0.50, 0.05]
    assert [w.end - w.start for w in tr.windows] == [3600, 3600, 3600]
    assert tr.start == datetime(2023, 12, 31, 23, tzinfo=timezone.utc).timestamp()


def test_cheapest_spans_that_finish_by_the_deadline():
    tr = parse_trace(HOURLY, "t.csv")
    s = plan(tr, tr.start, 60.0, 90)  # 1.5 h of 3: the cheapest hour, then half of the next cheapest (its earlier half)
    assert [(a - tr.start, b - tr.start, n) for a, b, n in s.spans] == [(0, 1800, 30), (7200, 10800, 60)]
    assert s.cost == pytest.approx(0.5 * 0.10 + 0.05) and s.cost_now == pytest.approx(0.10 + 0.5 * 0.50)
    tight = plan(tr, tr.start, 60.0, 90, deadline=tr.start + 5400)  # no room to choose: run throughout
    assert [(a - tr.start, b - tr.start) for a, b, _ in tight.spans] == [(0, 5400)] and tight.saving == 0
    with pytest.raises(C.ConfigError, match=r"^training.energy.deadline: cannot be met even running throughout"):
        plan(tr, tr.start, 60.0, 90, deadline=tr.start + 5000)
    with pytest.raises(C.ConfigError, match=r"^training.energy.trace: does not cover the run"):
        plan(tr, tr.start - 60, 60.0, 10)
    with pytest.raises(C.ConfigError, match=r"^training.energy.trace: does not cover the run"):
        plan(tr, tr.start, 60.0, 200)  # no deadline: the trace's end is the latest the run may end


@pytest.mark.parametrize("text,line", [
    ("", "row 1: expected the header time,price or time,carbon, got nothing"),
    ("time,price\n2024-01-01T00:00:00,1\n", "row 2: '2024-01-01T00:00:00' has no zone"),
    ("time,price\n2024-01-01T00:00:00Z,1\nsoon,2\n", "row 3: not an ISO 8601 time: 'soon'"),
    ("time,carbon\n2024-01-01T00:00:00Z,1\n2024-01-01T01:00:00Z,-3\n", "row 3: carbon must be a finite number >= 0"),
    ("time,price\n2024-01-01T01:00:00Z,1\n2024-01-01T00:00:00Z,2\n", "row 3: times must increase"),
    ("time,price\n2024-01-01T00:00:00Z,1\n", "needs at least two rows"),
])
def test_a_bad_trace_is_one_line_naming_the_row(text, line):
    with pytest.raises(C.ConfigError) as e:
        parse_trace(text, "t.csv")
    assert str(e.value).startswith(f"training.energy.trace: t.csv: {line}") and "\n" not in str(e.value)


def test_energy_section_keys_toml_and_overrides(tmp_path):
    cfg = make_config(training__energy__trace="p.csv", training__energy__deadline="2030-01-01T00:00:00Z",
                      training__energy__clocks="1.0,0.85")
    assert cfg.training.energy.clocks == [1.0, 0.85]
    path = tmp_path / "c.toml"
    path.write_text(C.to_toml(cfg))
    assert C.load(str(path)).training.energy == cfg.training.energy
    for key, value, line in [("clocks", "1.0,1.5", "training.energy.clocks: each stage's clock is a fraction"),
                             ("deadline", "2030-01-01T00:00:00", "training.energy.deadline: '2030-01-01T00:00:00' has no zone")]:
        with pytest.raises(C.ConfigError, match="^" + line):
            make_config(**{f"training__energy__{key}": value, "training__energy__trace": "p.csv"}).check()
    with pytest.raises(C.ConfigError, match="^training.energy.deadline: needs training.energy.trace"):
        make_config(training__energy__deadline="2030-01-01T00:00:00Z").check()


# -- the run ---------------------------------------------------------------------------------------
def paused_run(pools, tmp_path, world: int, **extra) -> list[dict]:
    trace, run = cheap_hour(tmp_path), str(tmp_path / "run")
    return train_hooked(pools, make_config(**CASE, **extra, training__energy__trace=trace), world, run, dear_env(trace))


def assert_paused_through(lines: list[dict], ref: list[dict]) -> None:
    losses = [r for r in lines if "loss" in r]
    assert [(r["step"], r["loss"]) for r in losses] == [(r["step"], r["loss"]) for r in ref]  # exactly
    pauses = [r for r in lines if "pause" in r]
    assert [r["step"] for r in pauses] == [DEAR_STEP], pauses
    p = pauses[0]["pause"]
    # the pause spans only the expensive window and ends where the cheap one starts (its length is what is left
    # of the window after the checkpoint: less under load)
    assert 0 < p["end"] - p["start"] <= DEAR_S and p["prices"] == [100] and p["resume_price"] == 10
    assert p["ckpt"]["step"] == DEAR_STEP  # committed before the wait
    resumed = [r for r in lines if "resumed" in r]
    assert len(resumed) == 1 and resumed[0]["resumed"]["time"] >= p["end"] - 0.01
    windows = [r["energy_window"] for r in lines if "energy_window" in r]
    assert [w["price"] for w in windows] == [10, 10]  # before the pause (the first trace), after it (the second)
    assert sum(w["ran_s"] for w in windows) > 0 and all((w["cost"] is None) == (w["energy_j"] is None) for w in windows)


def test_one_process_pauses_through_the_expensive_window(pools, tmp_path):
    assert_paused_through(paused_run(pools, tmp_path, 1), reference(**CASE))


@pytest.mark.fast
def test_dp2_zero3_pauses_through_the_expensive_window(pools, tmp_path):
    """Equal bit for bit to the same layout run through (and within 1e-5 of one process, invariant 1)."""
    layout = dict(parallel__dp=2, parallel__zero=3)
    through = train_in(pools, make_config(**CASE, **layout), 2, str(tmp_path / "through"))
    lines = paused_run(pools, tmp_path, 2, **layout)
    assert_paused_through(lines, through)
    assert_same_losses(reference(**CASE), [r for r in lines if "loss" in r], 1e-5)


def cli_args(run: str, trace: str, *extra: str, steps: int = CASE["training__steps"]) -> list[str]:
    return ["train", "--run-dir", run, "--model.preset", "debug", "--model.n_layers", str(TINY["model.n_layers"]),
            "--data.seq_len", "32", "--training.steps",
            str(steps), "--training.global_batch", "8", "--training.micro_batch", "2",
            "--metrics.progress", "false", "--training.seed", "1", "--training.eval_every", "0",
            "--optim.warmup", "2", "--optim.lr", "3e-3", "--training.peak_tflops", "1.0",
            "--training.precision", "fp32", "--training.compile", "false", "--training.device", "cpu",
            "--training.energy.trace", trace, *extra]


def kill_while_paused(args: list[str], trace: str, run: str, pause_s: float) -> dict:
    """Start `meshlm train args` with the trace turning expensive for `pause_s` at DEAR_STEP; SIGKILL its
    process group once metrics.jsonl shows the pause. The pause's line."""
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", *args], env={**os.environ, **plugin_env(**dear_env(trace, pause_s))},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = time.time() + 300
    while not (os.path.isfile(metrics) and '"pause"' in open(metrics).read()):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # paused: the checkpoint of the pause's start is committed
    proc.wait()
    return [json.loads(x) for x in open(metrics) if '"pause"' in x][0]


@pytest.mark.slow  # three starts of `meshlm train` (one of two workers)
def test_killed_while_paused_on_two_ranks_resumes_on_one(tmp_path, capsys):
    """The elastic path (docs/fault_tolerance.md): a dp2 job killed in its pause goes on from the pause's
    checkpoint on one rank; every loss within 1e-5 of one process's (invariants 1 and 3)."""
    from meshlm.cli import main
    trace, run = cheap_hour(tmp_path), str(tmp_path / "run")
    args = cli_args(run, trace, "--checkpoint.resume", "auto", "--checkpoint.every", str(DEAR_STEP))
    kill_while_paused([*args, "--nproc", "2"], trace, run, 4)  # seen at once: the kill lands in the pause
    assert main(args) == 0
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl")) if x.strip()]
    assert_same_losses(reference(**CASE), [r for r in lines if "loss" in r], 1e-5)
    assert [r["step"] for r in lines if "pause" in r] == [DEAR_STEP]


@pytest.mark.slow  # two starts of `meshlm train`
def test_killed_while_paused_resumes_from_the_pause_checkpoint(tmp_path, capsys):
    from meshlm.cli import main
    trace, run = cheap_hour(tmp_path), str(tmp_path / "run")
    args = cli_args(run, trace, "--checkpoint.resume", "auto", "--checkpoint.every", str(DEAR_STEP))
    paused = kill_while_paused(args, trace, run, 12)  # the restart (~3 s) begins well before the pause ends
    metrics = os.path.join(run, "metrics.jsonl")
    restarted = time.time()
    assert main(args) == 0
    lines = [json.loads(x) for x in open(metrics) if x.strip()]
    losses = [r for r in lines if "loss" in r]
    ref = reference(**CASE)
    assert [(r["step"], r["loss"]) for r in losses] == [(r["step"], r["loss"]) for r in ref]
    resumed = [r for r in lines if "resumed" in r]  # the restarted run waited out the rest of the pause
    if restarted < paused["pause"]["end"] - 5:  # (its start-up took less than the pause had left)
        assert [r["step"] for r in resumed] == [DEAR_STEP] and resumed[0]["resumed"]["time"] >= paused["pause"]["end"]


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["unparsable", "not covering", "deadline"])
def test_bad_trace_or_deadline_is_one_line_exit_2_nothing_written(tmp_path, capsys, what):
    from meshlm.cli import main
    now, extra, steps = time.time(), [], CASE["training__steps"]
    if what == "unparsable":
        trace = str(tmp_path / "t.csv")
        open(trace, "w").write(f"time,price\n{iso(now)},1\nsoon,2\n")
        line = f"training.energy.trace: {trace}: row 3: not an ISO 8601 time: 'soon'"
    elif what == "not covering":  # starts in an hour
        trace = write_trace(tmp_path / "t.csv", [(now + 3600, 1), (now + 7200, 2)])
        line = "training.energy.trace: does not cover the run"
    else:  # a second from now: 100000 steps cannot be done by then
        trace = write_trace(tmp_path / "t.csv", [(now - 60, 1), (now + 7200, 2)])
        extra, steps = ["--training.energy.deadline", iso(now + 1)], 100000
        line = "training.energy.deadline: cannot be met even running throughout"
    run = str(tmp_path / "run")
    capsys.readouterr()
    assert main(cli_args(run, trace, *extra, steps=steps)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"meshlm: {line}") and "\n" not in err, err
    assert not os.path.exists(run)


def test_estimate_prints_the_schedule_and_its_cost_against_running_now(tmp_path, capsys):
    from meshlm.cli import main
    t0 = time.time() - 60
    trace = write_trace(tmp_path / "t.csv", [(t0, 0.30), (t0 + 3600, 0.05), (t0 + 7200, 0.30), (t0 + 4 * 3600, 0.3)])
    capsys.readouterr()
    assert main(["estimate", "--gpu", "h100", "--gpus", "8", "--model.preset", "llama3-8b",
                 "--training.steps", "200", "--training.global_batch", "64", "--training.micro_batch", "1",
                 "--training.energy.trace", trace]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "schedule: 200 steps" in out and "cost:" in out and "running now" in out and "saved" in out, out
