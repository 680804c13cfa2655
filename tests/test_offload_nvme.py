"""parallel.offload = "nvme" (issue #25, docs/zero.md "NVMe offload"): the optimizer state in per-rank files,
streamed through a bounded buffer. Equivalence rows against one process (docs/architecture.md,
invariant 1), checkpoints that save, resume and reshard through the files (invariant 3), bad input as
one line before work starts (invariant 6), and the scratch files' life cycle. Host memory and I/O
bandwidth are measured by bench/offload.py, not here."""
import os
import tempfile

import pytest
import torch
from harness import (assert_half_losses, assert_same_losses, make_config, reference, rows, run_layout, run_local,
                     train_in)

from meshlm.cli import main
from meshlm.core.config import ConfigError
from harness import build_layout
from meshlm.parallel.optim.nvme import FileRange, OffloadError, StateFiles, chunk_elements

FP32 = 1e-5


def nvme(**kw) -> dict:
    """offload = nvme in a fresh directory; a buffer of 0.05 MiB makes chunks of 1024 elements, so every
    unit of the debug model streams through several chunks and all three slots."""
    return {"parallel__offload": "nvme", "parallel__offload_dir": tempfile.mkdtemp(prefix="meshlm-nvme-"),
            "parallel__offload_buffer_mb": 0.05, **kw}


# ---------------------------------------------------------------- equivalence with one process

CASES = [
    ("nvme-zero3-dp2", 2, nvme(parallel__dp=2, parallel__zero=3), {}, FP32),
    ("nvme-zero2-dp2", 2, nvme(parallel__dp=2, parallel__zero=2), {}, FP32),
    ("nvme-zero1-dp2", 2, nvme(parallel__dp=2, parallel__zero=1), {}, FP32),
    ("nvme-zero1-one-process", 1, nvme(parallel__zero=1), {}, FP32),
    ("nvme-zero3-dp2-tp2", 4, nvme(parallel__dp=2, parallel__zero=3, parallel__tp=2), {}, FP32),
    ("nvme-hsdp-g2-bf16-accum", 4, nvme(parallel__dp=4, parallel__zero=3, parallel__zero_group=2,
                                        training__precision="bf16", training__micro_batch=1),
     {"training__precision": "bf16"}, None),  # None: harness.assert_half_losses
]


@pytest.mark.parametrize("name,world,overrides,ref_kw,rtol", rows(CASES, fast=("nvme-zero3-dp2",)))
def test_nvme_offload_equals_one_process(pools, name, world, overrides, ref_kw, rtol):
    cfg = make_config(**overrides)
    got = run_local(cfg) if world == 1 else run_layout(pools, cfg, world)
    if rtol is None:
        assert_half_losses(ref_kw, got)
    else:
        assert_same_losses(reference(**ref_kw), got, rtol)
    assert os.listdir(overrides["parallel__offload_dir"]) == []  # the scratch files went at the clean exit


def test_nvme_equals_zero3_without_offload_bitwise(pools):
    """The same kernel on the same elements: not merely close, equal (fp32)."""
    plain = run_layout(pools, make_config(parallel__dp=2, parallel__zero=3), 2)
    off = run_layout(pools, make_config(**nvme(parallel__dp=2, parallel__zero=3)), 2)
    assert [r["loss"] for r in plain] == [r["loss"] for r in off]


# ---------------------------------------------------------------- checkpoints through the files

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("first,second", [
    ((2, nvme(parallel__dp=2, parallel__zero=3)), (1, {})),
    ((2, nvme(parallel__dp=2, parallel__zero=3)), (2, {"parallel__tp": 2})),
    ((1, {}), (2, nvme(parallel__dp=2, parallel__zero=3))),
    ((2, {"parallel__tp": 2}), (2, nvme(parallel__dp=2, parallel__zero=1))),
], ids=["nvme-zero3-to-one", "nvme-zero3-to-tp2", "one-to-nvme-zero3", "tp2-to-nvme-zero1"])
def test_nvme_checkpoint_moves_between_layouts(pools, first, second):
    """Save at step 3 (past the warm-up) in one layout, resume in another: steps 4-6 give the uninterrupted
    losses."""
    ref = reference()
    a = tempfile.mkdtemp(prefix="meshlm-nvme-ckpt-")
    (w1, o1), (w2, o2) = first, second
    train_in(pools, make_config(checkpoint__every=3, **o1), w1, a, stop=3)  # only step 3 is resumed
    b = tempfile.mkdtemp(prefix="meshlm-nvme-resume-")
    resumed = train_in(pools, make_config(checkpoint__resume=os.path.join(a, "checkpoints", "step_00000003"),
                                           **o2), w2, b)
    assert [r["step"] for r in resumed] == list(range(4, 7))
    assert_same_losses(ref[3:], resumed, FP32)


def test_nvme_async_checkpoint_is_written_in_place(pools):
    """checkpoint.async_ with nvme saves synchronously from the files (a host snapshot would hold the
    whole state): the checkpoint resumes to the same losses."""
    a = tempfile.mkdtemp(prefix="meshlm-nvme-async-")
    train_in(pools, make_config(checkpoint__every=3, checkpoint__async=True, **nvme(parallel__dp=2, parallel__zero=3)),
              2, a, stop=3)  # only step 3 is resumed
    resumed = run_local(make_config(checkpoint__resume=os.path.join(a, "checkpoints", "step_00000003")))
    assert_same_losses(reference()[3:], resumed, FP32)


def test_file_range_reads_and_writes_boxes_in_place(tmp_path):
    """A checkpoint box narrower than its rows (a strided view) reads and patches only its elements."""
    files = StateFiles(str(tmp_path), 0, 64)
    try:
        r = FileRange(files, "exp_avg", 16, 48)
        full = torch.arange(48, dtype=torch.float32)
        r.write(r.meta, full)
        box = r.meta[4:40].view(6, 6)[1:5, 2:4]  # rows 1-4, columns 2-3
        want = full[4:40].view(6, 6)[1:5, 2:4]
        assert torch.equal(r.read(box), want)
        r.write(box, -want)
        got = r.read(r.meta)
        exp = full.clone()
        exp[4:40].view(6, 6)[1:5, 2:4] *= -1
        assert torch.equal(got, exp)
        head = torch.empty(16)
        files.read("exp_avg", 0, head)  # the range before the unit's base is untouched (zeros)
        assert torch.count_nonzero(head) == 0
    finally:
        files.close()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- scratch files and bad input

def test_rank_directory_is_locked_and_a_killed_runs_scratch_replaced(tmp_path):
    stale = tmp_path / "rank0"
    stale.mkdir()
    (stale / "master.f32").write_bytes(b"left by a killed run")
    files = StateFiles(str(tmp_path), 0, 4096)
    try:
        assert os.path.getsize(stale / "master.f32") == 4 * 4096  # replaced, space reserved
        with pytest.raises(OffloadError, match=r"^parallel.offload_dir: .*rank0 is in use by another run$"):
            StateFiles(str(tmp_path), 0, 4096)
    finally:
        files.close()
    assert not stale.exists()


def test_buffer_bounds_the_chunk():
    assert chunk_elements(64 * 2 ** 20, staging=False) * 3 * 12 <= 64 * 2 ** 20
    assert chunk_elements(64 * 2 ** 20, staging=True) * 3 * 16 <= 64 * 2 ** 20
    assert chunk_elements(1, staging=True) == 1024  # a floor, so tiny buffers still make progress


@pytest.mark.parametrize("overrides,message", [
    ({"parallel__offload": "nvme", "parallel__dp": 2, "parallel__offload_dir": "/tmp"},
     "parallel.offload: nvme offload needs a ZeRO stage that shards the optimizer (zero >= 1)"),
    ({"parallel__offload": "nvme", "parallel__zero": 3, "parallel__dp": 2},
     'parallel.offload_dir: offload = "nvme" needs a directory for the optimizer state files'),
    ({"parallel__offload": "nvme", "parallel__zero": 3, "parallel__dp": 2, "parallel__offload_dir": "/tmp",
      "parallel__offload_buffer_mb": 0}, "parallel.offload_buffer_mb: must be > 0, got 0.0"),
])
def test_bad_nvme_config_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        build_layout(make_config(**overrides), 2)
    assert str(e.value) == message


def _train_argv(run_dir, offload_dir) -> list[str]:
    return ["train", "--run-dir", str(run_dir), "--model.preset", "debug", "--training.steps", "1",
            "--parallel.zero", "1", "--parallel.offload", "nvme", "--parallel.offload_dir", str(offload_dir)]


def test_unwritable_offload_dir_is_refused_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(_train_argv(tmp_path / "run", blocker / "sub")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm: parallel.offload_dir: cannot create ") and "\n" not in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_offload_dir_without_room_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 12, 10 ** 12 - 1000, 1000))
    assert main(_train_argv(tmp_path / "run", tmp_path / "off")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm: parallel.offload_dir: ") and "GiB free, the optimizer state of 1 rank needs" in err
    assert "\n" not in err and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the planner

def test_planner_counts_host_disk_bytes_and_io_time(capsys):
    """`meshlm estimate --json` (which the explorer mirrors, tests/test_explore_api.py) with offload = nvme:
    no optimizer bytes on the GPU, the buffer on the host, 12 B per sharded parameter on disk, and
    disk I/O time = 12·shard/read + 12·shard/write, overlapped with the host's PCIe staging and AdamW."""
    import json

    from meshlm.plan.hardware import GB
    from meshlm.plan.cost.memory import MIB

    base = ["estimate", "--json", "--gpu", "h100", "--gpus", "8", "--model.preset", "llama3-1b",
            "--data.seq_len", "2048", "--training.global_batch", "8", "--training.micro_batch", "1",
            "--training.precision", "bf16", "--parallel.zero", "3", "--disk-read-gbps", "4", "--disk-write-gbps", "2"]
    got = {}
    for off in ("none", "optimizer", "nvme"):
        capsys.readouterr()
        assert main(base + ["--parallel.offload", off, "--parallel.offload_buffer_mb", "128"]) == 0
        got[off] = json.loads(capsys.readouterr().out)
    psi = got["none"]["params"]
    shard = psi / 8  # ZeRO-3 over 8 ranks, no tp/pp (the debug shapes' padding is not modelled)
    pg = got["nvme"]["per_gpu"]
    assert pg["optim"] == 0 and got["none"]["per_gpu"]["optim"] == pytest.approx(12 * shard)
    assert pg["disk_optim"] == pytest.approx(12 * shard)
    assert pg["cpu_optim"] == 128 * MIB < got["optimizer"]["per_gpu"]["cpu_optim"] == pytest.approx(16 * shard)
    assert pg["total"] == pytest.approx(got["optimizer"]["per_gpu"]["total"])  # the same GPU bytes as CPU offload
    t = got["nvme"]["time"]
    io = 12 * shard / (4 * GB) + 12 * shard / (2 * GB)
    assert t["offload_io_s"] == pytest.approx(io)
    host = got["optimizer"]["time"]["offload_s"]  # PCIe staging + host AdamW, as CPU offload pays them
    assert t["offload_s"] == pytest.approx(max(io, host))
    assert got["optimizer"]["time"]["offload_io_s"] == 0
    # a buffer larger than the state: the host holds three slots of 16 B per element at most
    capsys.readouterr()
    assert main(base + ["--parallel.offload", "nvme", "--parallel.offload_buffer_mb", "1e9"]) == 0
    assert json.loads(capsys.readouterr().out)["per_gpu"]["cpu_optim"] == pytest.approx(48 * shard)


# ---------------------------------------------------------------- a killed run

@pytest.mark.slow
def test_kill_during_checkpoint_write_resumes_from_the_last_committed(tmp_path):
    """Rank 1 SIGKILLs itself while checkpoint 6 is half written (nvme dp2 zero3, under --max-restarts):
    the restart resumes from step 4 (the offload files are scratch, rebuilt from the checkpoint) and
    ends with the uninterrupted losses; the killed attempt's scratch is gone at the clean exit."""
    from test_fault import CASE, assert_same_as, launch, lines

    off = tmp_path / "offload"
    over = {**CASE, "training.steps": 8, "parallel.dp": 2, "parallel.zero": 3, "parallel.offload": "nvme",
            "parallel.offload_dir": str(off), "parallel.offload_buffer_mb": 0.05}
    ref = run_local(make_config(training__steps=8, **{k.replace(".", "__"): v for k, v in CASE.items()}))
    run = tmp_path / "run"
    proc = launch(run, 2, over, {"MESHLM_TEST_KILL_IN_SAVE": "6:1"})
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    assert [r["resumed_from"] for r in lines(run) if "restart" in r] == [4]
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    assert_same_as(ref, str(run))
    assert os.listdir(off) == []
