"""One rank's attention under all-gather context parallelism, on one device, next to the planner.

An all-gather CP rank attends its S/cp zig-zag queries to the whole sequence's S keys
(parallel/dims/cp_allgather.py). Its rows are not contiguous, so even causal attention needs a mask over
them: meshlm runs FlexAttention with a BlockMask over the rows (model.attn_impl = auto / flex) or hands
SDPA a boolean [S/cp, S] mask (attn_impl = sdpa). This script times both kernels at the long-context
shapes CP is for (no collective: the gather is priced apart, and one GPU has no peers), forward and
backward, checks that they give the same output, records the peak memory each adds, and prints the
planner's seconds for each (ops.attention_seconds with the mask kind estimate prices: "flex", or
"rows" / "dense" under sdpa) with measured / predicted (> 1: faster than planned).

    python bench/cp_kernel.py --out cp_kernel.json [--budget-s 420]
    python bench/cp_kernel.py --device cpu --tiny --out /tmp/cp.json   # the plumbing, on a CPU
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def _bench_kernels():
    """bench/kernels.py (the timer, the device and the table), under a name no installed package has."""
    name = "meshlm_bench_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                         "kernels.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(module)
    return sys.modules[name]


K = _bench_kernels()

import torch  # noqa: E402

from meshlm.core.model_args import PRESETS  # noqa: E402
from meshlm.model.flex import flex_attend, flex_block_mask  # noqa: E402
from meshlm.parallel.dims.context_parallel import CPSplit  # noqa: E402
from meshlm.plan.cost import ops  # noqa: E402
from meshlm.plan.spec import Shape  # noqa: E402

# (model, tp, sequence, cp, document length or 0): Llama 3 405B's Table-4 row (TP 8, CP 16 at 131K),
# and llama3-8b at 32K over cp 4 and 131K over cp 16, with and without 8K documents
CASES = (("llama3-405b", 8, 131072, 16, 0), ("llama3-8b", 1, 32768, 4, 0), ("llama3-8b", 1, 131072, 16, 0),
         ("llama3-8b", 1, 131072, 16, 8192))
TINY = (("debug", 1, 64, 2, 0), ("debug", 1, 64, 4, 16))
KERNELS = ("flex", "sdpa")
COLUMNS = [("model", "model", "{}"), ("kernel", "kernel", "{}"), ("H/KV", "heads", "{}"), ("seq", "seq", "{}"),
           ("cp", "cp", "{}"), ("docs", "doc_tokens", "{}"), ("fwd ms", "fwd_ms", "{:.4g}"),
           ("bwd ms", "bwd_ms", "{:.4g}"), ("pred fwd", "pred_fwd_ms", "{:.4g}"),
           ("pred bwd", "pred_bwd_ms", "{:.4g}"), ("f+b ratio", "ratio", "{:.3g}"),
           ("peak MB", "peak_mb", "{:.0f}"), ("max |Δ|", "max_diff", "{:.2g}")]


def tensors(case: tuple, rank: int, device, dtype, batch: int = 1):
    """q of one rank's rows, the whole sequence's k and v, and its documents (None: one document)."""
    name, tp, seq, cp, doc = case
    a = PRESETS[name]
    g = torch.Generator(device="cpu").manual_seed(0)
    heads, kv = a.n_heads // tp, -(-a.n_kv_heads // tp)

    def rand(h, s):
        return torch.randn(batch, h, s, a.head_dim, generator=g).to(device, dtype).requires_grad_()
    q, k, v = rand(heads, seq // cp), rand(kv, seq), rand(kv, seq)
    rows = CPSplit(cp, rank, True).positions(seq // cp, device)
    docs = (torch.arange(seq, device=device) // doc).expand(batch, seq) if doc else None
    return q, k, v, rows, docs


def attend(kernel: str, q, k, v, rows, docs):
    """The all-gather core's call: flex under a BlockMask of the rows, or SDPA under the dense mask."""
    if kernel == "flex":
        return flex_attend(q, k, v, flex_block_mask(docs, q.shape[2], q.device, rows, k.shape[2]))
    keys = torch.arange(k.shape[2], device=q.device)
    mask = rows[:, None] >= keys[None, :]
    if docs is not None:
        mask = (docs[:, None, rows, None] == docs[:, None, None, :]) & mask
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def predicted(case: tuple, kernel: str, gpu, precision: str, batch: int = 1) -> tuple[float, float]:
    """The planner's (forward, backward) seconds of this call (ops.attention_seconds)."""
    name, tp, seq, cp, doc = case
    a = PRESETS[name]
    kind = "flex" if kernel == "flex" else "dense" if doc else "rows"
    tokens = batch * seq / cp
    w = ops.StageWork(shape=Shape(a, name), tp=tp, sp=False, ep=1, seq_len=seq, cp=cp, layers=1, head=False,
                      tokens=tokens, ac="none", precision=precision, compiled=True, attn_mask=kind, doc_tokens=doc)
    full = 4.0 * tokens * seq * a.head_dim * (a.n_heads // tp)
    return ops.attention_seconds(w, gpu, gpu.peak(precision), full, seq / cp, None)


def row(b, case: tuple, kernel: str, precision: str, ref: dict) -> dict:
    dev = b.device
    q, k, v, rows, docs = tensors(case, 1, dev, K.DTYPES[precision])
    if kernel == "flex" and dev.type == "cuda":
        torch._dynamo.reset()  # a fresh compile per shape: no recompile limit falls back to eager flex
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    fwd_s = b.time(lambda: attend(kernel, q, k, v, rows, docs))
    out = attend(kernel, q, k, v, rows, docs)
    go = torch.ones_like(out)
    bwd_s = b.time(lambda: torch.autograd.grad(out, (q, k, v), go, retain_graph=True))
    peak = (torch.cuda.max_memory_allocated(dev) - base) / 1e6 if dev.type == "cuda" else None
    pf, pb = predicted(case, kernel, b.gpu, precision)
    name, tp, seq, cp, doc = case
    r = dict(model=name, kernel=kernel, heads=f"{q.shape[1]}/{k.shape[1]}", seq=seq, cp=cp, doc_tokens=doc,
             fwd_ms=fwd_s * 1e3, bwd_ms=bwd_s * 1e3, pred_fwd_ms=pf * 1e3, pred_bwd_ms=pb * 1e3,
             ratio=(pf + pb) / (fwd_s + bwd_s), peak_mb=peak)
    key = case
    if key in ref:  # the same call under the other kernel: outputs agree
        r["max_diff"] = float((out.detach().float() - ref[key]).abs().max())
    else:
        ref[key] = out.detach().float()
    return r


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU plumbing test)")
    p.add_argument("--out", default="")
    p.add_argument("--gpu", default="", help="planner profile (default: the device's; h100 on a CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-measure-s", type=float, default=2.0)
    p.add_argument("--budget-s", type=float, default=420.0)
    a = p.parse_args(argv)
    if a.device == "cpu" and not a.tiny:
        p.exit(2, "bench/cp_kernel.py: --device cpu: only the --tiny shapes run on a CPU\n")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "bench/cp_kernel.py: --device cuda: no CUDA device here (--device cpu --tiny)\n")
    if a.reps < 1 or a.warmup < 0 or a.budget_s <= 0:
        p.exit(2, "bench/cp_kernel.py: --reps must be >= 1, --warmup >= 0, --budget-s > 0\n")
    a.sections, a.no_fp8 = [], True  # what kernels.Bench reads besides the timing keys
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    info = K.device_info(device)
    b = K.Bench(a, device, K.planner_gpu(a, info), info)
    b.out = dict(b.out, cp_attention=[])
    precision = "fp32" if a.tiny else "bf16"
    ref: dict = {}
    print(f"torch {info['torch']} on {info['name']}; planner profile {b.gpu.name}")
    b.run("cp_attention", [(f"{k} {c}", lambda c=c, k=k: row(b, c, k, precision, ref))
                           for c in (TINY if a.tiny else CASES) for k in KERNELS], COLUMNS)
    b.save()
    return b.out


if __name__ == "__main__":
    main()
