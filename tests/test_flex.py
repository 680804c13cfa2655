"""model.attn_impl = "flex" (model/flex.py): FlexAttention with a block mask gives SDPA's outputs and
gradients under the dense document mask (grouped-query heads included), and one block mask per forward
serves every block. Training equivalence in the layouts: tests/test_data_layouts.py (flex rows)."""
import dataclasses

import pytest
import torch

import meshlm.model.llama as llama
from meshlm.model.args import PRESETS

ARGS = dataclasses.replace(PRESETS["debug"], n_kv_heads=2)  # grouped-query: 2 q heads per kv head
# On a CUDA machine the same rows run flex's own compiled backward (a CPU has none: model/flex.py).
DEVICES = ["cpu"] + ["cuda"] * torch.cuda.is_available()


def _pair(device="cpu"):
    torch.manual_seed(0)
    sdpa = llama.Llama(ARGS).to(device)
    flex = llama.Llama(dataclasses.replace(ARGS, attn_kernel="flex")).to(device)
    flex.load_state_dict(sdpa.state_dict())
    return sdpa, flex


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_docs", [True, False])
def test_flex_gives_sdpa_outputs_and_gradients(with_docs, device):
    sdpa, flex = _pair(device)
    x = torch.randint(0, 256, (2, 40), device=device)
    docs = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 40], device=device) if with_docs else None
    outs = []
    for model in (sdpa, flex):
        y = model(x, docs=docs)
        y.square().mean().backward()
        outs.append((y.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ys, gs), (yf, gf) = outs
    assert torch.allclose(yf, ys, atol=1e-5, rtol=1e-5)
    for name, g in gs.items():
        assert torch.allclose(gf[name], g, atol=1e-6, rtol=1e-4), name
    if with_docs:  # the mask matters on this input: unmasked logits differ
        assert not torch.allclose(sdpa(x).detach(), ys, atol=1e-3)


def test_one_block_mask_per_forward(monkeypatch):
    _, flex = _pair()
    built = []
    make = llama.flex_block_mask
    monkeypatch.setattr(llama, "flex_block_mask", lambda *a: built.append(a) or make(*a))
    flex(torch.randint(0, 256, (2, 24)), docs=torch.zeros(2, 24, dtype=torch.long))
    assert len(built) == 1 and ARGS.n_layers > 1
