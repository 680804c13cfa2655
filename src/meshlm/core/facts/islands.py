"""What DiLoCo's islands send and the planner prices alike (parallel.islands, docs/diloco.md): the wire
size of an outer gradient per quantisation, and when fp8 / int8 gradients are reduced in two steps."""
from __future__ import annotations

from ..choices import DTYPE_BYTES
from .quant import QUANT_BLOCK

# bytes per element of the outer gradient as sent (none: fp32); fp8 / int8: one byte and block scales
WIRE_ELEM = {"none": DTYPE_BYTES["fp32"], "bf16": DTYPE_BYTES["bf16"]}
TWO_STEP_FROM = 3  # islands from which fp8 / int8 outer gradients are reduced in two steps (fewer bytes)


def padded(n: int, quantize: str) -> int:
    """Elements sent for n: the float8 and int8 rows are whole blocks of QUANT_BLOCK, each with its fp32 scale."""
    return n if quantize in WIRE_ELEM else -(-n // QUANT_BLOCK) * QUANT_BLOCK


def two_step_rows(n: int, islands: int) -> int:
    """Blocks of QUANT_BLOCK the two-step reduce sends for n elements: a multiple of the islands."""
    return -(-(-(-n // QUANT_BLOCK)) // islands) * islands
