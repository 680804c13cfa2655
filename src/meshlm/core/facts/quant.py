"""Blockwise quantisation's wire format, what ZeRO++'s int8 rows (parallel/dims/zero/quantize.py) and
DiLoCo's fp8 / int8 outer gradients (parallel/dims/islands.py) send and what the planner prices
(plan/cost/volume.py, plan/cost/islands.py): one block size, one packed-row size (docs/zero.md "ZeRO++")."""
from __future__ import annotations

QUANT_BLOCK = 256  # elements per fp32 scale


def packed_bytes(n: int) -> int:
    """Bytes of one int8 row of n values with its fp32 block scales (4 per QUANT_BLOCK elements)."""
    return n + 4 * -(-n // QUANT_BLOCK)
