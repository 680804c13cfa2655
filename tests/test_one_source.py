"""Issue 48: what a precision holds (choices.HELD) and what a card is (core/cards.py) are written once. No
module re-derives bytes per precision or keeps its own peak table, and the trainer's MFU peak of every
device name is the planner profile's peak, so the two cannot drift apart again."""
from __future__ import annotations

import os
import re
import types

import pytest
import torch

from meshlm.core import cards
from meshlm.core.choices import DTYPE_BYTES, HELD, PRECISIONS, param_dtype
from meshlm.plan import hardware
from meshlm.plan.cost.memory import state_bytes_per_param
from meshlm import preflight
from meshlm.train.observe import metrics

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "meshlm")
# the grep, anywhere in src/; then a byte count chosen by comparing with "fp32" or a dtype -> bytes
# literal, anywhere but the table itself (core/choices.py)
FOUR_IF_FP32 = re.compile(r"4 if .*fp32.* else 2")
INLINE_BYTES = re.compile(r'[!=]= ?"fp32" else (\(|\d+\b(?!\.))|"(fp32|bf16|fp16|fp8)": ?[124]\b')
PEAK_LITERALS = re.compile(r"\b(989|312|2250)e12\b")


def _hits(pattern: re.Pattern, allowed: str = "") -> list[str]:
    out = []
    for root, _, files in os.walk(SRC):
        for f in files:
            path = os.path.join(root, f)
            if not f.endswith(".py") or (allowed and path == os.path.join(SRC, allowed)):
                continue
            with open(path) as fh:
                out += [f"{os.path.relpath(path, SRC)}:{i}: {ln.strip()}" for i, ln in enumerate(fh, 1)
                        if pattern.search(ln)]
    return out


def test_no_module_re_derives_bytes_per_precision():
    assert _hits(FOUR_IF_FP32) == []
    assert _hits(INLINE_BYTES, "core/choices.py") == []


def test_no_module_keeps_its_own_peak_table():
    assert _hits(PEAK_LITERALS, "core/cards.py") == []


def test_held_covers_every_precision_in_its_dtype():
    assert set(HELD) == set(PRECISIONS)
    for p, h in HELD.items():
        assert h.param == h.act == DTYPE_BYTES[param_dtype(p)], p
        assert state_bytes_per_param(p) == (h.param, h.grad, h.optim)
        assert h.master == (param_dtype(p) != "fp32")


# torch.cuda.get_device_name() of real cards, and their total memory
DEVICES = [("NVIDIA H100 80GB HBM3", 85e9), ("NVIDIA H100 PCIe", 85e9), ("NVIDIA H200", 150e9),
           ("NVIDIA A100-SXM4-80GB", 85e9), ("NVIDIA A100-SXM4-40GB", 42e9), ("NVIDIA A100 80GB PCIe", 85e9),
           ("NVIDIA A100-PCIE-40GB", 42e9), ("NVIDIA B200", 192e9)]


def _fake_cuda(monkeypatch, name: str, memory: float) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=memory))
    return torch.device("cuda")


@pytest.mark.parametrize("name,memory", DEVICES, ids=[d[0] for d in DEVICES])
def test_mfu_peak_is_the_planner_profiles(monkeypatch, name, memory):
    device = _fake_cuda(monkeypatch, name, memory)
    peak, label = metrics.device_peak(device)
    assert peak > 0 and label == f"{name} (datasheet bf16)"
    assert preflight.device_profile(device).peak_flops == peak  # what parallel.auto plans with
    logged = hardware.profile_of_device(label)  # what --calibrate reads back from metrics.jsonl
    if logged is not None:
        assert logged == preflight.device_profile(device) and logged.peak_flops == peak
    assert hardware.get_gpu(cards.device_card(name, memory)).peak("fp32") == peak * cards.FP32_RATIO


def test_every_named_card_is_a_profile_at_its_familys_peak():
    named = {c for _, c in cards.DEVICE_NAMES} | set(cards.FAMILY_CARDS.values()) | {"a100-80gb"}
    for c in named:
        gpu = hardware.PROFILES[c]
        assert gpu.peak_flops == cards.PEAK_FLOPS[cards.family(gpu.name)], c


def test_an_unknown_card_has_no_peak_and_no_profile(monkeypatch):
    device = _fake_cuda(monkeypatch, "NVIDIA GeForce RTX 4090", 25e9)
    assert metrics.device_peak(device) == (0.0, "NVIDIA GeForce RTX 4090 (unknown peak; set training.peak_tflops)")
    assert preflight.device_profile(device) is None and hardware.profile_of_device("NVIDIA GeForce RTX 4090") is None
