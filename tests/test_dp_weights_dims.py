"""Uneven data parallelism (parallel.dp_weights, issue #51) with the other dimensions: context
parallelism, expert parallelism and MTP under padding, pipeline parallelism. Each row's losses, gradient
norms, routing metrics and MTP loss equal one process's (fp32, 1e-5 per step); the harness is
tests/test_dp_weights.py's `check_uneven_row`."""
import pytest
from harness import rows
from test_dp_weights import check_uneven_row

CASES = [
    # a cp group lies inside one replica: its ranks run the replica's count; gradients meet over dp × cp
    ("dp2-cp2-zero1-3-1", 4, {"parallel__dp": 2, "parallel__cp": 2, "parallel__zero": 1,
                              "parallel__dp_weights": [3, 1]}, {}),
    # an ep group spans replicas: the lighter one pads (loss × 0) to join every all-to-all, and its
    # padding passes count in no routing statistic (the aux loss's gradient included)
    ("moe-dp2-ep2-3-1", 2, {"parallel__dp": 2, "parallel__ep": 2, "parallel__dp_weights": [3, 1]},
     {"model__preset": "moe-debug"}),
    ("moe-zero3-3-1", 2, {"parallel__zero": 3, "parallel__dp_weights": [3, 1]}, {"model__preset": "moe-debug"}),
    # MTP (and DeepSeek-V3's bias update and sequence-wise loss) under ZeRO-2's padding
    ("dsv3-zero2-3-1", 2, {"parallel__zero": 2, "parallel__dp_weights": [3, 1]}, {"model__preset": "dsv3-debug"}),
]


@pytest.mark.parametrize("name,world,layout,single", rows(CASES, slowest=[]))
def test_uneven_dims_match_one_process(pools, name, world, layout, single):
    check_uneven_row(pools, world, layout, single)
