"""Measured energy (docs/energy.md, "Measured energy"): the accounting against counters whose values the
test knows, the RAPL reader against a fake powercap tree, and a CPU run on this machine, whose counters
cannot be read: the start-up line says why, once, and the metrics fields are null, never made up."""
import json
import os

import pytest

from meshlm.core.facts.energy import (Reading, delta, deltas, energy_fields, gpu_key, job_joules, kwh,
                                      package_key)
from meshlm.train.observe.energy import EnergyMeter, open_counters, rapl_packages

WRAP_UJ = 262_143_328_850  # a real max_energy_range_uj (Intel Xeon): 262 kJ


def test_a_counter_delta_with_and_without_wrap_around():
    wrap = WRAP_UJ / 1e6
    assert delta(Reading("k", 100.0, wrap), Reading("k", 160.5, wrap), 1.0) == 60.5
    # wrapped once: from 40 J below the top to 25 J above zero is 65 J
    assert delta(Reading("k", wrap - 40.0, wrap), Reading("k", 25.0, wrap), 1.0) == pytest.approx(65.0)
    # a counter that does not wrap went backwards (a driver reload): unknown, not a negative number
    assert delta(Reading("k", 500.0), Reading("k", 20.0), 1.0) is None
    # reads so far apart that the counter could have wrapped twice at its maximum power: unknown
    assert delta(Reading("k", 1.0, wrap, 300.0), Reading("k", 2.0, wrap, 300.0), wrap / 300.0 + 1) is None
    assert delta(Reading("k", 1.0, wrap, 300.0), Reading("k", 2.0, wrap, 300.0), 10.0) == 1.0


def test_the_job_sums_ranks_and_counts_a_shared_package_once():
    pkg, g0, g1 = package_key("node1", "package-0"), gpu_key("GPU-a"), gpu_key("GPU-b")
    before0 = [Reading(g0, 1000.0), Reading(pkg, 50.0, 1e5)]
    before1 = [Reading(g1, 7000.0), Reading(pkg, 50.0, 1e5)]
    now0 = [Reading(g0, 1300.0), Reading(pkg, 170.0, 1e5)]
    now1 = [Reading(g1, 7250.0), Reading(pkg, 170.5, 1e5)]  # read a moment later on rank 1
    per_rank = [deltas(before0, now0, 2.0), deltas(before1, now1, 2.0)]
    assert per_rank[0] == {g0: 300.0, pkg: 120.0}
    assert job_joules(per_rank) == 300.0 + 250.0 + 120.0  # the package once (rank 0's read)
    assert job_joules([{g0: 1.0}, {g1: 2.0}, {g0: 1.0}]) == 3.0  # two ranks sharing one GPU
    fields = energy_fields(job_joules(per_rank), 2.0, 1340.0)
    assert fields == {"energy_j": 670.0, "power_w": 335.0, "j_per_token": 0.5}


def test_unknown_is_null_never_a_number():
    assert job_joules([{"gpu:a": 3.0}, None]) is None  # a rank without a counter
    assert job_joules([{"gpu:a": 3.0, "cpu:h:package-0": None}]) is None  # a counter that went back
    assert job_joules([]) is None
    assert deltas([], [], 1.0) is None
    assert deltas([], [Reading("gpu:a", 5.0)], 1.0) == {"gpu:a": None}  # no earlier read to subtract
    assert energy_fields(None, 2.0, 100) == {"energy_j": None, "power_w": None, "j_per_token": None}
    assert kwh([{"energy_j": None}, {"step": 1}]) is None
    assert kwh([{"energy_j": 1.8e6}, {"energy_j": None}, {"energy_j": 1.8e6}]) == 1.0


def fake_powercap(root, packages: dict[int, int], readable: bool = True) -> None:
    """A powercap tree like a two-socket Xeon's: package zones, a DRAM sub-zone, a psys zone."""
    for i, uj in packages.items():
        zone = root / f"intel-rapl:{i}"
        (zone / f"intel-rapl:{i}:0").mkdir(parents=True)
        (zone / "name").write_text(f"package-{i}\n")
        (zone / "energy_uj").write_text(f"{uj}\n")
        (zone / "max_energy_range_uj").write_text(f"{WRAP_UJ}\n")
        (zone / f"intel-rapl:{i}:0" / "name").write_text("dram\n")
        (zone / f"intel-rapl:{i}:0" / "energy_uj").write_text("5\n")
        if not readable:
            (zone / "energy_uj").chmod(0o000)
    psys = root / f"intel-rapl:{len(packages)}"
    psys.mkdir()
    (psys / "name").write_text("psys\n")


def test_rapl_reader_on_a_fake_powercap_tree(tmp_path):
    fake_powercap(tmp_path, {0: 10_000_000, 1: WRAP_UJ - 1_000_000})
    pkgs, why = rapl_packages(str(tmp_path), host="node7")
    assert why == "" and [p.key for p in pkgs] == ["cpu:node7:package-0", "cpu:node7:package-1"]
    before = [p.read() for p in pkgs]
    assert before[0].joules == 10.0 and before[0].wrap == WRAP_UJ / 1e6
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("13500000\n")
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("2000000\n")  # wrapped: 1 J + 2 J
    d = deltas(before, [p.read() for p in pkgs], 1.0)
    assert d == {"cpu:node7:package-0": pytest.approx(3.5), "cpu:node7:package-1": pytest.approx(3.0)}


def test_rapl_says_why_it_cannot_read(tmp_path):
    assert rapl_packages(str(tmp_path / "none"))[1] == \
        f"RAPL: {tmp_path / 'none'} absent (no powercap driver: a VM or a non-Linux host)"
    assert rapl_packages(str(tmp_path))[1] == f"RAPL: no intel-rapl zone under {tmp_path}"
    if os.geteuid() != 0:  # root reads a file of mode 000 anyway
        fake_powercap(tmp_path, {0: 1}, readable=False)
        assert "readable by root only" in rapl_packages(str(tmp_path))[1]


def test_one_rank_meter_on_a_fake_tree(tmp_path):
    fake_powercap(tmp_path, {0: 10_000_000})
    meter = EnergyMeter("cpu", 0, None, 0, 1, root=str(tmp_path))
    assert meter.note == "energy from RAPL (1 package per host, counted once)"
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("70000000\n")
    rec = meter.record(5, tokens=600)
    assert rec["energy_j"] == pytest.approx(60.0) and rec["j_per_token"] == pytest.approx(0.1)
    assert rec["power_w"] > 0 and rec["time"] > 1.7e9


class FakeStore:
    """The job's key-value store as the meters use it (set, check, multi_get)."""

    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value.encode()

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def multi_get(self, keys):
        return [self.kv[k] for k in keys]


def test_two_ranks_on_one_host_count_their_package_once_through_the_store(tmp_path):
    fake_powercap(tmp_path, {0: 10_000_000, 1: 20_000_000})
    store = FakeStore()
    ranks = [EnergyMeter("cpu", 0, store, r, 2, root=str(tmp_path), wait_s=0.5) for r in (0, 1)]
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("40000000\n")  # +30 J
    (tmp_path / "intel-rapl:1" / "energy_uj").write_text("30000000\n")  # +10 J
    assert ranks[1].record(3, tokens=400)["energy_j"] is None  # rank 1 publishes; rank 0 speaks for the job
    assert ranks[0].record(3, tokens=400)["energy_j"] == pytest.approx(40.0)  # not 80: one host's packages
    assert ranks[0].record(4, tokens=400)["energy_j"] is None  # rank 1 never published step 4: unknown
    blind = EnergyMeter("cpu", 0, store, 1, 2, root=str(tmp_path / "none"))  # rank 1 on a host without RAPL
    said = []
    assert blind.record(5, tokens=400)["energy_j"] is None
    assert ranks[0].record(5, tokens=400, message=said.append)["energy_j"] is None
    assert blind.record(6, tokens=400)["energy_j"] is None
    assert ranks[0].record(6, tokens=400, message=said.append)["energy_j"] is None
    assert said == [f"step 5: rank 1: energy not measured (RAPL: {tmp_path / 'none'} absent (no powercap driver: "
                    "a VM or a non-Linux host); the energy fields are null)"]  # once


def test_counters_are_read_at_logged_steps_only(tmp_path, monkeypatch):
    """Reading costs no step time because a step that is not logged reads nothing (metrics.every = 2:
    steps 2 and 4 of 4 read, besides the one read when the meter is built)."""
    from harness import make_config, run_local
    from meshlm.train.observe import energy
    reads = []
    real = energy.EnergyMeter.read
    monkeypatch.setattr(energy.EnergyMeter, "read", lambda self: reads.append(1) or real(self))
    recs = run_local(make_config(training__steps=4, metrics__every=2), str(tmp_path))
    assert [r["step"] for r in recs] == [2, 4] and len(reads) == 1 + 2
    blind = not open_counters("cpu")[0]  # this VM: null; a host with readable RAPL: its joules
    assert recs[0]["time"] < recs[1]["time"] and all((r["energy_j"] is None) == blind for r in recs)


def test_a_cpu_run_without_counters_says_why_once_and_logs_null(tmp_path, capsys):
    """This machine (a VM: no /sys/class/powercap) has no counter; where one has, the test says so."""
    if open_counters("cpu")[0]:
        pytest.skip("this host's RAPL counters are readable")
    from meshlm.cli import main
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--model.preset", "debug", "--data.seq_len", "32",
                 "--training.global_batch", "4", "--training.micro_batch", "2", "--training.steps", "2",
                 "--training.precision", "fp32", "--training.compile", "false", "--training.peak_tflops", "1",
                 "--metrics.progress", "false", "--training.eval_every", "0", "--checkpoint.every", "0",
                 "--checkpoint.resume", "never"]) == 0
    err = capsys.readouterr().err
    assert err.count("energy not measured (RAPL: /sys/class/powercap absent") == 1, err
    assert sum("energy" in line for line in err.splitlines()) == 1, err  # said once, on the start-up line
    assert err.splitlines()[0].startswith("meshlm: debug, 1 worker") and "; energy not" in err.splitlines()[0]
    with open(run / "metrics.jsonl") as f:
        recs = [json.loads(x) for x in f if '"loss"' in x]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["energy_j"] is None and r["power_w"] is None and r["j_per_token"] is None
        assert abs(r["time"] - os.path.getmtime(run / "metrics.jsonl")) < 600


class FakeNvml:
    """pynvml as the reader calls it: the total-energy counter (mJ) of a GPU by its NVML index."""

    def __init__(self, mj: dict[int, int], supported: bool = True):
        self.mj, self.supported = mj, supported

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetHandleByUUID(self, u):
        return int(u.removeprefix("GPU-"))

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.supported:
            raise RuntimeError("Not Supported")
        return self.mj[h]


def test_nvml_reader_with_a_fake_pynvml(tmp_path, monkeypatch):
    nvml = FakeNvml({0: 1_000, 3: 5_000_000})
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")  # CUDA device 0 is NVML's GPU 3
    meter = EnergyMeter("cuda", 0, None, 0, 1, root=str(tmp_path / "none"))
    assert meter.note.startswith("energy from NVML (this rank's GPU) (RAPL: ")
    assert [c.key for c in meter.counters] == ["gpu:GPU-3"]
    nvml.mj[3] += 250_000  # 250 J in millijoules
    assert meter.record(2, tokens=1000)["j_per_token"] == pytest.approx(0.25)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0")  # named by UUID
    assert [c.key for c in open_counters("cuda", 0, str(tmp_path))[0]] == ["gpu:GPU-0"]
    monkeypatch.setitem(__import__("sys").modules, "pynvml", FakeNvml({3: 1}, supported=False))
    counters, note = open_counters("cuda", 0, str(tmp_path))
    assert counters == [] and note == "energy not measured (NVML: Not Supported; the energy fields are null)"
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # not installed
    assert "pynvml not importable (pip install 'meshlm[energy]')" in open_counters("cuda", 0, str(tmp_path))[1]
