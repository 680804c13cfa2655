"""Context parallelism (issue #12): the attention cores against full attention, the zig-zag load
balance, positions, bytes against the formula, composition rows, bad input, checkpoints. The
headline equivalence rows (cp2/cp4 ring and Ulysses, with dp/ZeRO-3, TP+SP, PP, 8 ranks) are in
test_equivalence.py."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from harness import assert_layout_losses, make_config, rows, run_layout, run_local
from test_tp import comm_task

from meshlm.core import config as C
from meshlm.core.config import ConfigError
from harness import build_layout
from meshlm.core.config.model import model_args
from meshlm.parallel.dims.context_parallel import CPSplit, PlainKernel, RingCounter
from meshlm.plan.cost.volume import cp_step_bytes as expected_bytes

FP32 = 1e-5
COMPILED = 1e-4  # inductor fuses the block's element-wise ops differently from eager: measured ~1e-6


def _context(cfg):
    from meshlm.distributed.mesh import init_context, pick_device
    layout = build_layout(cfg, int(os.environ["WORLD_SIZE"]))
    return layout, init_context(layout.shape(), pick_device("cpu"), timeout_s=120)


# -- pool tasks (module level so workers can unpickle them) ------------------------------------

def attention_task(impl: str, heads: int, kv_heads: int, seq: int, seed: int):
    """This rank's output and q/k/v gradients of the CP core vs full causal SDPA, and the work count."""
    from meshlm.model.llama import AttentionCore
    from meshlm.parallel.dims.context_parallel import RingAttentionCore, UlyssesAttentionCore, cp_split
    from meshlm.parallel.dims.cp_allgather import AllGatherAttentionCore, CausalRows
    world = int(os.environ["WORLD_SIZE"])
    impl, flex = impl.split("-")[0], impl.endswith("-flex")  # allgather-flex: its causal rows a BlockMask
    _, ctx = _context(make_config(parallel__cp=world, parallel__cp_impl=impl, data__seq_len=seq))
    comm = ctx.comm("cp")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=g) for _ in range(2))
    dout = torch.randn(2, heads, seq, 8, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=kv_heads != heads)
    ref.backward(dout)
    split = cp_split(comm, impl)
    mine = [split.take(t, 2).requires_grad_() for t in (q, k, v)]
    counter = RingCounter()
    core = (RingAttentionCore(comm, counter=counter) if impl == "ring" else
            UlyssesAttentionCore(comm, AttentionCore()) if impl == "ulysses" else
            AllGatherAttentionCore(comm, AttentionCore(), CausalRows(split, flex)))
    out = core(*mine)
    out.backward(split.take(dout, 2))
    errs = [float((out - split.take(ref, 2)).abs().max())]
    errs += [float((m.grad - split.take(f.grad, 2)).abs().max()) for m, f in zip(mine, full)]
    return errs, (counter.calls, counter.pairs)


# -- the cores ----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl,world,heads,kv", [("ring", 2, 4, 4), ("ring", 4, 4, 2), ("ring", 4, 4, 1),
                                                 ("ulysses", 2, 4, 4), ("ulysses", 4, 4, 2),
                                                 ("ulysses", 4, 8, 1), ("allgather", 2, 4, 2),
                                                 ("allgather", 4, 4, 1), ("allgather-flex", 2, 4, 2),
                                                 ("allgather-flex", 4, 4, 1)])
def test_core_matches_full_attention(pools, impl, world, heads, kv):
    res = pools(world).run(attention_task, impl, heads, kv, 32, 7)
    for rank, (errs, _) in enumerate(res):
        assert max(errs) < 1e-5, (rank, errs)


def test_ring_work_is_balanced_by_the_zigzag_split(pools):
    """Every rank computes the same number of q·k pairs (and block calls): the causal half of its own
    two chunks, then 2n² per step. A contiguous split would give rank i (2i+1)·m²/2 pairs for chunk m."""
    c, seq = 4, 64
    res = pools(c).run(attention_task, "ring", 4, 4, seq, 3)
    calls = [r[1][0] for r in res]
    pairs = [r[1][1] for r in res]
    n = seq // (2 * c)
    assert len(set(calls)) == 1 and calls[0] == c
    assert max(pairs) - min(pairs) <= n * n, pairs  # equal within one block (here: exactly)
    assert max(pairs) == min(pairs)
    # all ranks together computed exactly the visible half of the full causal matrix
    assert sum(pairs) == seq * (seq + 1) // 2  # no fully masked block computed
    m = seq // c
    contiguous = [m * m * i + m * (m + 1) // 2 for i in range(c)]
    print(f"q·k pairs per rank, zig-zag {pairs}; contiguous would be {contiguous}")
    assert max(contiguous) - min(contiguous) > n * n  # what the zig-zag fixes


def test_plain_block_kernel_matches_autograd():
    """The per-block forward returns the log-sum-exp; the backward from the merged output equals
    autograd through softmax, also for a block that is only part of the keys (the ring's case)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 10, 8, generator=g, requires_grad=True)
    kern, scale = PlainKernel(), 8 ** -0.5
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    # two key blocks merged by their log-sum-exps, then each block's backward with the merged ones
    (o1, l1), (o2, l2) = kern.forward(q, k[:, :, :4], v[:, :, :4], False, scale), kern.forward(q, k[:, :, 4:], v[:, :, 4:], False, scale)
    lse = torch.logaddexp(l1, l2)
    out = o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)
    assert torch.allclose(out, ref, atol=1e-6)
    g1 = kern.backward(dout, q, k[:, :, :4], v[:, :, :4], out, lse, False, scale)
    g2 = kern.backward(dout, q, k[:, :, 4:], v[:, :, 4:], out, lse, False, scale)
    assert torch.allclose(g1[0] + g2[0], q.grad, atol=1e-5)
    assert torch.allclose(torch.cat([g1[1], g2[1]], 2), k.grad, atol=1e-5)
    assert torch.allclose(torch.cat([g1[2], g2[2]], 2), v.grad, atol=1e-5)


def test_split_and_positions():
    x = torch.arange(16).view(1, 16)
    got = [CPSplit(2, r, True).take(x) for r in range(2)]
    assert got[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and got[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for r in range(2):  # a token's position is its index in the full sequence
        assert CPSplit(2, r, True).positions(8).tolist() == got[r][0].tolist()
        assert CPSplit(2, r, False).positions(8).tolist() == CPSplit(2, r, False).take(x)[0].tolist()


# -- bytes ----------------------------------------------------------------------------------------

BYTES_CASES = [
    (2, {"parallel__cp": 2}),
    (4, {"parallel__cp": 4, "model__n_kv_heads": 2}),
    (2, {"parallel__cp": 2, "training__ac": "full"}),
    (2, {"parallel__cp": 2, "training__precision": "bf16"}),
    (2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses"}),
    (4, {"parallel__cp": 4, "parallel__cp_impl": "ulysses", "model__n_kv_heads": 2}),
    (2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses", "training__ac": "full"}),
    (4, {"parallel__cp": 2, "parallel__tp": 2, "parallel__sp": True}),
    (2, {"parallel__cp": 2, "parallel__cp_impl": "allgather", "model__n_kv_heads": 2}),
    (4, {"parallel__cp": 4, "parallel__cp_impl": "allgather", "model__n_kv_heads": 1, "training__ac": "full"}),
    (2, {"parallel__cp": 2, "parallel__cp_impl": "allgather", "training__precision": "bf16"}),
    (4, {"parallel__cp": 2, "parallel__tp": 2, "parallel__sp": True, "parallel__cp_impl": "allgather"}),
]


@pytest.mark.parametrize("world,overrides", BYTES_CASES, ids=[str(i) for i in range(len(BYTES_CASES))])
def test_cp_bytes_match_theory(pools, world, overrides):
    cfg = make_config(**overrides)
    layout = build_layout(cfg, world)
    e = 4 if cfg.training.precision == "fp32" else 2
    want = expected_bytes(model_args(cfg), layout.micro_batch, cfg.data.seq_len, layout.accum, layout.cp,
                          cfg.parallel.cp_impl, layout.tp, cfg.training.ac, act_bytes=e)
    got = pools(world).run(comm_task, C.to_dict(cfg), 2, "cp")[0]
    assert got == {k: (2 * c, 2 * b) for k, (c, b) in want.items()}


# -- composition ------------------------------------------------------------------------------

FLEX = {"model__attn_impl": "flex"}  # "auto" is SDPA on a CPU: rows that prove flex name it
ROWS = [
    ("cp2-ac-full", 2, {"parallel__cp": 2, "training__ac": "full"}),
    ("cp2-ac-selective", 2, {"parallel__cp": 2, "training__ac": "selective"}),
    ("cp2-ulysses-ac-selective", 2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses", "training__ac": "selective"}),
    ("cp2-gqa-kv1", 2, {"parallel__cp": 2, "model__n_kv_heads": 1}),
    ("cp2-ulysses-kv1", 2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses", "model__n_kv_heads": 1}),
    ("cp2-accum", 2, {"parallel__cp": 2, "training__micro_batch": 1}),
    ("dp2-cp2", 4, {"parallel__dp": 2, "parallel__cp": 2}),
    ("dp2-cp2-zero1", 4, {"parallel__dp": 2, "parallel__cp": 2, "parallel__zero": 1}),
    ("cp2-zero2", 2, {"parallel__cp": 2, "parallel__zero": 2}),
    ("hsdp-dp2g1-cp2-zero3", 4, {"parallel__dp": 2, "parallel__zero_group": 1, "parallel__cp": 2, "parallel__zero": 3}),
    ("cp2-tp2", 4, {"parallel__cp": 2, "parallel__tp": 2}),
    ("cp2-tp2-sp-ulysses", 4, {"parallel__cp": 2, "parallel__tp": 2, "parallel__sp": True, "parallel__cp_impl": "ulysses"}),
    ("pp2-cp2-gpipe", 4, {"parallel__pp": 2, "parallel__cp": 2, "parallel__pp_schedule": "gpipe"}),
    ("pp2-cp2-zb-h1", 4, {"parallel__pp": 2, "parallel__cp": 2, "parallel__pp_schedule": "zb-h1"}),
    ("pp2-cp2-interleaved", 4, {"parallel__pp": 2, "parallel__cp": 2, "parallel__pp_schedule": "interleaved",
                                "parallel__pp_virtual": 2, "model__n_layers": 4}),  # 4 stages: 4 blocks
    ("pp2-cp2-tied-ulysses", 4, {"parallel__pp": 2, "parallel__cp": 2, "parallel__cp_impl": "ulysses",
                                 "model__tie_embeddings": True}),
    ("cp2-allgather-gqa", 2, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "allgather", "model__n_kv_heads": 2}),
    # all-gather rows run flex (pinned: "auto" is SDPA on a CPU, flex on CUDA); "-sdpa" rows hand SDPA the
    # dense causal rows instead
    ("cp4-allgather-kv1-ac-selective-sdpa", 4, {"parallel__cp": 4, "parallel__cp_impl": "allgather",
                                                "model__n_kv_heads": 1, "training__ac": "selective",
                                                "model__attn_impl": "sdpa"}),
    ("cp2-allgather-ac-full-accum", 2, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                        "training__ac": "full",
                                        "training__micro_batch": 1}),
    ("dp2-cp2-allgather-zero3", 4, {**FLEX, "parallel__dp": 2, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                    "parallel__zero": 3}),
    ("cp2-tp2-sp-allgather", 4, {**FLEX, "parallel__cp": 2, "parallel__tp": 2, "parallel__sp": True,
                                 "parallel__cp_impl": "allgather"}),
    ("pp2-cp2-allgather-interleaved-sdpa", 4, {"parallel__pp": 2, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                               "parallel__pp_schedule": "interleaved", "parallel__pp_virtual": 2,
                                               "model__attn_impl": "sdpa", "model__n_layers": 4}),
    ("pp2-cp2-allgather-zb-h1", 4, {**FLEX, "parallel__pp": 2, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                    "parallel__pp_schedule": "zb-h1"}),
    ("cp2-allgather-bf16", 2, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                               "training__precision": "bf16"}),
    ("cp2-allgather-bf16-sdpa", 2, {"parallel__cp": 2, "parallel__cp_impl": "allgather",
                                    "training__precision": "bf16", "model__attn_impl": "sdpa"}),
    ("cp2-allgather-compile", 2, {**FLEX, "parallel__cp": 2, "parallel__cp_impl": "allgather",
                                  "training__compile": True,
                                  "training__steps": 4}),
    ("cp2-bf16", 2, {"parallel__cp": 2, "training__precision": "bf16"}),
    ("cp2-ulysses-bf16", 2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses", "training__precision": "bf16"}),
    ("cp2-compile", 2, {"parallel__cp": 2, "training__compile": True, "training__steps": 4}),
    ("cp2-ulysses-compile", 2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses", "training__compile": True,
                                "training__steps": 4}),
]


@pytest.mark.parametrize("name,world,overrides", rows(ROWS))
def test_cp_layout_matches_one_process(pools, name, world, overrides):
    # the one-process reference runs SDPA's causal kernel whatever kernel the layout pins (as before auto
    # became sdpa on a CPU): a bf16 flex reference and its twin drift past harness.HALF under AVX2 kernels
    single = {k: v for k, v in overrides.items() if not k.startswith("parallel__") and k != "model__attn_impl"}
    got = run_layout(pools, make_config(**overrides), world)
    assert_layout_losses(single, got, COMPILED if "compile" in name else FP32)


def _eval_losses(run_dir: str) -> list[float]:
    import json
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["eval_loss"] for line in f if "eval_loss" in line]


@pytest.mark.parametrize("impl", ["ring", "ulysses", "allgather"])
def test_eval_loss_is_the_full_sequence_mean(pools, impl):
    """The held-out loss (eval batches sized micro_batch × dp: dp = 1 here, as in one process)."""
    from harness import train_case
    over = {"training__steps": 2, "training__eval_every": 2}
    ref_dir, d = tempfile.mkdtemp(prefix="meshlm-ref-"), tempfile.mkdtemp(prefix="meshlm-cpeval-")
    run_local(make_config(**over), ref_dir)
    pools(2).run(train_case, C.to_dict(make_config(parallel__cp=2, parallel__cp_impl=impl, **over)), d)
    ref, got = _eval_losses(ref_dir), _eval_losses(d)
    assert len(got) == len(ref) == 1 and abs(got[0] - ref[0]) <= FP32 * ref[0], (got, ref)


# -- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("world,overrides,msg", [
    (2, {"parallel__cp": 2, "data__seq_len": 30}, "data.seq_len: 30 is not divisible by 4"),
    (4, {"parallel__cp": 4, "parallel__cp_impl": "ulysses", "data__seq_len": 34}, "data.seq_len: 34 is not divisible by 4"),
    (4, {"parallel__cp": 4, "parallel__cp_impl": "ulysses", "model__n_heads": 2, "model__n_kv_heads": 2},
     "parallel.cp: ulysses splits the 2 heads"),
    (4, {"parallel__cp": 4, "parallel__cp_impl": "ulysses", "model__n_heads": 8, "model__n_kv_heads": 8,
         "model__dim": 64} , None),
    (2, {"parallel__cp": 2, "parallel__cp_impl": "ulysses", "model__n_heads": 8, "model__n_kv_heads": 8,
         "model__dim": 64}, None),
    (4, {"parallel__cp": 2, "parallel__tp": 2, "parallel__sp": True, "data__seq_len": 34},
     "data.seq_len: 34 is not divisible by 4"),
    (8, {"parallel__cp": 2, "parallel__tp": 4, "parallel__sp": True, "data__seq_len": 36},
     "parallel.sp: each CP rank's 18 tokens are not divisible by tp 4"),
    (4, {"parallel__cp": 4, "parallel__cp_impl": "ulysses", "model__n_heads": 12, "model__n_kv_heads": 6,
         "model__dim": 96}, "model.n_kv_heads: ulysses needs the 6 kv heads"),
    (2, {"parallel__cp": 2, "parallel__cp_impl": "zigzag"}, "parallel.cp_impl: 'zigzag' is not one of ring, ulysses, allgather"),
    (2, {"parallel__cp": 2, "parallel__cp_impl": "allgather", "data__seq_len": 30}, "data.seq_len: 30 is not divisible by 4"),
])
def test_bad_cp_input_is_refused_in_one_line(world, overrides, msg):
    cfg = make_config(**overrides)
    if msg is None:
        build_layout(cfg, world)  # valid
        return
    with pytest.raises(ConfigError) as e:
        build_layout(cfg, world)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


def test_cli_refuses_bad_cp_before_workers_start(tmp_path, capsys):
    from meshlm.cli import main
    run_dir = tmp_path / "run"
    code = main(["train", "--nproc", "2", "--run-dir", str(run_dir), "--parallel.cp", "2", "--data.seq_len", "30",
                 "--model.preset", "debug"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "data.seq_len: 30 is not divisible by 4" in err.strip().splitlines()[-1]
    assert not (run_dir / "logs").exists()
