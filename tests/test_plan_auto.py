"""parallel.auto: the planner picks the layout for the world size at start-up, the trainer logs the
choice with its predictions and trains with it; nothing fitting is a one-line refusal."""
from __future__ import annotations

import json
import math
import os

import pytest

from harness import make_config, read_metrics, train_case
from meshlm.core import config as C
from meshlm.plan.search.auto import choose_layout, layout_for_run
from meshlm.plan.hardware import get_gpu


def test_auto_trains_with_the_chosen_layout(pools, tmp_path):
    cfg = make_config(parallel__auto=True, training__steps=4)
    pools(4).run(train_case, C.to_dict(cfg), str(tmp_path))
    rec = json.load(open(os.path.join(tmp_path, "auto_layout.json")))
    assert rec["world"] == 4 and rec["predicted_step_s"] > 0 and 0 < rec["predicted_mfu"] < 1
    L = rec["layout"]
    assert L["dp"] * L["tp"] * L["pp"] * L["cp"] == 4 and L["global_batch"] == 8 and L["seq_len"] == 32
    steps = read_metrics(str(tmp_path))
    assert len(steps) == 4 and all(math.isfinite(s["loss"]) for s in steps)
    # the same choice in this process: layout_for_run writes it into the config the trainer builds from
    local = make_config(parallel__auto=True)
    layout, record = layout_for_run(local, 4)
    assert record["auto_layout"] == rec["auto_layout"]
    assert layout.world_size == 4 and local.parallel.dp == L["dp"] and local.training.micro_batch == L["micro_batch"]


def test_auto_refuses_in_one_line_when_nothing_fits():
    cfg = make_config(parallel__auto=True)
    tiny = get_gpu("custom", peak_tflops=1, hbm_gb=0.5, nvlink_gbps=1, ib_gbps=1)  # 0.5 GB < the 2 GiB reserve
    with pytest.raises(C.ConfigError) as e:
        choose_layout(cfg, 2, tiny)
    msg = str(e.value)
    assert msg.startswith("parallel.auto: no layout of 2 ranks fits") and "\n" not in msg


def test_auto_on_a_gpu_profile_keeps_the_users_batch():
    cfg = make_config(parallel__auto=True, **{"model__preset": "llama3-1b", "data__seq_len": 2048,
                                             "training__global_batch": 64, "training__precision": "bf16"})
    new, rec = choose_layout(cfg, 8, get_gpu("h100"))
    assert new.training.global_batch == 64 and new.data.seq_len == 2048 and new.training.precision == "bf16"
    assert rec["gpu"] == "H100-SXM-80GB" and rec["predicted_mem_gib"] < 80
