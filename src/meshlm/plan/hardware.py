"""GPU profiles: the handful of numbers the planner needs about a machine.

Bandwidths are per GPU and per direction (what one rank can push into a collective), peak FLOP/s are
dense (no structured sparsity); each family's datasheet peak is cards.PEAK_FLOPS, which the trainer's
MFU reads too. HBM sizes are what `nvidia-smi` reports as total memory, not the marketing number,
because that is what the allocator can hand out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from ..core import cards

GB = 1e9
GIB = 2 ** 30
MIB = 2 ** 20


def hashed_once(obj) -> int:
    """The hash of a frozen dataclass, computed on its first use and kept: the planner's caches key on
    GPU and Options in every lookup, and a generated hash walks every field each time."""
    h = obj.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(obj, f.name) for f in fields(obj)))
        object.__setattr__(obj, "_hash", h)
    return h


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float          # dense bf16/fp16 tensor-core FLOP/s
    hbm_bytes: float           # device memory
    hbm_bw: float              # bytes/s
    nvlink_bw: float           # intra-node, bytes/s per GPU per direction
    ib_bw: float               # inter-node NIC bandwidth per GPU, bytes/s per direction
    gpus_per_node: int = 8
    pcie_bw: float = 50 * GB   # host link (optimizer offload), bytes/s per direction
    fp32_ratio: float = cards.FP32_RATIO  # fp32 matmuls run as TF32: this fraction of the bf16 peak
    # CPU AdamW throughput per GPU's share of the host (--cpu-adam-gparams). It is memory-bound (~28 B of
    # host traffic per parameter): torch's fused CPU AdamW did 4.1-4.8e9 params/s on a 16-core host that
    # served one H100 (docs/benchmarks.md); on an 8-GPU node the host's ~400 GB/s is shared 8 ways.
    cpu_adam_params_per_s: float = 2e9
    # NVMe offload (parallel.offload = "nvme"): sequential disk bandwidth per GPU's share of the node's
    # drives, bytes/s (--disk-read-gbps / --disk-write-gbps). Default: a DGX H100/H200/B200, whose user
    # guides list 8 NVMe U.2/E1.S data drives of 3.84 TB for 8 GPUs, i.e. one drive per GPU; a PCIe 4.0
    # data-centre drive of that size reads ~6.5 GB/s and writes ~3.5 GB/s sequentially (Samsung PM1733,
    # KIOXIA CM6 datasheets). Assumed, not measured here: bench/offload.py measures a machine's own.
    disk_read_bw: float = 6.5 * GB
    disk_write_bw: float = 3.5 * GB
    # Per-operation time model (plan/cost/ops.py). Defaults are the H100 SXM's:
    sms: int = 132                 # streaming multiprocessors (NVIDIA H100 whitepaper: 132 on SXM5)
    gemm_ceiling: float = 0.775    # large bf16 GEMM / peak: 767 of 989 TFLOP/s, 8192³ cuBLAS on one H100 SXM
    #                                (shared/gpu/h100-2026-11-25/ceilings.json, square8192)
    # fp8 e4m3 GEMM (torch._scaled_mm, tensorwise scales) / bf16 GEMM of the same shape: the least of the
    # six shapes of ceilings.json (1.58-1.81x; 8b-w13 is the least), so an fp8 estimate is not optimistic
    fp8_gemm_speedup: float = 1.58
    hbm_eff: float = 0.85          # achieved / datasheet HBM bandwidth: fused AdamW moved 30 B × 1.24e9
    #                                params in 13 ms = 2.86 of 3.35 TB/s (profiled step, docs/benchmarks.md)
    launch_eager_s: float = 10e-6  # host dispatch per eager PyTorch op with autograd (assumed; on a compiled
    #                                GPU step the kernels hide it, so a calibration does not fit it)
    launch_compiled_s: float = 5e-6  # per inductor-generated kernel launch (assumed likewise)
    arch: str = "hopper"           # which attention-kernel table applies (plan/cost/ops.py)
    link_latency_s: float | None = None  # fixed cost per collective call; None: comm.LATENCY_S (NVLink /
    #                                IB); a calibrated CPU sets what a probe of its collectives measured

    attn_scale: float = 1.0        # achieved / table attention rate; a calibration from a GPU run fits it
    # Compute that runs beside an overlapped collective slows by this fraction of the collective's hidden
    # time: NCCL keeps 8-32 CTAs resident for a transfer, and a GEMM beside such a kernel lost +8.9% (8
    # CTAs), +18.7% (16), +31.5% (32) on an H200, about the share of SMs held, whatever the bytes moved
    # (50 or 450 GB/s). 0.197 is the mean of those 27 rows (bench/overlap.py, bench/results/2026-11-26-
    # nvidia-h200/overlap/; docs/planner.md). Assumed the same on every card (an A100's 108 SMs lose more)
    overlap_slowdown: float = 0.197

    __hash__ = hashed_once  # a key of the search's caches (ops.gemm_seconds)

    def peak(self, precision: str) -> float:
        """The dense peak MFU is reported against: fp8 runs report against the bf16 peak (the blocks'
        GEMMs run faster, see fp8_gemm_speedup, but the output head and attention stay bf16)."""
        return cards.peak(self.peak_flops, precision, self.fp32_ratio)


_PEAK = cards.PEAK_FLOPS
PROFILES: dict[str, GPU] = {
    "h100-sxm-80gb": GPU("H100-SXM-80GB", _PEAK["H100"], 81559 * 2 ** 20, 3.35e12, 450 * GB, 50 * GB, 8, 50 * GB),
    "h200": GPU("H200", _PEAK["H200"], 143771 * 2 ** 20, 4.8e12, 450 * GB, 50 * GB, 8, 50 * GB),
    # Grand Teton H100 as torchtitan benchmarks it (docs/performance.md there): 96 GB HBM2e at 2.4 TB/s,
    # 400 Gb/s RDMA per GPU; at its 500 W power limit it is h100-96gb-500w below
    "h100-96gb": GPU("H100-96GB-HBM2e", _PEAK["H100"], 96e9, 2.4e12, 450 * GB, 50 * GB, 8, 50 * GB),
    # the same card at the 500 W power limit torchtitan ran it at: the tensor-core clock a power limit
    # leaves is in no datasheet, so the peak is read off two datasheets of the same 132-SM GH100 die:
    # H100 NVL at 400 W, 835 TFLOP/s dense bf16 (1,671 with sparsity), and H100 SXM at 700 W, 989; linear
    # in the power limit between the two -> 886 TFLOP/s at 500 W (an interpolation, not a measurement)
    "h100-96gb-500w": GPU("H100-96GB-HBM2e-500W", 835e12 + (_PEAK["H100"] - 835e12) * (500 - 400) / (700 - 400), 96e9,
                          2.4e12, 450 * GB, 50 * GB, 8, 50 * GB),
    # A100: 108 SMs (NVIDIA A100 whitepaper); the GEMM ceiling is the H100's measured fraction (assumed:
    # no A100 measurement in this repository)
    # DGX A100: 4 × 3.84 TB U.2 data drives for 8 GPUs (DGX A100 user guide), half a drive per GPU
    "a100-80gb": GPU("A100-80GB", _PEAK["A100"], 81920 * 2 ** 20, 2.039e12, 300 * GB, 25 * GB, 8, 25 * GB, sms=108, arch="ampere",
                     disk_read_bw=3.25 * GB, disk_write_bw=1.75 * GB),
    "a100-40gb": GPU("A100-40GB", _PEAK["A100"], 40960 * 2 ** 20, 1.555e12, 300 * GB, 25 * GB, 8, 25 * GB, sms=108, arch="ampere",
                     disk_read_bw=3.25 * GB, disk_write_bw=1.75 * GB),
    "b200": GPU("B200", _PEAK["B200"], 183359 * 2 ** 20, 8.0e12, 900 * GB, 50 * GB, 8, 50 * GB, sms=148),
}
ALIASES = {"h100": "h100-sxm-80gb", "h100-sxm": "h100-sxm-80gb", "a100": "a100-80gb",
           "a100-80": "a100-80gb", "a100-40": "a100-40gb", "h100-500w": "h100-96gb-500w"}

# Command-line flag -> (GPU field, multiplier from the flag's unit to SI bytes or FLOP/s).
FLAG_FIELDS = {
    "peak_tflops": ("peak_flops", 1e12),
    "hbm_gb": ("hbm_bytes", GB),
    "hbm_tbps": ("hbm_bw", 1e12),
    "nvlink_gbps": ("nvlink_bw", GB),
    "ib_gbps": ("ib_bw", GB),
    "pcie_gbps": ("pcie_bw", GB),
    "gpus_per_node": ("gpus_per_node", 1),
    "cpu_adam_gparams": ("cpu_adam_params_per_s", 1e9),
    "disk_read_gbps": ("disk_read_bw", GB),
    "disk_write_gbps": ("disk_write_bw", GB),
    "overlap_slowdown": ("overlap_slowdown", 1),
}


class HardwareError(ValueError):
    """An unknown profile or an incomplete custom one; the message is one line."""


def names() -> list[str]:
    return sorted(PROFILES) + sorted(ALIASES) + ["custom"]


def get_gpu(name: str | None, **overrides) -> GPU | None:
    """Profile `name` with flag overrides (FLAG_FIELDS units). No name: None, or with --hbm-gb alone
    a memory-only device (peak 0: no time model).

    `custom` starts from nothing, so peak, HBM size and both links must be given.
    """
    given = {k: v for k, v in overrides.items() if v is not None and k in FLAG_FIELDS}
    if name is None:
        if "hbm_gb" not in given:
            return None
        name, given = "memory-only", {"hbm_gb": given["hbm_gb"]}  # fits/doesn't, no time model
    key = ALIASES.get(name.lower(), name.lower())
    if key == "custom":
        missing = [f"--{k.replace('_', '-')}" for k in ("peak_tflops", "hbm_gb", "nvlink_gbps", "ib_gbps")
                   if k not in given]
        if missing:
            raise HardwareError(f"--gpu custom: also give {', '.join(missing)}")
        base = GPU("custom", 0.0, 0.0, 2e12, 0.0, 0.0)
    elif key == "memory-only":
        base = GPU("memory-only", 0.0, 0.0, 2e12, 0.0, 0.0)
    elif key in PROFILES:
        base = PROFILES[key]
    else:
        raise HardwareError(f"--gpu: unknown GPU '{name}' (known: {', '.join(names())})")
    changes = {}
    for flag, value in given.items():
        field, unit = FLAG_FIELDS[flag]
        if value < 0 or (value == 0 and flag != "overlap_slowdown"):  # no slowdown (0) is a real setting
            raise HardwareError(f"--{flag.replace('_', '-')}: must be {'>= 0' if flag == 'overlap_slowdown' else 'positive'}"
                                f", got {value}")
        changes[field] = int(value) if field == "gpus_per_node" else float(value) * unit
    return dataclasses.replace(base, **changes)


def profile_of_device(label: str) -> GPU | None:
    """The profile of a CUDA device name (as metrics' peak_label starts), or None for an unknown one."""
    name = cards.card(label)
    return PROFILES[name] if name else None


def describe(gpu: GPU) -> str:
    return (f"{gpu.name}: {gpu.peak_flops / 1e12:.0f} TFLOP/s bf16, {gpu.hbm_bytes / GIB:.1f} GiB HBM "
            f"@ {gpu.hbm_bw / 1e12:.2f} TB/s, NVLink {gpu.nvlink_bw / GB:.0f} GB/s, "
            f"IB {gpu.ib_bw / GB:.0f} GB/s per GPU, {gpu.gpus_per_node} GPUs/node")
