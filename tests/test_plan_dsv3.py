"""Issue #49 item 7: the planner prices DeepSeek-V3's parts (MLA, MTP, auxiliary-loss-free balancing,
routed experts) as the runtime runs them. On `dsv3-debug`: the planner's TP, CP and EP bytes equal
Comm's books, its parameter/gradient/optimizer bytes and its activation bytes equal what the trainer
measures; on `deepseek-v3`: `meshlm plan` for 1,024 H100s finds a layout that fits in seconds."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
from harness import make_config, run_layout, run_local
from test_plan_vs_measured import activation_task, predicted
from test_tp import comm_task

from meshlm.core import config as C
from harness import build_layout
from meshlm.core.config.model import model_args
from meshlm.plan.cost.estimate import Options, estimate
from meshlm.plan.spec import code_options, priced_on, shape_from_config, spec_from_config
from meshlm.plan.cost.volume import cp_step_bytes, ep_step_bytes, moe_bias_bytes, tp_step_bytes

DSV3 = {"model__preset": "dsv3-debug", "training__steps": 2}


def _books(pools, cfg, world: int, group: str) -> dict:
    return pools(world).run(comm_task, C.to_dict(cfg), 2, group)[0]


@pytest.mark.parametrize("sp,ac", [(False, "none"), (True, "none"), (True, "full")])
def test_tp_bytes_of_mla_and_mtp_equal_the_books(pools, sp, ac):
    """MLA's replicated latent projections and norms, the MTP module's blocks, projection and second
    head: the planner's formula (plan/cost/volume.py) is what Comm books, call for call and byte for byte."""
    cfg = make_config(**DSV3, parallel__tp=2, parallel__sp=sp, training__ac=ac)
    lay = build_layout(cfg, 2)
    want = tp_step_bytes(model_args(cfg), lay.micro_batch, cfg.data.seq_len, lay.accum, 2, sp, ac, 4, 4)
    assert _books(pools, cfg, 2, "tp") == {k: (2 * c, 2 * b) for k, (c, b) in want.items()}


@pytest.mark.parametrize("impl", ["ring", "ulysses", "allgather"])
def test_cp_bytes_of_mla_equal_the_books(pools, impl):
    """MLA's keys (heads × (nope + rope)) and values (zero-padded to the key's width under ring and
    all-gather; Ulysses moves them as they are), the MTP loss's gathered targets."""
    cfg = make_config(**DSV3, parallel__cp=2, parallel__cp_impl=impl)
    lay = build_layout(cfg, 2)
    want = cp_step_bytes(model_args(cfg), lay.micro_batch, cfg.data.seq_len, lay.accum, 2, impl, 1, "none", 4)
    got = _books(pools, cfg, 2, "cp")
    assert {k: got[k] for k in want} == {k: (2 * c, 2 * b) for k, (c, b) in want.items()}


def test_ep_dispatch_and_bias_bytes_equal_the_books(pools):
    """Each routed copy goes out and back (forward and backward): top_k copies per token whatever the
    group limit (copies bound for one rank are not merged); the bias update's one all-reduce a step."""
    cfg = make_config(**DSV3, parallel__dp=2, parallel__ep=2)
    lay = build_layout(cfg, 2)
    a = model_args(cfg)
    want = ep_step_bytes(a, lay.micro_batch * cfg.data.seq_len, lay.accum, "none", 4)["all_to_all"]
    ranks = [r["all_to_all"] for r in pools(2).run(comm_task, C.to_dict(cfg), 2, "ep")]
    assert [calls for calls, _ in ranks] == [2 * want[0]] * 2
    # a rank books what it sends: the combine sends what its experts got, so the mean over ranks is exact
    assert sum(b for _, b in ranks) == 2 * 2 * want[1]
    assert ranks[0][1] != ranks[1][1]  # and the routing really was uneven, so the sum above is a check
    # the update's all-reduce spans the island (the world's group, booked apart: distributed/mesh.py)
    world = _books(pools, cfg, 2, "island")["all_reduce"]
    no_bias = _books(pools, make_config(**DSV3, parallel__dp=2, parallel__ep=2, model__moe__bias_update_rate=0.0),
                     2, "island")["all_reduce"]
    assert (world[0] - no_bias[0], world[1] - no_bias[1]) == (2, 2 * 2 * moe_bias_bytes(a))  # one a step


STATE = [("one-process", 1, {}), ("dp2-ep2-zero3", 2, {"parallel__dp": 2, "parallel__ep": 2, "parallel__zero": 3}),
         ("tp2", 2, {"parallel__tp": 2})]


@pytest.mark.parametrize("name,world,overrides", STATE, ids=[c[0] for c in STATE])
def test_state_bytes_of_dsv3_match_measured(pools, name, world, overrides):
    """Parameters, gradients and optimizer state per rank (MLA's replicated latents, the MTP module and
    the embedding it calls) as the trainer measures them from live tensors, within 2%."""
    cfg = make_config(**DSV3, **overrides)
    recs = run_local(cfg) if world == 1 else run_layout(pools, cfg, world)
    pred = predicted(cfg, world)
    for key in ("params", "grads", "optim"):
        assert recs[-1]["mem"][key] == pytest.approx(pred[key], rel=0.02), (key, recs[-1]["mem"][key], pred[key])


ACTS = [(1, 1, False, "ring", "none"), (1, 1, False, "ring", "selective"), (1, 1, False, "ring", "full"),
        (2, 1, True, "ring", "none"), (1, 2, False, "ring", "none"), (1, 2, False, "ulysses", "none")]
# -4.2%: the routed experts keep 3 SwiGLU tensors per copy under selective, not 4 (counted here: 13 of
# [256, 32] against 16 without AC, the MTP block keeping its 4), which the planner priced until issue 61
# item 4; that over-count hid 131,072 B more that MLA's checkpointed core keeps under selective (one
# tensor of heads × v_head_dim per token and block), not identified yet, so not priced
_MLA_SELECTIVE = pytest.mark.xfail(strict=True, reason="MLA's checkpointed core keeps one heads × v_head_dim "
                                   "tensor per token more than priced (unidentified): -4.2%")


def _acts():
    return [pytest.param(*r, id=f"tp{r[0]}{'-sp' if r[2] else ''}-cp{r[1]}-{r[3]}-{r[4]}",
                         marks=[_MLA_SELECTIVE] if r[4] == "selective" else []) for r in ACTS]


@pytest.mark.parametrize("tp,cp,sp,impl,ac", _acts())
def test_activation_bytes_of_dsv3_match_measured(pools, tp, cp, sp, impl, ac):
    """What autograd keeps in one micro-batch's forward and loss (MLA's latents and expanded heads, the
    routed copies, the MTP block, its second head and loss), against the planner, within 3%."""
    cfg = make_config(**DSV3, parallel__tp=tp, parallel__sp=sp, parallel__cp=cp, parallel__cp_impl=impl,
                      training__ac=ac, data__seq_len=64)
    world = tp * cp
    measured = activation_task(C.to_dict(cfg)) if world == 1 else pools(world).run(activation_task, C.to_dict(cfg))[0]
    code = code_options(priced_on(cfg, gpu=False))
    # the CPU's fused SDPA kernel needs one head size for q, k and v: MLA's (qk 32, v 16) takes the
    # math path, which keeps the probabilities (fp32 here)
    o = Options(attn_mask=code["attn_mask"], attn_impl=code["attn_impl"], flash=False, attn_math_bytes=4)
    pred = estimate(shape_from_config(cfg), spec_from_config(cfg, world), o=o)["per_gpu"]["activations"]
    print(f"tp{tp} cp{cp} {impl} {ac}: measured {measured} B, planned {pred:.0f} B ({measured / pred:.3f})")
    assert measured == pytest.approx(pred, rel=0.03)


@pytest.mark.slowest
def test_plan_deepseek_v3_on_1024_h100s_finds_a_layout_that_fits():
    """Issue #49's check: the search over every layout of DeepSeek-V3 on 1,024 H100s (about 8.4 M
    candidates; 44 s on two cores, the degrees dealt out to a forked worker per core) ranks fitting
    layouts that use expert parallelism, and its first is what `meshlm estimate` prices it at."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "meshlm.cli", "plan", "--model", "deepseek-v3", "--gpu", "h100",
                          "--gpus", "1024", "--seq-len", "4096", "--global-batch-tokens", str(3840 * 4096),
                          "--top", "3", "--json"], capture_output=True, text=True, timeout=600)
    print(f"meshlm plan deepseek-v3 on 1024 H100s: {time.perf_counter() - t0:.1f} s")
    assert out.returncode == 0, out.stderr
    ranked = json.loads(out.stdout)
    assert len(ranked) == 3
    for r in ranked:
        assert r["fits"] and r["per_gpu"]["total"] <= 80e9 and r["layout"]["ep"] > 1, r["layout"]
    assert ranked[0]["step_s"] <= ranked[-1]["step_s"]


def test_forked_search_ranks_what_the_serial_one_does():
    """The degrees dealt out to forked workers give the serial search's ranking and tallies. Run as a
    user runs it, in a fresh single-threaded `meshlm plan` (the search forks only where no other thread
    is running: under this test process's pools it searches alone)."""
    def run(workers: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "meshlm.cli", "plan", "--model", "deepseek-v2-lite", "--gpu",
                              "h100", "--gpus", "32", "--seq-len", "4096", "--global-batch-tokens", str(256 * 4096),
                              "--fix", "tp=1", "--top", "5"], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, MESHLM_PLAN_WORKERS=workers))
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    serial, forked = run("1"), run("2")
    assert "(2 processes)" in forked[1] and "processes" not in serial[1]
    # "searched N layouts in T s (2 processes): F fit, M out of memory, I invalid; D dominated", then the table
    strip = lambda line: re.sub(r" in [\d.]+ s( \(\d processes\))?", "", line)  # noqa: E731
    assert [strip(x) for x in serial[1:8]] == [strip(x) for x in forked[1:8]]
