"""The headline GPU piece (`bash bench/gpu_session.sh headline`): the rows that matter most, highest value
first, inside one lent-GPU call (the row timeouts add up to at most HEADLINE_BUDGET_S, checked by
tests/test_bench_session.py). Each row runs in a fresh process with its own timeout (a failed or
out-of-memory row can leave device memory held, and one slow compile must not eat the rows after it);
`headline.json` is rewritten after every row, so a run cut off still reports what it measured.

Rows: the card and its ceilings; llama3-1b bf16 compiled, no AC, mb 16 (the MFU row); llama3-1b with a
document mask under SDPA's dense mask and under flex, same micro-batch; llama3-3b with the chunked loss at
the largest micro-batch the planner says fits this card, in bf16 and in fp8; the plain transformers loop at
1b (bf16 parameters, compiled); MLA + MoE at real shapes: the first 4 blocks of DeepSeek-V2-Lite (hidden
2048, MLA's 512-wide kv latent, 64 routed experts of 1408 + 2 shared, top 6; the first block dense),
its full vocabulary, at the largest micro-batch the planner says fits, in bf16 and in fp8 (what
DeepSeek-class users run: its MFU, not a debug model's). Fewer steps than the older pieces (2 warm-up +
8 measured; bench/gpu.py reports the median and the spread): the compile dominates a row's time.

    python bench/headline.py --out DIR
    python bench/headline.py --device cpu --tiny --out DIR     # plumbing: debug shapes on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ledger  # noqa: E402  (the card's name from nvidia-smi without a CUDA context in this process)

HEADLINE_BUDGET_S = 470  # the piece's `timeout 480` in gpu_session.sh holds this driver too

# (row, timeout in seconds): highest value first. Set from the H200 run of 2026-11-26 (bench/results/), where
# rows took 5 / 41 / 33 / 35 / 58 / 62 s, cold compile included, and the peer's compile outlasted 50 s;
# each of those rows keeps 7 s or more over its time, the peer 80 s. The MLA rows have not run on a GPU:
# 56 s (two compiled block graphs, dense and MoE, and the planner's fit check) and 50 s (the bf16 row's
# batch, no fit check) are estimates from the 3b rows' 58-62 s, to be set from their first run; they run
# last, so a slow compile there costs no other row
ROWS = [("ceilings", 12), ("mfu-1b", 50), ("docmask-1b-sdpa", 43), ("docmask-1b-flex", 43),
        ("chunks-3b-bf16", 66), ("chunks-3b-fp8", 70), ("peer-1b", 80), ("mla-moe-bf16", 56), ("mla-moe-fp8", 50)]
MLA_CUT = {"model.n_layers": 4}  # the preset's first blocks: its widths, experts and vocabulary unchanged


def shapes(tiny: bool) -> dict:
    """Presets and sizes of the rows: the real ones, or the debug model on a CPU (plumbing)."""
    if tiny:
        return {"1b": "debug", "3b": "debug", "mla": "dsv3-debug", "seq": 32,
                "mb": [2], "warmup": 1, "steps": 2, "extra": {"training.fp8_emulate": True}}
    return {"1b": "llama3-1b", "3b": "llama3-3b", "mla": "deepseek-v2-lite", "seq": 2048,
            "mb": [16, 8, 4, 2, 1], "warmup": 2, "steps": 8, "extra": {}}


def planner_batches(preset: str, sizes: list[int], card: str | None, overrides: dict, a) -> list[int]:
    """`sizes` from the largest one `meshlm estimate` says fits `card` (one rank), then smaller ones as
    fallbacks; all of them where no card profile is known (a CPU, an unknown GPU)."""
    if card is None:
        return sizes
    for i, mb in enumerate(sizes):
        cfg = {"model.preset": preset, "data.seq_len": a.seq_len, "training.micro_batch": mb,
               "training.global_batch": mb, "training.compile": True, **overrides}
        cmd = [sys.executable, "-m", "meshlm.cli", "estimate", "--gpu", card, "--gpus", "1", "--json",
               *(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in cfg.items())]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if proc.returncode == 0 and json.loads(proc.stdout).get("fits"):
            return sizes[i:]
    return sizes[-1:]


def child(script: str, preset: str, sizes: list[int], a, deadline: float, extra: dict) -> dict:
    """bench/gpu.py's (or gpu_peers.py's) `--child` measurement at the first size that does not run out
    of memory, each try a fresh process, all before `deadline`."""
    args = {"seq_len": a.seq_len, "warmup": a.warmup, "steps": a.steps, "precision": extra.pop("precision", "bf16"),
            "ac": extra.pop("ac", "none"), "compile": a.device != "cpu", "device": a.device, "profile": False}
    tried = []
    for mb in sizes:
        spec = json.dumps({"preset": preset, "mb": mb, "extra": extra, "args": args})
        proc = subprocess.run([sys.executable, os.path.join(HERE, script), "--child", spec], capture_output=True,
                              text=True, timeout=max(1.0, deadline - time.monotonic()))
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not last.startswith("{"):
            err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            raise RuntimeError(err[-1][:300] if err else f"exit {proc.returncode}")
        out = json.loads(last)
        if not out.get("oom"):
            return dict(out, tried=tried + [mb])
        tried.append(mb)
    return {"preset": preset, "fits": False, "tried": tried}


def run_row(name: str, a, done: dict, deadline: float) -> dict:
    """One row's measurement (raises on failure; `done`: the rows measured so far, by name)."""
    s, env = shapes(a.tiny), a.env
    if name == "ceilings":
        out = os.path.join(a.out, "ceilings.json")
        cmd = [sys.executable, os.path.join(HERE, "ceilings.py"), "--device", a.device, "--out", out]
        subprocess.run(cmd + (["--tiny"] if a.tiny else []), check=True, capture_output=True, text=True,
                       timeout=max(1.0, deadline - time.monotonic()))
        with open(out) as f:
            return json.load(f)
    base = dict(s["extra"])
    if name == "mfu-1b":
        return child("gpu.py", s["1b"], s["mb"][:1], a, deadline, base)
    if name.startswith("docmask"):
        impl = name.rsplit("-", 1)[1]
        mask = {**base, "data.document_mask": True, "model.attn_impl": impl}
        sdpa = done.get("docmask-1b-sdpa", {})  # flex runs the batch SDPA ran, so the two compare
        sizes = [sdpa["micro_batch"]] if "micro_batch" in sdpa else planner_batches(
            s["1b"], s["mb"], env["card"], {"data.document_mask": True, "model.attn_impl": "sdpa",
                                            "training.ac": "none", "training.precision": "bf16"}, a)
        return child("gpu.py", s["1b"], sizes, a, deadline, mask)
    if name.startswith("chunks-3b"):
        prec = name.rsplit("-", 1)[1]
        chunks = {**base, "training.loss_chunks": 8, "ac": "selective", "precision": prec}
        bf16 = done.get("chunks-3b-bf16", {})
        sizes = [bf16["micro_batch"]] if "micro_batch" in bf16 else planner_batches(
            s["3b"], s["mb"], env["card"], {"training.loss_chunks": 8, "training.ac": "selective",
                                            "training.precision": "bf16"}, a)
        return child("gpu.py", s["3b"], sizes, a, deadline, chunks)
    if name == "peer-1b":
        r = child("gpu_peers.py", s["1b"], s["mb"][:2], a, deadline, {"peer": "bf16"})
        mine = done.get("mfu-1b", {})
        if "tokens_per_s" in r and "tokens_per_s" in mine:
            r["meshlm_over_peer"] = mine["tokens_per_s"] / r["tokens_per_s"]
        return r
    prec = name.rsplit("-", 1)[1]  # mla-moe-bf16, mla-moe-fp8: the fp8 row runs the bf16 row's batch
    bf16 = done.get("mla-moe-bf16", {})
    sizes = [bf16["micro_batch"]] if "micro_batch" in bf16 else planner_batches(
        s["mla"], s["mb"], env["card"], {**MLA_CUT, "training.ac": "none", "training.precision": "bf16"}, a)
    return child("gpu.py", s["mla"], sizes, a, deadline, {**base, **MLA_CUT, "precision": prec})


def summary(rows: dict) -> dict:
    """The ratios the rows are for (flex / SDPA under the mask, fp8 / bf16, meshlm / the peer)."""
    def tps(name):
        return rows.get(name, {}).get("result", {}).get("tokens_per_s")
    out = {}
    for key, num, den in (("flex_over_sdpa", "docmask-1b-flex", "docmask-1b-sdpa"),
                          ("docmask_flex_over_nomask", "docmask-1b-flex", "mfu-1b"),
                          ("fp8_over_bf16_3b", "chunks-3b-fp8", "chunks-3b-bf16"),
                          ("fp8_over_bf16_mla", "mla-moe-fp8", "mla-moe-bf16")):
        if tps(num) and tps(den):
            out[key] = tps(num) / tps(den)
    peer = rows.get("peer-1b", {}).get("result", {})
    if "meshlm_over_peer" in peer:
        out["meshlm_over_peer_1b"] = peer["meshlm_over_peer"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="debug shapes (the CPU plumbing run)")
    p.add_argument("--rows", default=",".join(r for r, _ in ROWS), help="a subset of the rows, in their order")
    p.add_argument("--out", default=".", help="folder for headline.json and ceilings.json")
    a = p.parse_args(argv)
    wanted = [r for r in a.rows.split(",") if r]
    if bad := [r for r in wanted if r not in dict(ROWS)]:
        p.exit(2, f"bench/headline.py: --rows: unknown {bad[0]!r} (known: {', '.join(r for r, _ in ROWS)})\n")
    if a.device == "cpu" and not a.tiny:
        p.exit(2, "bench/headline.py: --device cpu runs only the --tiny shapes\n")
    s = shapes(a.tiny)
    a.seq_len, a.warmup, a.steps = s["seq"], s["warmup"], s["steps"]
    a.env = ledger.environment(a.device)
    os.makedirs(a.out, exist_ok=True)
    report = {"piece": "headline", "env": a.env, "steps": {"warmup": a.warmup, "measured": a.steps}, "rows": {}}
    done: dict[str, dict] = {}
    for name, timeout in ROWS:
        if name not in wanted:
            continue
        t0 = time.monotonic()
        row = {"timeout_s": timeout}
        try:
            row["result"] = done[name] = run_row(name, a, done, t0 + timeout)
            row["status"] = row["result"].pop("status", "ok")
        except subprocess.TimeoutExpired:
            row["status"] = f"timed out after {timeout} s"
        except (RuntimeError, subprocess.CalledProcessError, OSError, ValueError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            row["status"], row["error"] = "failed", str(detail).strip().splitlines()[-1][:300] if detail else repr(e)
        row["elapsed_s"] = round(time.monotonic() - t0, 1)
        report["rows"][name] = row
        report["summary"] = summary(report["rows"])
        ledger.write_json(os.path.join(a.out, "headline.json"), report)
        print(f"{name}: {row['status']} in {row['elapsed_s']} s " + ledger.row_line(row.get("result", {})), flush=True)
    print("summary:", json.dumps(report["summary"]))
    return report


if __name__ == "__main__":
    main()
