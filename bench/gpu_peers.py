"""What a user would run instead of meshlm on one GPU: transformers' LlamaForCausalLM in a plain PyTorch
loop, on the shapes and card of bench/gpu.py, printed beside meshlm's row as ratios.

Peers (each in a fresh process, through bench/gpu.py's `attempt`, largest micro-batch that fits first):
- `bf16`: bf16 parameters (no fp32 master), torch.compile of the whole model;
- `autocast`: fp32 parameters under bf16 autocast, compiled;
- `liger`: autocast plus liger-kernel's Llama patches (fused RMSNorm, RoPE, SwiGLU, linear + cross
  entropy), eager (liger's kernels do not compile); CUDA only, skipped where liger-kernel is missing;
- `float8`: the `bf16` peer with torchao's float8 training (tensorwise scales, lm_head left bf16),
  compiled; needs a CUDA GPU with fp8 (compute capability 8.9+), skipped elsewhere.
Every peer: SDPA attention, fused AdamW (decay on >= 2-D tensors, as meshlm), clipping at
`training.clip`, random tokens, loss through the model's own `labels` path.
meshlm's row is bench/gpu.py's measurement on the same shape (its own command line: `--precision`,
`--ac`, and any other bench/gpu.py flags through `--meshlm-args`).
tokens/s from the median step after warm-up; MFU with meshlm's FLOP count (6·N + 12·L·d·seq per
token) against the same peak (`train.metrics.device_peak`); peak = torch's max allocated (CUDA).

    python bench/gpu_peers.py [--presets llama3-1b,llama3-3b] [--seq-len 2048] [--micro-batches 16,8,4]
                              [--peers bf16,autocast,liger,float8] [--ac selective] [--no-meshlm] [--json]
    python bench/gpu_peers.py --device cpu --presets debug --seq-len 32 --micro-batches 2 --steps 2
ratio = meshlm tokens/s / peer tokens/s (> 1: meshlm is faster).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # noqa: E402  (bench/gpu.py: the fresh-process measurement, largest micro-batch first)
import torch  # noqa: E402
from meshlm.core.process import exit_frozen  # noqa: E402

from meshlm.core import config as C  # noqa: E402
from meshlm.distributed.mesh import pick_device  # noqa: E402
from meshlm.core.model_args import PRESETS  # noqa: E402

# peer: (parameter dtype, autocast, compile on CUDA, liger-kernel, torchao float8)
PEERS = {"bf16": ("bf16", False, True, False, False), "autocast": ("fp32", True, True, False, False),
         "liger": ("fp32", True, False, True, False), "float8": ("bf16", False, True, False, True)}


def unavailable(peer: str, device: torch.device) -> str | None:
    """Why `peer` cannot run here (a one-line note), or None."""
    if PEERS[peer][3]:
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (pip install liger-kernel)"
        if device.type != "cuda":
            return "liger-kernel's kernels are Triton (CUDA only)"
    if PEERS[peer][4]:
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not installed (pip install meshlm[gpu])"
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return "float8 matmuls need a CUDA GPU of compute capability 8.9+"
    return None


def hf_model(preset: str, peer: str, device: torch.device):
    """transformers' LlamaForCausalLM for meshlm's preset (meshlm's own config.json export)."""
    import transformers

    from meshlm.core.hf_config import config_for
    dtype, _, _, liger, float8 = PEERS[peer]
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    keys = {k: v for k, v in config_for(PRESETS[preset], "float32").items()
            if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    cfg = transformers.LlamaConfig(**keys, attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.config.use_cache = False
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    return model


def measure_peer(preset: str, mb: int, a, peer: str) -> dict:
    """The `--child` side: train `peer` for warmup + steps steps, one row of the table."""
    from meshlm.parallel.dims.grad_sync import decays
    from meshlm.parallel.optim.adamw import fused_adamw_supported
    from meshlm.train.observe.metrics import device_peak
    device = pick_device(a.device)
    torch.manual_seed(0)
    model = hf_model(preset, peer, device)
    ocfg, clip = C.OptimConfig(), C.TrainingConfig().clip
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if decays(p.shape) == d], "weight_decay": wd}
              for d, wd in ((True, ocfg.weight_decay), (False, 0.0))]
    opt = torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps,
                            fused=fused_adamw_supported(device))
    _, autocast, compile_, _, _ = PEERS[peer]
    run = torch.compile(model) if compile_ and a.compile else model
    vocab = PRESETS[preset].vocab_size
    g = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, vocab, (mb, a.seq_len), device=device, generator=g) for _ in range(4)]
    times, loss = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.steps):
        x = batches[i % len(batches)]
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = run(input_ids=x, labels=x).loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[a.warmup:])
    peak, label = device_peak(device, argparse.Namespace(precision="bf16"))
    flops = PRESETS[preset].flops_per_token(a.seq_len) * mb * a.seq_len
    return {"run": f"peer {peer}", "preset": preset, "seq_len": a.seq_len, "micro_batch": mb, "step_s": step_s,
            "tokens_per_s": mb * a.seq_len / step_s, "tflops": flops / step_s / 1e12,
            "mfu": flops / step_s / peak if peak else 0.0, "peak_label": label,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None,
            "final_loss": float(loss)}


def meshlm_row(preset: str, a) -> dict | None:
    """meshlm's row: bench/gpu.py on the same shape, run as its own command line (its defaults and
    flags apply, `--meshlm-args` adds to them); None if no micro-batch fits."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu.py"),
           "--presets", preset, "--seq-len", str(a.seq_len), "--micro-batches", a.micro_batches,
           "--precision", a.precision, "--ac", a.ac, "--warmup", str(a.warmup), "--steps", str(a.steps),
           "--device", a.device, "--compile" if a.compile else "--no-compile", *shlex.split(a.meshlm_args),
           "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not last.startswith("{"):
        raise RuntimeError(f"meshlm's row failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    row = json.loads(last)["results"][0]
    return None if row.get("fits") is False else row


def print_table(report: dict) -> None:
    print(f"torch {report['torch']}, transformers {report['transformers']}, {report['device']}")
    for note in report["skipped"]:
        print(f"skipped: {note}")
    print("| preset | run | mb | tokens/s | MFU | peak GiB | meshlm / this |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in report["results"]:
        if not r.get("fits", True):
            print(f"| {r['preset']} | {r['run']} | - | does not fit | | | |")
            continue
        peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        print(f"| {r['preset']} | {r['run']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
              f"{100 * r['mfu']:.1f}% | {peak} | {ratio} |")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return gpu.child(sys.argv[2], measure_peer)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama3-1b,llama3-3b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", default="16,8,4,2,1", help="sizes to try, largest first")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"some of {', '.join(PEERS)}")
    ap.add_argument("--precision", default="bf16", help="meshlm's training.precision for its row")
    ap.add_argument("--ac", default="selective", help="meshlm's training.ac for its row")
    ap.add_argument("--meshlm-args", default="", metavar="'ARGS'",
                    help="more bench/gpu.py flags for meshlm's row, e.g. '--loss-chunks 8'")
    ap.add_argument("--no-meshlm", action="store_true", help="peers only (no meshlm row, no ratios)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile (default: on for CUDA)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="", help="also write the JSON report to this file")
    a = ap.parse_args()
    peers = [p for p in a.peers.split(",") if p]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        ap.error(f"--peers: unknown {bad[0]!r} (choose from {', '.join(PEERS)})")
    presets = [p for p in a.presets.split(",") if p]
    if not presets or any(p not in PRESETS for p in presets):
        ap.error(f"--presets: each one of {', '.join(PRESETS)}")
    if min(a.seq_len, a.steps) < 1 or a.warmup < 0:
        ap.error("--seq-len and --steps must be >= 1, --warmup >= 0")
    try:
        sizes = [int(x) for x in a.micro_batches.split(",")]
    except ValueError:
        ap.error(f"--micro-batches wants integers separated by commas, got {a.micro_batches!r}")
    device = pick_device(a.device)
    if a.compile is None:
        a.compile = device.type == "cuda"
    import transformers
    report = {"torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "skipped": [], "results": []}
    runnable = []
    for peer in peers:
        why = unavailable(peer, device)
        if why:
            report["skipped"].append(f"peer {peer}: {why}")
        else:
            runnable.append(peer)
    for preset in presets:
        mine = None
        if not a.no_meshlm:
            mine = meshlm_row(preset, a)
            label = " ".join(["meshlm", a.precision, f"ac={a.ac}", a.meshlm_args]).strip()
            report["results"].append({**mine, "run": label, "ratio": 1.0} if mine
                                     else {"preset": preset, "run": label, "fits": False})
        for peer in runnable:
            r = gpu.largest_fitting(preset, a, sizes, os.path.abspath(__file__), peer=peer)
            if r is None:
                report["results"].append({"preset": preset, "run": f"peer {peer}", "fits": False})
                continue
            r["ratio"] = mine["tokens_per_s"] / r["tokens_per_s"] if mine else None
            report["results"].append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    print_table(report)
    if a.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    exit_frozen(main())  # a child process: its exit need not free torch object by object
