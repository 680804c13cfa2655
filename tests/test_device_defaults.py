"""training.precision / training.compile = "auto": each device's defaults, resolved before any worker
starts (layout.device_defaults), written into config.toml; explicit values win."""
import pytest
import torch

from meshlm import config as C
from meshlm.layout import device_defaults


def _gpu(monkeypatch, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_llama3_1b_on_a_cuda_device_resolves_to_bf16_and_compile(monkeypatch):
    _gpu(monkeypatch)
    cfg = device_defaults(C.load(None, [("model.preset", "llama3-1b")]))  # what `meshlm train` resolves
    assert cfg.training.precision == "bf16" and cfg.training.compile is True
    text = C.to_toml(cfg)
    assert 'precision = "bf16"' in text and "compile = true" in text


def test_a_gpu_without_bf16_keeps_fp32_and_compiles(monkeypatch):
    _gpu(monkeypatch, bf16=False)
    t = device_defaults(C.Config()).training
    assert (t.precision, t.compile) == ("fp32", True)


def test_a_cpu_resolves_to_fp32_eager(monkeypatch):
    _gpu(monkeypatch)  # a GPU in the machine, but the config asks for the CPU
    t = device_defaults(C.load(None, [("training.device", "cpu")])).training
    assert (t.precision, t.compile) == ("fp32", False)


def test_explicit_values_win(monkeypatch):
    _gpu(monkeypatch)
    t = device_defaults(C.load(None, [("training.precision", "fp16"), ("training.compile", "false")])).training
    assert (t.precision, t.compile) == ("fp16", False)


def test_auto_round_trips_through_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(C.to_toml(C.Config()))
    t = C.load(str(path)).training
    assert (t.precision, t.compile) == ("auto", "auto")


@pytest.mark.parametrize("key,value", [("training.compile", "maybe"), ("training.precision", "fp64")])
def test_bad_values_are_one_line(key, value):
    with pytest.raises(C.ConfigError, match=key):
        device_defaults(C.load(None, [(key, value)]))
