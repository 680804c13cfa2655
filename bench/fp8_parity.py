"""Benchmark (not a test): fp8 loss parity over a real horizon (issue #61; docs/fp8.md, "Loss parity").

A Llama-shaped model (4 blocks, dim 256, 4 heads with 2 kv heads, SwiGLU 704) on a byte-level BPE (vocab
4,096, trained here on the embedded corpus: this interpreter's standard-library code), AdamW at 3e-4 with
100 warm-up steps and a cosine decay, 1,000 steps. bf16 with two seeds (their gap is the noise floor)
against fp8 tensorwise and rowwise on the production path (torchao's Float8Linear through torch._scaled_mm,
training.fp8_emulate off: each run's start-up line is kept in the JSON as the proof). The held-out loss is
the prepared set's validation split (the last tokens of the stream), `--eval-batches` micro-batches, every
`--eval-every` steps and at the end.

Each run is `meshlm train` in a fresh process on one thread, the four at once (the CPU's cores are shared
with other work: a run's speed is not the point, its losses are; two threads per run on a loaded 2-core
host spent more time waiting than computing). Sized (seq 64, batch 8) for ~25-40 min on 2 busy cores.

    python bench/fp8_parity.py [--steps 1000] [--seq 64] [--batch 8] [--threads 1] [--parallel 4]
        [--runs bf16:0 bf16:1 tensorwise:0 rowwise:0] [--set KEY=VALUE ...] [--report] [--gemms FILE]
        [--json bench/results/fp8_parity.json] [--png docs/img/fp8_parity.png]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from data import train_tokenizer  # noqa: E402  (bench/data.py)

MODEL = {"model.preset": "debug", "model.dim": 256, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_dim": 704, "model.tie_embeddings": "false"}
OPTIM = {"optim.lr": 3e-4, "optim.warmup": 100, "optim.min_lr_ratio": 0.1, "optim.schedule": "cosine"}


def corpus(work: str, vocab: int) -> tuple[str, str]:
    """(prepared data dir, tokenizer.json): the embedded corpus's documents (meshlm.data.corpus.code_only of
    each stdlib module) as JSON Lines, a BPE trained on them, the set prepared with it. Cached in `work`."""
    from meshlm.data import prepare
    from meshlm.data.corpus import code_only, stdlib_files
    data, tok = os.path.join(work, f"bpe{vocab}"), os.path.join(work, f"tok{vocab}", "tokenizer.json")
    if os.path.isfile(os.path.join(data, "index.json")):
        return data, tok
    docs = os.path.join(work, "docs.jsonl")
    with open(docs, "w", encoding="utf-8") as f:
        for path in stdlib_files():
            try:
                f.write(json.dumps({"text": code_only(open(path, encoding="utf-8").read())}) + "\n")
            except (SyntaxError, UnicodeDecodeError):
                continue
    train_tokenizer(docs, os.path.dirname(tok), vocab)
    prepare([docs], tok, data, workers=1)
    return data, tok


def launch(run: str, data: str, tok: str, args, work: str) -> tuple[str, str, subprocess.Popen]:
    """Start one `meshlm train` run ("bf16:SEED" or "RECIPE:SEED") on `args.threads` threads."""
    kind, seed = run.split(":")
    run_dir = os.path.join(work, "runs", run.replace(":", "-"))
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    sets = {**MODEL, **OPTIM, "data.path": data, "data.tokenizer": tok, "data.seq_len": args.seq,
            "training.steps": args.steps, "training.global_batch": args.batch, "training.micro_batch": args.batch,
            "model.vocab_size": args.vocab, "training.seed": seed, "training.device": "cpu",
            "training.compile": "false", "training.eval_every": args.eval_every,
            "training.eval_batches": args.eval_batches, "checkpoint.every": 0,
            "training.precision": "bf16" if kind == "bf16" else "fp8"}
    if kind != "bf16":
        sets.update({"training.fp8_recipe": kind, "training.fp8_emulate": "false"})
    cmd = [sys.executable, "-m", "meshlm.cli", "train", "--run-dir", run_dir]
    for k, v in sets.items():
        cmd += [f"--{k}", str(v)]
    for extra in args.set:
        k, v = extra.split("=", 1)
        cmd += [f"--{k}", v]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with open(run_dir + ".stderr", "w") as err:
        return run, run_dir, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)


def collect(run: str, run_dir: str, proc: subprocess.Popen | None, t0: float) -> dict:
    """A run's start-up line (the path it ran), losses and held-out losses; `proc` None: as far as it got."""
    code = proc.wait() if proc is not None else 0
    with open(run_dir + ".stderr") as f:
        log = f.read()
    if code:
        raise SystemExit(f"{run}: meshlm train failed\n{log[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    start = next(line for line in log.splitlines() if line.startswith("meshlm: "))
    took = round(time.perf_counter() - t0, 1) if proc is not None else None
    return {"run": run, "start_line": start, "seconds": took,
            "loss": [[r["step"], r["loss"]] for r in rows if "loss" in r],
            "eval": [[r["step"], r["eval_loss"]] for r in rows if "eval_loss" in r]}


def corpus_batch(data: str, batch: int, seq: int):
    """`batch` rows of seq + 1 tokens from the prepared training split, spread over it."""
    import numpy as np

    from meshlm.data.shards import TokenShards
    shards = TokenShards(data, "train")
    step = (len(shards) - seq - 1) // batch
    return np.stack([shards.get(i * step, seq + 1) for i in range(batch)]).astype(np.int64)


def gemm_errors(data: str, args) -> list[dict]:
    """Where fp8's error enters: for each block linear of the bench's model at initialisation, on one batch
    of the corpus, the three products (output, input gradient, weight gradient) of a float8 copy of it
    against bf16 on the same input and output gradient, relative error in norm, per recipe."""
    import torch
    from torchao.float8 import convert_to_float8_training

    from meshlm.core import config as C
    from meshlm.core.layout import model_args
    from meshlm.model import build_model
    from meshlm.model.init import materialize
    from meshlm.parallel.features.float8 import float8_config
    from meshlm.parallel.model_plans.moe import model_plan_for

    cfg = C.Config()
    for k, v in {**MODEL, "model.vocab_size": args.vocab}.items():
        C.apply(cfg, k, v)
    model = build_model(model_args(cfg))
    materialize(model, 0, "cpu", torch.bfloat16)
    seen: dict[str, list] = {}
    mods = {n: model.get_submodule(n) for n in model_plan_for(model).float8_linears(model)}
    outs: dict[str, torch.Tensor] = {}
    for n, m in mods.items():
        m.register_forward_hook(lambda m, i, o, n=n: seen.update({n: [i[0].detach()]}) or outs.update({n: o}))
        m.register_full_backward_hook(lambda m, gi, go, n=n: seen[n].append(go[0].detach()))
    for n in [n for n in mods if n.endswith(".w2")]:  # bf16's fused swiglu_down reads w2's weight: no call
        ffn = model.get_submodule(n.rsplit(".", 1)[0])
        ffn.register_full_backward_hook(lambda m, gi, go, n=n: seen.update({n: [
            (torch.nn.functional.silu(outs[n[:-1] + "1"]) * outs[n[:-1] + "3"]).detach(), go[0].detach()]}))
    tokens = torch.from_numpy(corpus_batch(data, args.batch, args.seq))
    logits = model(tokens[:, :-1]).float()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    rows = []
    for n, m in mods.items():
        x, g = seen[n]
        row = {"linear": n}
        for recipe in ("bf16", "tensorwise", "rowwise"):
            lin = torch.nn.Sequential(torch.nn.Linear(m.in_features, m.out_features, bias=False,
                                                      dtype=torch.bfloat16))
            lin[0].weight.data.copy_(m.weight.data)
            if recipe != "bf16":
                convert_to_float8_training(lin, config=float8_config(recipe, False))
            xi = x.clone().requires_grad_()
            y = lin(xi)
            y.backward(g)
            row[recipe] = (y.detach(), xi.grad, lin[0].weight.grad)
        ref = row.pop("bf16")
        for recipe in ("tensorwise", "rowwise"):
            row[recipe] = [round(((a.float() - b.float()).norm() / b.float().norm()).item(), 4)
                           for a, b in zip(row[recipe], ref)]
        rows.append(row)
    return rows


def table(runs: list[dict]) -> list[dict]:
    """Each run against the bf16 seeds' mean, their spread as the noise floor: the held-out loss at the last
    evaluation every run reached, and the training loss averaged over the 50 steps up to the last step
    every run reached (what a run cut short still says; the same batches in every run of a seed)."""
    ev = min((r["eval"][-1][0] if r["eval"] else 0) for r in runs)
    last = min(r["loss"][-1][0] for r in runs)
    rows = {r["run"]: {"held_out": dict(r["eval"]).get(ev),
                       "train_50": sum(v for s, v in r["loss"] if last - 50 < s <= last) / min(50, last)} for r in runs}
    out = []
    for key in ("held_out", "train_50"):
        bf16 = [v[key] for k, v in rows.items() if k.startswith("bf16") and v[key] is not None]
        if not bf16:
            continue
        mean = sum(bf16) / len(bf16)
        for k, v in rows.items():
            out.append({"measure": key, "step": ev if key == "held_out" else last, "run": k, "loss": round(v[key], 4),
                        "rel_vs_bf16_mean": round((v[key] - mean) / mean, 5),
                        "rel_vs_bf16_same_seed": round(v[key] / rows["bf16:" + k.split(":")[1]][key] - 1, 5)
                        if "bf16:" + k.split(":")[1] in rows else None,
                        "bf16_seed_spread": round((max(bf16) - min(bf16)) / mean, 5)})
    return out


def plot(runs: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        s, loss = zip(*r["loss"])
        k = max(1, len(loss) // 50)  # a running mean over ~2% of the run
        smooth = [sum(loss[max(0, i - k):i + 1]) / len(loss[max(0, i - k):i + 1]) for i in range(len(loss))]
        a.plot(s, smooth, label=r["run"], lw=1)
        b.plot(*zip(*r["eval"]), marker="o", label=r["run"])
    a.set(title="training loss (running mean)", xlabel="step", yscale="log")
    b.set(title="held-out loss", xlabel="step")
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def host() -> dict:
    """Where it ran: the CPU's name and capability (which kernels the bf16 and fp8 GEMMs took), torch, torchao."""
    import platform

    import torch
    import torchao
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.processor())
    return {"cpu": name, "capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "torch": torch.__version__, "torchao": torchao.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="each run's torch threads (OMP_NUM_THREADS)")
    p.add_argument("--parallel", type=int, default=4, help="runs at a time")
    p.add_argument("--gemms", help="no training: each block GEMM's fp8 error at initialisation, to this JSON")
    p.add_argument("--report", action="store_true", help="no training: the JSON and plot of the runs on disk")
    p.add_argument("--runs", nargs="+", default=["bf16:0", "bf16:1", "tensorwise:0", "rowwise:0"])
    p.add_argument("--set", nargs="*", default=[], help="more config overrides, KEY=VALUE, for every run")
    p.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "meshlm", "fp8_parity"))
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "fp8_parity.json"))
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "img", "fp8_parity.png"))
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    data, tok = corpus(args.work, args.vocab)
    if args.gemms:
        rows = gemm_errors(data, args)
        for r in rows:
            print(r["linear"], "tensorwise", r["tensorwise"], "rowwise", r["rowwise"])
        with open(args.gemms, "w") as f:
            json.dump({"host": host(), "model": MODEL, "seq": args.seq, "batch": args.batch,
                       "errors (output, input grad, weight grad)": rows}, f, indent=1)
        return
    t0, started = time.perf_counter(), []
    if args.report:  # runs already on disk, finished or not
        started = [collect(run, os.path.join(args.work, "runs", run.replace(":", "-")), None, t0) for run in args.runs]
    for i in range(0, len(args.runs) * (not args.report), args.parallel):  # `parallel` at a time
        batch = [launch(run, data, tok, args, args.work) for run in args.runs[i:i + args.parallel]]
        started += [collect(*b, t0) for b in batch]
        for r in started[-len(batch):]:
            print(f"{r['run']}: held-out {r['eval'][-1][1]:.4f} ({r['seconds']} s) {r['start_line']}", flush=True)
    runs = started
    out = {"host": host(), "model": MODEL, "optim": OPTIM, "steps": args.steps, "seq": args.seq, "batch": args.batch,
           "vocab": args.vocab, "set": args.set, "table": table(runs) if len(runs) > 1 else [], "runs": runs}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:  # a run a line: the curves are 1,000 points each
        runs = out.pop("runs")
        for r in runs:
            r["loss"], r["eval"] = ([[s, round(v, 4)] for s, v in r[k]] for k in ("loss", "eval"))
        f.write(json.dumps(out, indent=1)[:-2] + ',\n "runs": [\n' + ",\n".join(map(json.dumps, runs)) + "\n ]\n}\n")
    plot(runs, args.png)
    for row in out["table"]:
        print(row)


if __name__ == "__main__":
    main()
