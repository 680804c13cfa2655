"""training.loss_chunks (parallel/features/chunked_loss.py): the chunked head + cross-entropy equals the plain one
(loss and gradients), never makes or saves a whole [tokens, vocab] tensor, and gives one process's
losses under vocab-parallel TP (with SP too), a zero-bubble pipeline and ZeRO-3 with tied embeddings."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from harness import assert_same_losses, make_config, reference, rows, run_layout, train_in
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshlm.core.config import ConfigError
from harness import build_layout
from meshlm.parallel.features.chunked_loss import _FNS, LossHead
from meshlm.parallel.swap import swap_in

N, D, ROWS, VOCAB = 61, 32, 512, 500  # 12 padded rows, as model.vocab_multiple makes them


def _head_and_input(dtype=torch.float32, n: int = N, d: int = D):
    torch.manual_seed(0)
    head = nn.Linear(d, ROWS, bias=False).to(dtype)
    h = torch.randn(1, n, d, dtype=dtype, requires_grad=True)
    return head, h, torch.randint(0, VOCAB, (1, n))


def _plain(head, h, y):
    return F.cross_entropy(head(h)[..., :VOCAB].flatten(0, 1).float(), y.flatten())


def _loss_head(head, chunks) -> LossHead:
    """The head as parallelize makes it for one process (chunked_loss.head_in_loss)."""
    return swap_in(nn.Sequential(head), head, LossHead, chunks=chunks, start=0, valid=VOCAB, comm=None, fns=_FNS)


def _chunked(head, h, y, chunks):
    return _loss_head(head, chunks)(h, y)


@pytest.mark.parametrize("chunks", [1, 4, 7, N + 5])
def test_chunked_loss_equals_the_plain_loss_and_gradients(chunks):
    head, h, y = _head_and_input()
    ref = _plain(head, h, y)
    ref_grads = torch.autograd.grad(ref, (h, head.weight))
    got = _chunked(head, h, y, chunks)
    grads = torch.autograd.grad(got, (h, head.weight))
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-6, atol=1e-7), (g - r).abs().max()
    assert not grads[1][VOCAB:].any()  # padded rows get no gradient


@pytest.mark.isa  # bf16 logits from this CPU's matmul kernels
def test_chunked_loss_in_bf16_matches_the_plain_loss():
    """16-bit logits: the softmax runs in fp32 either way."""
    head, h, y = _head_and_input(torch.bfloat16)
    ref, got = _plain(head, h, y), _chunked(head, h, y, 4)
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= 1e-3 * abs(ref.item())


class _Allocations(TorchDispatchMode):
    """The largest tensor any op makes (elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _probe(loss_of, n: int) -> tuple[int, int]:
    """(largest tensor made in forward + backward, bytes saved for backward other than the head's
    weight and its input), with few features so that the logits dwarf the weight and its gradient."""
    head, h, y = _head_and_input(n=n, d=8)
    skip = {head.weight.untyped_storage().data_ptr(), h.untyped_storage().data_ptr()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved.append(t.numel() * t.element_size())
        return t

    mode = _Allocations()
    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(head, h, y)
    with mode:
        loss.backward()
    return mode.largest, sum(saved)


def test_chunks_never_make_or_save_the_whole_logits():
    chunks, n = 8, 250
    logits = n * ROWS
    largest, saved = _probe(_plain, n)
    assert largest >= logits and saved >= 4 * logits  # the probe sees what the plain loss holds
    largest, saved = _probe(lambda head, h, y: _chunked(head, h, y, chunks), n)
    assert largest <= -(-n // chunks) * ROWS  # one chunk's logits at a time
    assert saved <= 4 * logits / chunks  # per token: its target and one fp32 log-sum-exp


def test_without_gradients_the_loss_head_gives_the_plain_loss_and_logits():
    head, h, y = _head_and_input()
    with torch.no_grad():
        ref, logits = _plain(head, h, y), head(h)
        got = _chunked(head, h, y, 4)
        assert torch.equal(_loss_head(head, 4)(h), logits)  # called without targets: the logits
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())


CHUNKS = {"training__loss_chunks": 3}
CASES = [
    ("chunks-one-process", 1, {}),
    # vocab 300 at tp 2: 512 rows, rank 1 holds 44 real ones (the max and sums cross the group per chunk)
    ("chunks-tp2-vocab-padded", 2, {"model__vocab_size": 300, "parallel__tp": 2}),
    ("chunks-pp2-zbh1-tied", 2, {"model__tie_embeddings": True, "parallel__pp": 2, "parallel__pp_schedule": "zb-h1"}),
    ("chunks-tp2-sp", 2, {"parallel__tp": 2, "parallel__sp": True}),
    ("chunks-zero3-dp2-tied", 2, {"model__tie_embeddings": True, "parallel__dp": 2, "parallel__zero": 3}),
]


@pytest.mark.parametrize("name,world,overrides", rows(CASES, fast=("chunks-tp2-vocab-padded",)))
def test_chunked_loss_gives_one_process_losses(pools, name, world, overrides):
    ref = reference(**{k: v for k, v in overrides.items() if not k.startswith("parallel__")})
    cfg = make_config(**overrides, **CHUNKS)
    got = reference(**overrides, **CHUNKS) if world == 1 else run_layout(pools, cfg, world)
    assert_same_losses(ref, got, 1e-5)


def _eval_losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["eval_loss"] for r in map(json.loads, f) if "eval_loss" in r]


def test_eval_loss_through_the_loss_head(pools, tmp_path):
    """Evaluation (no gradients) runs the head in the loss too, chunked, under ZeRO-3 which frees the
    head's weight after the head's forward (compared with the same layout's plain loss: the eval
    batch is micro_batch × dp sequences)."""
    over = {"training__eval_every": 5, "training__steps": 5, "parallel__dp": 2, "parallel__zero": 3}
    train_in(pools, make_config(**over), 2, str(tmp_path / "ref"))
    train_in(pools, make_config(**over, **CHUNKS), 2, str(tmp_path / "got"))
    ref, got = _eval_losses(str(tmp_path / "ref")), _eval_losses(str(tmp_path / "got"))
    assert len(ref) == 1 and got == pytest.approx(ref, rel=1e-5)


def test_negative_loss_chunks_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="training.loss_chunks: must be >= 0") as e:
        build_layout(make_config(training__loss_chunks=-1), 1)
    assert "\n" not in str(e.value)
