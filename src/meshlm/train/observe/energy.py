"""The hardware's energy counters, read at metrics records only (docs/energy.md, "Measured energy").

Readers: NVML's total-energy counter of this rank's GPU (through `pynvml`, the `nvidia-ml-py` package:
`pip install 'meshlm[energy]'`) and the RAPL packages of this host through Linux powercap. Each rank
reads its own at a logged step (no device sync of its own: the metrics line has synced already), turns
them into joules per counter since its last read, and publishes them in the job's key-value store beside
the stragglers' time splits; rank 0 sums them, each counter key once (core/facts/energy.py).
"""
from __future__ import annotations

import glob
import json
import os
import socket
import time

from ...core.facts.energy import Reading, deltas, energy_fields, gpu_key, job_joules, package_key
from .straggler import gather_published

POWERCAP = "/sys/class/powercap"


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _read_number(path: str) -> float:
    return float(_read_text(path))


class RaplPackage:
    """One RAPL package zone (`intel-rapl:N`, named `package-N`; AMD's kernel driver uses the same names)."""

    def __init__(self, zone: str, host: str):
        self.zone = zone
        self.key = package_key(host, _read_text(os.path.join(zone, "name")))
        self.wrap = _read_number(os.path.join(zone, "max_energy_range_uj")) / 1e6
        limit = os.path.join(zone, "constraint_0_max_power_uw")
        self.max_watts = _read_number(limit) / 1e6 if os.path.isfile(limit) else 0.0
        self.read()  # a counter that cannot be read now is refused here, not at the first record

    def read(self) -> Reading:
        return Reading(self.key, _read_number(os.path.join(self.zone, "energy_uj")) / 1e6, self.wrap, self.max_watts)


def rapl_packages(root: str = POWERCAP, host: str | None = None) -> tuple[list[RaplPackage], str]:
    """This host's readable RAPL packages under the powercap tree `root`, or none and why."""
    host = host or socket.gethostname()
    if not os.path.isdir(root):
        return [], f"RAPL: {root} absent (no powercap driver: a VM or a non-Linux host)"
    zones = [z for z in sorted(glob.glob(os.path.join(root, "intel-rapl:*")))
             if os.path.basename(z).count(":") == 1]  # intel-rapl:N:M are the package's sub-zones
    packages, why = [], f"RAPL: no intel-rapl zone under {root}"
    for zone in zones:
        try:
            if _read_text(os.path.join(zone, "name")).startswith("package"):
                packages.append(RaplPackage(zone, host))
        except PermissionError:
            why = f"RAPL: {zone}/energy_uj readable by root only (Linux >= 5.10; CVE-2020-8694)"
        except (OSError, ValueError) as e:
            why = f"RAPL: {zone}: {type(e).__name__}"
    return packages, "" if packages else why


class NvmlGpu:
    """NVML's total-energy counter (millijoules since the driver loaded; Volta and later) of one GPU."""

    def __init__(self, index: int | str):
        import pynvml
        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByUUID(index) if isinstance(index, str) else \
            pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(self.handle)
        self.key = gpu_key(uuid.decode() if isinstance(uuid, bytes) else uuid)
        self.read()

    def read(self) -> Reading:
        return Reading(self.key, self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3)


def nvml_gpu(index: int) -> tuple[list[NvmlGpu], str]:
    """CUDA device `index`'s GPU counter, or none and why. NVML numbers every GPU of the host, CUDA
    the visible ones: CUDA_VISIBLE_DEVICES names the NVML index (or UUID) of each visible one."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    name = visible[index % len(visible)] if visible else index  # an index or a GPU-... UUID
    try:
        return [NvmlGpu(int(name) if str(name).isdigit() else name)], ""
    except ImportError:
        return [], "NVML: pynvml not importable (pip install 'meshlm[energy]')"
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError_*: NotSupported (pre-Volta), NoPermission, ...
        return [], f"NVML: {str(e) or type(e).__name__}"


def open_counters(kind: str, index: int = 0, root: str = POWERCAP) -> tuple[list, str]:
    """The counters a rank on device `kind` ("cuda" or "cpu") reads: its GPU's and its host's RAPL
    packages; and the start-up line's words for them. A CUDA rank without its GPU's counter has none."""
    packages, no_rapl = rapl_packages(root)
    gpus, no_nvml = nvml_gpu(index) if kind == "cuda" else ([], "")
    if kind == "cuda" and not gpus:
        return [], f"energy not measured ({no_nvml}; the energy fields are null)"
    if not gpus and not packages:
        return [], f"energy not measured ({no_rapl}; the energy fields are null)"
    rapl = f"RAPL ({len(packages)} package{'s' if len(packages) > 1 else ''} per host, counted once)"
    parts = (["NVML (this rank's GPU)"] if gpus else []) + ([rapl] if packages else [])
    return gpus + packages, "energy from " + " and ".join(parts) + (f" ({no_rapl})" if gpus and not packages else "")


class EnergyMeter:
    """Every rank's counters between two metrics records; rank 0's `record` is the job's sum."""

    def __init__(self, kind: str, index: int, store, rank: int, world: int, root: str = POWERCAP,
                 wait_s: float = 2.0):
        self.counters, self.note = open_counters(kind, index, root)
        self.store, self.rank, self.world, self.wait_s = store, rank, world, wait_s
        self.last, self.last_t = self.read(), time.time()
        self.told = False  # rank 0 said once why another rank's counters leave the fields null

    def read(self) -> list[Reading] | None:
        """Every counter now, or None if one failed (that interval is then unknown)."""
        try:
            return [c.read() for c in self.counters]
        except Exception:  # noqa: BLE001 - a counter that stopped answering (an NVML error, a sysfs read)
            return None

    def record(self, step: int, tokens: float, message=None) -> dict:
        """The metrics line's `time`, `energy_j`, `power_w`, `j_per_token` since the last record (every
        rank calls it at a logged step; the fields mean something on rank 0 only). Where rank 0 reads
        counters and another rank has none, rank 0 says why through `message`, once."""
        now, t = self.read(), time.time()
        mine = deltas(self.last or [], now, t - self.last_t) if (now and self.counters) else None
        seconds, self.last, self.last_t = t - self.last_t, now, t
        per_rank = [mine] if self.world == 1 else [None]  # other ranks' are rank 0's to sum
        if self.world > 1 and self.store is not None:
            why = "" if self.counters else self.note
            self.store.set(f"meshlm/energy/{self.rank}", json.dumps({"step": step, "counters": mine, "why": why}))
            if self.rank == 0 and mine is not None:  # rank 0 without a counter knows the answer: null
                got = gather_published(self.store, "meshlm/energy", self.world, step, self.wait_s)
                per_rank = [got[r]["counters"] if r in got else None for r in range(self.world)]
                lacking = [(r, got[r]["why"]) for r in got if got[r]["why"]]
                if lacking and message is not None and not self.told:
                    self.told = True
                    message(f"step {step}: rank {lacking[0][0]}: {lacking[0][1]}")
        return {"time": t, **energy_fields(job_joules(per_rank), seconds, tokens)}
