"""A full disk (docs/checkpoints.md, "A full disk"): refused before training when the checkpoint
directory cannot hold keep + 1 checkpoints; during a run a save that fails removes its `.tmp`, says
so in one line (the directory, the bytes needed and free) and leaves the last checkpoint intact, then
stops (exit 1) or trains on (`checkpoint.on_error`). The disk is a real 3 MB tmpfs: the debug
model's checkpoint (2.6 MB on disk) fits once, not twice."""
import json
import os
import subprocess
import sys

import pytest

from harness import TINY, assert_same_losses, make_config, read_metrics, reference, rows, run_local, train_case
from meshlm.core import config as C
from meshlm.cli import main
from meshlm.train.checkpoint import CheckpointError, SaveError, check_files, check_room, list_checkpoints, read_metadata
from meshlm.train.convert import ExportError, to_hf

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
LAYOUTS = [("dp", {"parallel__dp": 2}), ("zero", {"parallel__dp": 2, "parallel__zero": 3}),
           ("tp", {"parallel__tp": 2}), ("pp", {"parallel__pp": 2})]
# the sizes below are the debug preset's four blocks (TINY trains two): a 3 MB disk holds one checkpoint
FOUR = {"model__n_layers": 4}
SAVES = {"training__steps": 4, "checkpoint__every": 2, "checkpoint__keep": 2, **FOUR}


@pytest.fixture
def disk(tmp_path):
    """A 3 MB tmpfs (the test runs as root: mount(8) needs it)."""
    where = tmp_path / "disk"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True, text=True)
    if res.returncode:
        pytest.fail(f"a small tmpfs is this test's disk: mount failed ({res.stderr.strip()})")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def assert_last_checkpoint_intact(run_dir, step: int) -> None:
    root = os.path.join(run_dir, "checkpoints")
    assert not [n for n in os.listdir(root) if n.endswith(".tmp")], os.listdir(root)
    (got, path), = list_checkpoints(root)
    assert got == step
    check_files(path, read_metadata(path))  # every data file the index names is whole


def save_stops(cfg_dict: dict, run_dir: str) -> str:
    """In a pool worker: the run's SaveError line (every rank must raise one)."""
    try:
        train_case(cfg_dict, run_dir)
    except SaveError as e:
        return str(e)
    return "no SaveError"


@pytest.mark.parametrize("name,layout", rows(LAYOUTS, fast=("zero",)))
def test_full_disk_stops_with_one_line(pools, disk, name, layout):
    run_dir = str(disk / "run")
    lines = pools(2).run(save_stops, C.to_dict(make_config(**SAVES, **layout)), run_dir)
    assert lines[0] == lines[1], lines
    line = lines[0]
    assert line.startswith(f"checkpoint step 4 not saved in {run_dir}/checkpoints: no space: needs ") and \
        " bytes, " in line and " free (.tmp removed; newest checkpoint step_00000002)" in line, line
    need, free = (int(x.split()[0].replace(",", "")) for x in line.split("needs ")[1].split(", ")[:2])
    assert free < need and need > 2_000_000  # the whole checkpoint's tensor bytes
    assert_last_checkpoint_intact(run_dir, 2)


@pytest.mark.parametrize("name,layout", rows([("dp", {"parallel__dp": 2}), ("tp-async", {"parallel__tp": 2,
                                                                                          "checkpoint__async": True})]))
def test_full_disk_continue_trains_on(pools, disk, name, layout):
    """on_error = "continue": every later due save fails the same way and is reported; the run ends
    normally with the losses of a run that saved nothing."""
    run_dir = str(disk / "run")
    over = {**SAVES, "training__steps": 6, "checkpoint__on_error": "continue", **layout}
    pools(2).run(train_case, C.to_dict(make_config(**over)), run_dir)
    assert_same_losses(reference(training__steps=6, **FOUR), read_metrics(run_dir), 1e-5)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        errors = {r["step"]: r["ckpt"]["error"] for r in map(json.loads, f) if "error" in r.get("ckpt", {})}
    assert sorted(errors) == [4, 6] and all("no space" in e for e in errors.values()), errors
    assert_last_checkpoint_intact(run_dir, 2)


def test_no_room_for_keep_plus_one_is_refused_before_work(disk, capsys):
    run_dir = disk / "run"
    args = ["train", "--run-dir", str(run_dir), "--checkpoint.every", "5"]
    for k, v in {**TINY, "model.n_layers": 4}.items():
        args += [f"--{k}", str(v)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"meshlm: checkpoint: {disk} has 3,145,728 bytes free, the run "
                                                   f"needs 7,098,624 (3 checkpoints of 2,366,208 bytes"), err
    assert not run_dir.exists()
    # keep = 0 keeps every save: one of 2.4 MB (5 steps) fits, two (10 steps) do not
    check_room(make_config(checkpoint__every=5, checkpoint__keep=0, training__steps=5, **FOUR), str(run_dir))
    with pytest.raises(CheckpointError, match=r"needs 4,732,416 \(2 checkpoints"):
        check_room(make_config(checkpoint__every=5, checkpoint__keep=0, training__steps=10, **FOUR), str(run_dir))


def test_export_to_a_full_disk_is_one_line(tmp_path, disk):
    run_local(make_config(training__steps=2, checkpoint__every=2, **FOUR), str(tmp_path / "run"))
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * 2_900_000)
    with pytest.raises(ExportError) as e:
        to_hf(str(tmp_path / "run"), str(disk / "hf"), "fp32")
    assert str(e.value).startswith(f"export to {disk}/hf failed: no space: needs 788,736 bytes, "), str(e.value)
    assert os.listdir(disk) == ["filler"]  # no hf.tmp


def test_export_during_training_continues(disk):
    """checkpoint.export_hf with on_error = "continue": the export that does not fit is reported and
    removed; the checkpoint it came from stays."""
    run_dir = str(disk / "run")
    run_local(make_config(training__steps=2, checkpoint__export_hf=2, checkpoint__export_dtype="fp32",
                          checkpoint__on_error="continue", **FOUR), run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        errors = [r["export_error"] for r in map(json.loads, f) if "export_error" in r]
    assert len(errors) == 1 and "no space: needs 788,736 bytes" in errors[0], errors
    assert os.listdir(os.path.join(run_dir, "hf")) == []
    assert_last_checkpoint_intact(run_dir, 2)


@pytest.mark.slow
def test_full_disk_launch_exits_one(disk):
    """`meshlm train --nproc 2`: the preflight passes (keep 1: two checkpoints of the planner's 2.4 MB
    fit 4.8 MB), the second save does not (2.6 MB each on disk): exit 1, the line, no .tmp."""
    subprocess.run(["mount", "-o", "remount,size=4800k", str(disk)], check=True)
    run_dir = disk / "run"
    args = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", "2", "--run-dir", str(run_dir)]
    for k, v in {**TINY, "model.n_layers": 4, "training.steps": 4, "checkpoint.every": 2, "checkpoint.keep": 1,
                 "parallel.dp": 2}.items():
        args += [f"--{k}", str(v)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC), OMP_NUM_THREADS="1")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"meshlm: rank 0: checkpoint step 4 not saved in {run_dir}/checkpoints: no space" in proc.stderr
    assert "Traceback" not in "\n".join(x for x in proc.stderr.splitlines() if x.startswith("[default"))
    assert_last_checkpoint_intact(run_dir, 2)
