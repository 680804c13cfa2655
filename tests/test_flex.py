"""model.attn_impl = "flex" (model/flex.py): FlexAttention with a block mask gives SDPA's outputs and
gradients under the dense document mask (grouped-query heads included), and one block mask per forward
serves every block. Training equivalence in the layouts: tests/test_data_layouts.py (flex rows)."""
import dataclasses

import pytest
import torch

import meshlm.model.llama as llama
from meshlm.core.model_args import PRESETS

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


def _dense_blocks(bm):
    """A BlockMask's [B, nq, nkv] maps of partial and full key blocks (head 0)."""
    def dense(num, idx):
        n = idx.shape[-1]
        keep = torch.arange(n)[None, None, :] < num[..., None].long()
        out = torch.zeros(*idx.shape, dtype=torch.bool)
        return out.scatter_(-1, idx.long(), keep)[:, 0]
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


@pytest.mark.parametrize("seq,cp,doc", [(512, 1, 0), (512, 1, 128), (1024, 2, 0), (1024, 2, 256), (2048, 4, 384),
                                        (1024, 4, 0), (300, 1, 100), (640, 2, 96), (40, 1, 7)])
def test_block_mask_from_bounds_equals_torchs_and_the_planners_count(seq, cp, doc):
    """The block map built from block bounds (never the [B, rows, keys] mask) is the one torch's
    create_block_mask derives from the full mask, for contiguous rows and all-gather CP's zig-zag
    rows, causal and packed documents, short last blocks included (a superset where a query block
    spans two zig-zag chunks); and the blocks kept over every CP rank are the planner's
    ops.causal_blocks, so flex is priced for the work it does."""
    from torch.nn.attention.flex_attention import create_block_mask

    from meshlm.parallel.dims.context_parallel import CPSplit
    from meshlm.plan.cost.ops import causal_blocks
    docs = (torch.arange(seq) // doc)[None].expand(2, seq).contiguous() if doc else None
    kept = 0
    for rank in range(cp):
        rows = CPSplit(cp, rank, True).positions(seq // cp) if cp > 1 else None
        mine = llama.flex_block_mask(docs, seq // cp, "cpu", rows, seq)
        p = rows if rows is not None else torch.arange(seq)
        mod = (lambda b, h, q, k: p[q] >= k) if docs is None else \
            (lambda b, h, q, k: (p[q] >= k) & (docs[b, p[q]] == docs[b, k]))
        ref = create_block_mask(mod, None if docs is None else 2, None, seq // cp, seq, device="cpu")
        (mp, mf), (rp, rf) = _dense_blocks(mine), _dense_blocks(ref)
        if cp == 1 or seq // (2 * cp) % 128 == 0:  # query blocks inside one zig-zag chunk: the same map
            assert torch.equal(mp, rp) and torch.equal(mf, rf), rank
        else:  # a query block across two chunks: bounds keep a superset (the mask function decides)
            assert not ((rp | rf) & ~(mp | mf)).any() and not (mf & ~rf).any(), rank
        assert mine.seq_lengths == (seq // cp, seq)
        kept += int((mp | mf)[0].sum())
    if seq % (256 * cp) == 0:  # whole blocks in each zig-zag chunk: the planner's count
        assert kept == causal_blocks(seq, doc)


def test_block_mask_never_builds_the_full_mask(monkeypatch):
    """At all-gather CP's long-context shape (8K rows of 128K keys, documents) the mask is built from
    block bounds only: torch's full-mask path is never called, and its index tensors hold one entry
    per 128x128 block (16,384x fewer than rows x keys) at either of two sizes 10x apart."""
    import torch.nn.attention.flex_attention as fa

    from meshlm.parallel.dims.context_parallel import CPSplit

    def refuse(*a, **k):
        raise AssertionError("the full mask was built")
    monkeypatch.setattr(fa, "create_mask", refuse)
    for seq in (12288, 122880):
        docs = (torch.arange(seq) // 4096)[None]
        rows = CPSplit(16, 3, True).positions(seq // 16)
        bm = llama.flex_block_mask(docs, seq // 16, "cpu", rows, seq)
        assert bm.seq_lengths == (seq // 16, seq)
        assert bm.kv_indices.numel() == -(-seq // 16 // 128) * (seq // 128)
        assert 0 < int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) < bm.kv_indices.numel() // 4


def test_masks_for_every_row_cover_the_whole_sequence():
    """Under Ulysses (ModelArgs.mask_rows = "all") the model's mask covers every query of the whole
    sequence, though it holds only its chunk of tokens; under all-gather ("local") this rank's rows at
    their positions; without documents, under either, the CP core masks causal attention itself and
    the model builds none (without CP, "own", flex gets its causal BlockMask)."""
    docs = (torch.arange(64) // 20)[None]
    local = torch.arange(16, 32)
    full = llama.attention_mask("sdpa", docs, 16, "cpu", local, "all")
    assert full.shape == (1, 1, 64, 64) and torch.equal(full, llama.document_mask(docs))
    rows = llama.attention_mask("sdpa", docs, 16, "cpu", local, "local")
    assert rows.shape == (1, 1, 16, 64) and torch.equal(rows, full[:, :, 16:32])
    bm = llama.attention_mask("flex", docs, 16, "cpu", local, "all")
    assert bm.seq_lengths == (64, 64)
    assert llama.attention_mask("flex", docs, 16, "cpu", local, "local").seq_lengths == (16, 64)
    for rows in ("all", "local"):
        assert llama.attention_mask("flex", None, 16, "cpu", local, rows) is None
    assert llama.attention_mask("flex", None, 16, "cpu").seq_lengths == (16, 16)
