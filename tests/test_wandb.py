"""metrics.wandb: a run offline (WANDB_MODE=offline) logs every metrics.jsonl line at its step and
the resolved config, read back from the run's .wandb file; without the package the run is refused in
one line before anything starts."""
import glob
import json
import os
import struct
import sys

import pytest

from harness import make_config, read_metrics, run_local
from meshlm.cli import main

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records


def read_records(path: str) -> list:
    """Every protobuf Record in a .wandb file (wandb.proto's own message type)."""
    from wandb.proto import wandb_internal_pb2 as pb
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, out, part = 7, [], b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


@pytest.mark.slow  # wandb's service process starts in seconds to tens of seconds on a shared machine
def test_offline_run_logs_the_metrics_lines_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = make_config(training__steps=3, metrics__wandb=True, metrics__wandb_run="tiny-offline",
                      training__precision="auto", training__compile="auto")
    got = run_local(cfg, str(tmp_path))
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(files) == 1
    records = read_records(files[0])
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert sorted(history) == [m["step"] for m in got] == [1, 2, 3]
    for m in got:
        h = history[m["step"]]
        assert h["loss"] == m["loss"] and h["grad_norm"] == m["grad_norm"] and h["lr"] == m["lr"]
        assert h["mem/peak"] == m["mem"]["peak"] and h["tokens"] == m["tokens"]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert run.display_name == "tiny-offline"
    assert config["training"]["precision"] == "fp32" and config["training"]["compile"] is False  # resolved
    assert config["training"]["steps"] == 3
    assert config["model"]["preset"] == "debug"


def test_missing_package_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), "--model.preset", "debug", "--metrics.wandb", "true"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "meshlm: metrics.wandb: needs the `wandb` package (pip install 'meshlm[wandb]')"
    assert not run_dir.exists()
