"""training.z_loss (parallel/features/z_loss.py): the plain, vocab-parallel and chunked losses give the
same z-loss and gradients (padding excluded), `loss` stays the cross-entropy, the MTP heads get none, and
a tp2 run with z-loss equals one process."""
import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from harness import assert_same_losses, make_config, reference, run_layout
from torch import nn

from meshlm.parallel.compose import cross_entropy, cross_entropy_and_z
from meshlm.parallel.features.chunked_loss import _FNS, LossHead
from meshlm.parallel.features.z_loss import ZLoss
from meshlm.parallel.swap import swap_in

N, D, VOCAB, Z = 48, 16, 61, 3e-2  # 3 padded rows at tp 2 (rows 64 = 2 × 32)


def _inputs(rows: int):
    g = torch.Generator().manual_seed(7)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(rows, D, generator=g) * 0.7
    w[VOCAB:] = 30.0  # padded rows: logits far above the rest, which must not reach the loss or log Z
    return h, w, torch.randint(0, VOCAB, (N,), generator=g)


def _plain(h, w, y, zl):
    """compose.py's loss over whole logits (the real vocabulary cut before the softmax)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    fn = zl.plain(partial(cross_entropy_and_z, vocab=VOCAB))
    loss = fn(F.linear(h, w)[None], y[None])
    loss.backward()
    return loss.detach(), zl.total, h.grad, w.grad


def _chunked(h, w, y, zl, comm=None, start=0, valid=VOCAB):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    head = nn.Linear(D, w.shape[0], bias=False)
    head.weight = nn.Parameter(w)
    lh = swap_in(nn.Sequential(head), head, LossHead, chunks=5, start=start, valid=valid, comm=comm, fns=_FNS,
                 zloss=zl)
    loss = lh(h[None], y[None])
    loss.backward()
    return loss.detach(), zl.total, h.grad, lh.weight.grad


def three_paths_task():
    """On each of 2 ranks: the plain and chunked losses over the whole head, and the vocab-parallel and
    chunked-vocab-parallel ones over this rank's 32 rows; the largest differences from the plain one."""
    from harness import make_config
    from test_tp import _context

    from meshlm.parallel.dims.vocab_parallel import VocabParallelLoss
    from meshlm.parallel.placement import DimSplit
    _, ctx = _context(make_config(parallel__tp=2))
    comm = ctx.comm("tp")
    rows = 64
    h, w, y = _inputs(rows)
    ref, ref_z, ref_gh, ref_gw = _plain(h, w, y, ZLoss(Z))
    lse = F.linear(h, w)[:, :VOCAB].logsumexp(-1)
    want_z = Z * lse.square().mean()
    lo, hi = comm.rank * 32, (comm.rank + 1) * 32
    split = DimSplit(0, VOCAB, rows, 2, comm.rank, "tp")
    out = {"plain_z": float(ref_z), "want_z": float(want_z)}

    def diff(name, loss, z, gh, gw, h_partial):
        if h_partial:  # each rank's input gradient is its rows' share: TP's entry sums it in training
            comm.all_reduce(gh)
        out[name] = (abs(float(loss) - float(ref)) / float(ref), abs(float(z) - float(ref_z)) / float(ref_z),
                     float((gh - ref_gh).abs().max()), float((gw - ref_gw[lo:hi] if gw.shape[0] == 32
                                                                 else gw - ref_gw).abs().max()))
    diff("chunked", *_chunked(h, w, y, ZLoss(Z)), False)
    diff("chunked_tp", *_chunked(h, w[lo:hi], y, ZLoss(Z), comm, split.start, split.real), True)
    hv, wv = h.clone().requires_grad_(), w[lo:hi].clone().requires_grad_()
    zl = ZLoss(Z)
    loss = VocabParallelLoss(comm, split, zl)(F.linear(hv, wv)[None], y[None])
    loss.backward()
    diff("vocab_parallel", loss.detach(), zl.total, hv.grad, wv.grad, True)
    out["ce"] = abs(float(ref) - float(cross_entropy(F.linear(h, w)[None], y[None], VOCAB)))
    out["z_moves_grad"] = float((ref_gh - _plain(h, w, y, ZLoss(0.0))[2]).abs().max())
    return out


def test_plain_vocab_parallel_and_chunked_agree(pools):
    """Values (the cross-entropy and the z term) and gradients within 1e-6, with padded rows whose
    logits would dominate log Z if they were counted."""
    for r in pools(2).run(three_paths_task):
        assert r["ce"] == 0.0  # the returned value is the cross-entropy, bit for bit
        assert abs(r["plain_z"] - r["want_z"]) <= 1e-6 * r["want_z"]  # z · mean log² Z, padding excluded
        assert r["z_moves_grad"] > 1e-4  # the term reaches the gradient
        for path in ("chunked", "chunked_tp", "vocab_parallel"):
            loss_rel, z_rel, gh, gw = r[path]
            assert loss_rel <= 1e-6 and z_rel <= 1e-6, (path, loss_rel, z_rel)
            assert gh <= 1e-6 and gw <= 1e-6, (path, gh, gw)


def test_no_z_loss_outside_training_and_on_mtp_heads():
    """Evaluation (no grad) and the MTP heads (`main_only`) neither add nor record the term."""
    zl = ZLoss(1e-4)
    assert zl.coef == 1e-4
    with zl.main_only():
        assert zl.coef == 0.0
    with torch.no_grad():
        assert zl.coef == 0.0
    h, w, y = _inputs(VOCAB)
    with torch.no_grad():
        fn = zl.plain(partial(cross_entropy_and_z, vocab=VOCAB))
        fn(F.linear(h, w)[None], y[None])
    assert zl.total is None


@pytest.mark.slow
def test_tp2_with_z_loss_equals_one_process(pools):
    """Vocab-parallel z-loss in training: per-step `loss` and `z_loss` within 1e-5 of one process, and
    z-loss changes training (so the row would catch a term left out of the gradient)."""
    over = {"training__z_loss": 1e-2, "training__steps": 6}
    ref = reference(**over)
    got = run_layout(pools, make_config(parallel__tp=2, **over), 2)
    assert_same_losses(ref, got, 1e-5)
    for a, b in zip(ref, got):
        assert a["z_loss"] > 0 and abs(a["z_loss"] - b["z_loss"]) <= 1e-5 * a["z_loss"], (a["step"], a, b)
    plain = reference(training__steps=6)
    assert plain[0]["loss"] == ref[0]["loss"]  # step 1: the same weights, so the same cross-entropy
    assert "z_loss" not in plain[0]
    assert abs(plain[-1]["loss"] - ref[-1]["loss"]) > 1e-6  # the term moved the weights
