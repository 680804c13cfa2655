"""Each card's power figures: what the planner prices a layout's energy with (plan/cost/energy.py) and
what a measured run's energy is compared against (docs/energy.md, "Predicted energy and the Pareto
front"). Keyed like plan/hardware.py's profiles; pure Python, at the bottom of the layers.

Four figures per card, watts per GPU: `busy` while compute-bound kernels run (GEMMs, attention), `memory`
while memory-bound ones do (element-wise, optimizer), `comm` while the card only moves bytes (an exposed
collective), `idle` while it waits (pipeline bubbles, host gaps).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Power:
    busy_w: float
    memory_w: float
    comm_w: float
    idle_w: float

    def scaled(self, k: float) -> "Power":
        """The figures above idle times `k` (a calibration's one factor: one run's mean power cannot tell
        four figures apart, and idle is what the card draws doing nothing, measured apart)."""
        i = self.idle_w
        return Power(i + k * (self.busy_w - i), i + k * (self.memory_w - i), i + k * (self.comm_w - i), i)


# Memory-bound kernels and collectives draw less than the tensor cores at full tilt. Assumed fractions of
# the busy figure (a judgement, not measured here): a memory-bound kernel keeps HBM busy and the SMs
# mostly stalled, ~70%; a collective keeps a few SMs (NCCL's 8-32 CTAs) and the links busy, ~45%.
MEMORY_FRACTION = 0.70
COMM_FRACTION = 0.45


def _card(busy_w: float, idle_w: float) -> Power:
    return Power(busy_w, MEMORY_FRACTION * busy_w, COMM_FRACTION * busy_w, idle_w)


# busy: the board power limit (TDP) of each card's datasheet: a large bf16 GEMM runs at the limit.
# idle: assumed, the draw of a card in P0 with a context and no kernel (published nvidia-smi readings of
# SXM cards sit between ~60 and ~90 W for Hopper, ~50-60 W for A100; not measured in this repository).
CARD_POWER = {
    "h100-sxm-80gb": _card(700.0, 75.0),    # NVIDIA H100 Tensor Core GPU datasheet: SXM5 up to 700 W
    "h200": _card(700.0, 75.0),             # NVIDIA H200 Tensor Core GPU datasheet: SXM up to 700 W
    "h100-96gb": _card(700.0, 75.0),        # the SXM5 96 GB HBM2e part: the H100 SXM's 700 W (assumed)
    "h100-96gb-500w": _card(500.0, 75.0),   # the same card at the 500 W power limit torchtitan ran it at
    "a100-80gb": _card(400.0, 55.0),        # NVIDIA A100 Tensor Core GPU datasheet: SXM4 400 W
    "a100-40gb": _card(400.0, 55.0),        # the same datasheet: SXM4 40 GB, 400 W
    "b200": _card(1000.0, 120.0),           # NVIDIA HGX B200 datasheet: 1,000 W per GPU (idle assumed)
}

# The host's draw per node besides its GPUs (CPUs, memory, NICs, NVSwitches, fans), watts. Assumed:
# about half of what a DGX H100 may draw besides its GPUs (10.2 kW system maximum, DGX H100 user guide,
# less 8 × 700 W), since CPUs and fans sit well below their maximum while the GPUs train.
HOST_W_PER_NODE = 2300.0
# The facility's power usage effectiveness (total / IT power). Assumed 1.2: between a hyperscaler's fleet
# (Google's trailing-twelve-month 1.10, 2023 environmental report) and the industry's average (1.58,
# Uptime Institute global data-center survey 2023).
PUE = 1.2

# Power against the SM clock, for the clock plan (plan/cost/clocks.py): dynamic power goes as f·V², and
# the voltage falls with the clock down to a floor, below which only f falls (the textbook CMOS model,
# e.g. Weste & Harris, "CMOS VLSI Design"; the Zeus and Perseus papers measure GPU power superlinear
# in the clock). The idle draw stays at any clock. VOLTAGE_FLOOR (relative clock) and the lowest
# clock offered are assumed.
VOLTAGE_FLOOR = 0.6
LOWEST_CLOCK = 0.5


def clock_power(p: Power, clock: float, busy_w: float | None = None) -> float:
    """Watts of a card running compute at relative SM clock `clock` (1.0 = full) whose full-clock draw is
    `busy_w` (default the busy figure): idle plus the dynamic part, scaled by f·V²."""
    full = p.busy_w if busy_w is None else busy_w
    v = max(VOLTAGE_FLOOR, clock)
    return p.idle_w + (full - p.idle_w) * clock * v * v


def card_power(card: str) -> Power | None:
    """The figures of a card (a plan/hardware.py profile key), or None for a card not in the table."""
    return CARD_POWER.get(card)
