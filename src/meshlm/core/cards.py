"""The GPUs meshlm knows by name: each family's datasheet peak and which card a CUDA device name is.
The trainer's MFU (train/observe/metrics.py) and the planner's profiles (plan/hardware.py) both read this
table, so the two cannot disagree about a card. Pure Python, at the bottom of the layers.
"""
from __future__ import annotations

# Dense bf16/fp16 tensor-core peak FLOP/s of each family (vendors' datasheets, no structured sparsity).
# A CUDA device name belongs to the first family whose name it contains.
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
}
FP32_RATIO = 0.5  # fp32 matmuls run as TF32 at this fraction of the bf16 peak; fp8 reports against bf16

# torch.cuda.get_device_name() fragment -> card (a plan/hardware.py profile), matched case-insensitively
# in this order: a name a run logged (metrics' peak_label) must say which card it is, an A100's size too
DEVICE_NAMES = (("H100 80GB HBM3", "h100-sxm-80gb"), ("H100 SXM", "h100-sxm-80gb"), ("H200", "h200"),
                ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"), ("A100-SXM4-40GB", "a100-40gb"),
                ("B200", "b200"))
# The card of a family when only the family is known (the device this process trains on): an A100 with
# more than BIG_A100 bytes of memory is the 80 GB card
FAMILY_CARDS = {"H100": "h100-sxm-80gb", "H200": "h200", "A100": "a100-40gb", "B200": "b200"}
BIG_A100 = 60e9


def peak(bf16_flops: float, precision: str, fp32_ratio: float = FP32_RATIO) -> float:
    """The dense peak of `precision` on a card whose bf16 peak is `bf16_flops` (what MFU is against)."""
    return bf16_flops * (fp32_ratio if precision == "fp32" else 1.0)


def family(device_name: str) -> str | None:
    """The PEAK_FLOPS family of a CUDA device name, or None for an unknown card."""
    return next((f for f in PEAK_FLOPS if f in device_name), None)


def card(label: str) -> str | None:
    """The card a device name (or a peak_label that starts with one) names exactly, or None."""
    return next((c for key, c in DEVICE_NAMES if key.lower() in label.lower()), None)


def device_card(device_name: str, memory_bytes: float) -> str | None:
    """The card of a device this process sees: its family's, an A100's size told by its memory."""
    f = family(device_name)
    if f == "A100" and memory_bytes > BIG_A100:
        return "a100-80gb"
    return FAMILY_CARDS.get(f) if f else None


def device_groups(items: list[str]) -> list[tuple[str, int, int | None]]:
    """`["h100:16/8", "a100-80gb:8"]` -> [(card name as given, GPUs, GPUs per node or None)]: a mixed
    cluster in rank order (`--gpu` and parallel.devices both read it). Which names exist is the planner's
    (plan/hardware.py); here only the form is checked: a ValueError whose message names the bad item."""
    out = []
    for item in items:
        name, sep, rest = str(item).strip().partition(":")
        count, slash, node = rest.partition("/")
        try:
            n, per = int(count), (int(node) if slash else None)
        except ValueError:
            n, per = 0, None
        if not sep or not name or n < 1 or (slash and (per is None or per < 1 or n % per)):
            raise ValueError(f"{item!r} is not TYPE:COUNT or TYPE:COUNT/NODE (a positive count; NODE, the GPUs "
                             f"per node, divides COUNT), e.g. h100:16/8")
        out.append((name.lower(), n, per))
    return out
