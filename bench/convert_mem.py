"""Benchmark (not a test): peak resident memory of `meshlm convert` against the largest tensor.

A random transformers Llama (fp32 safetensors, written tensor by tensor, so building it never holds the
model either) is converted `--from-hf` into a meshlm checkpoint, then exported `--to-hf` in fp32 and
bf16. Each conversion is `meshlm convert` (cli.main) in a fresh process that first converts a tiny model (so every import and
lazily built table is in place), then resets its peak RSS (`/proc/self/clear_refs` 5) and reads its
resident set; after the conversion VmHWM - that baseline is the memory the conversion added. Streaming
means that stays about one tensor: the ratio to the largest tensor (fp32, its bytes in the checkpoint)
is printed per direction.

    python bench/convert_mem.py [--dim 2048 --n-layers 4 --ffn-dim 5632 --vocab 32000] [--code SRC] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, os, sys, tempfile
from meshlm.cli import main

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

def convert(kind, src, out, dtype):
    argv = ["convert", "--from-hf", src, "--out", out] if kind == "from_hf" else \
           ["convert", "--to-hf", src, "--out", out, "--dtype", dtype]
    assert main(argv) == 0, argv

kind, src, out, dtype, tiny = sys.argv[1:6]
warm = tempfile.mkdtemp()  # warm-up: imports, DCP's planners, the safetensors reader and writer
convert("from_hf", tiny, os.path.join(warm, "ck"), dtype)
if kind == "to_hf":
    convert("to_hf", os.path.join(warm, "ck"), os.path.join(warm, "hf"), dtype)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
convert(kind, src, out, dtype)
print(json.dumps({"baseline": base, "peak": status("VmHWM")}))
"""


def make_hf(path: str, dim: int, n_layers: int, ffn_dim: int, vocab: int, heads: int = 16, kv_heads: int = 8,
            seed: int = 0) -> int:
    """A random fp32 transformers Llama in `path`, written one tensor at a time; returns the largest
    tensor's bytes."""
    import torch

    from meshlm.model import safetensors_io as st
    from meshlm.core.model_args import ModelArgs
    from meshlm.model.hf import hf_tensors
    from meshlm.core.hf_config import config_for, param_shapes
    args = ModelArgs(dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn_dim,
                     vocab_size=vocab, max_seq_len=256)
    os.makedirs(path, exist_ok=True)
    shapes = param_shapes(args)
    entries = [(k, torch.float32, tuple(v.shape)) for n, s in shapes.items()
               for k, v in hf_tensors(n, torch.empty(s, device="meta"), args).items()]
    g = torch.Generator().manual_seed(seed)
    with st.Writer(os.path.join(path, "model.safetensors"), entries, {"format": "pt"}) as w:
        for name, _, shape in entries:
            w.write(name, torch.randn(shape, generator=g) * 0.02)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_for(args, "float32"), f)
    from tokenizers import Tokenizer, models  # export needs a tokenizer beside a non-byte vocabulary
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(
        os.path.join(path, "tokenizer.json"))
    return max(4 * int(torch.Size(s).numel()) for s in shapes.values())


def measure(kind: str, src: str, out: str, tiny: str, dtype: str = "fp32", code: str = "") -> dict:
    """{baseline, peak} bytes of one conversion in a fresh process (meshlm imported from `code`,
    default this checkout's src/)."""
    env = dict(os.environ, PYTHONPATH=(code or os.path.join(ROOT, "src")) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, src, out, dtype, tiny], capture_output=True,
                          text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(dim: int, n_layers: int, ffn_dim: int, vocab: int, heads: int, kv_heads: int, root: str,
        code: str = "") -> dict:
    hf, tiny = os.path.join(root, "hf"), os.path.join(root, "tiny")
    largest = make_hf(hf, dim, n_layers, ffn_dim, vocab, heads, kv_heads)
    make_hf(tiny, 256, 1, 512, 2048, 4, 2)  # a 2 MiB embedding: the chunked dtype conversion runs once too
    model_bytes = os.path.getsize(os.path.join(hf, "model.safetensors"))
    res = {"model_bytes": model_bytes, "largest_bytes": largest, "runs": {}}
    ck = os.path.join(root, "ck")
    steps = [("from_hf", "from_hf", hf, ck, "fp32"),
             ("to_hf_fp32", "to_hf", ck, os.path.join(root, "out32"), "fp32"),
             ("to_hf_bf16", "to_hf", ck, os.path.join(root, "out16"), "bf16")]
    for name, kind, src, out, dtype in steps:
        m = measure(kind, src, out, tiny, dtype, code)
        above = m["peak"] - m["baseline"]
        res["runs"][name] = {"baseline": m["baseline"], "peak_above": above, "ratio": above / largest}
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--code", default="", help="the meshlm src/ to measure (default this checkout's; "
                   "another checkout's gives a before/after)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="meshlm-convert-mem-")
    try:
        res = run(a.dim, a.n_layers, a.ffn_dim, a.vocab, a.heads, a.kv_heads, root, a.code)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        print(json.dumps(res))
        return
    mib = 1 << 20
    print(f"model {res['model_bytes'] / mib:.0f} MiB fp32, largest tensor {res['largest_bytes'] / mib:.1f} MiB")
    for name, r in res["runs"].items():
        print(f"{name:11s} baseline {r['baseline'] / mib:7.1f} MiB  peak above {r['peak_above'] / mib:7.1f} MiB  "
              f"= {r['ratio']:.3f} x largest")


if __name__ == "__main__":
    main()
