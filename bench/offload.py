"""Benchmark (not a test): parallel.offload = "nvme" vs "optimizer" on a ~34M-parameter dp2 ZeRO-3 run (fp32,
gloo, CPU), each in fresh worker processes, side by side in one run (docs/zero.md "NVMe offload").

Host memory. The optimizer's resident-set growth on each rank: the RSS it adds while being built (read
around its constructor) plus the largest rise, over all steps, of the peak RSS during a step (VmHWM,
reset through /proc/self/clear_refs just before it) above the RSS at the start of the first step (when
the step's gradients exist, as at every step's start). The model's own parameters and gradients (host
memory on a CPU run; the GPU's on a GPU run) are therefore not counted; the page cache is the kernel's
and is never RSS. Claims, printed as PASS/FAIL:
nvme growth <= offload_buffer_mb + 10%; optimizer growth ~ 16 B per sharded parameter (fp32 master,
m, v and the fp32 gradient staging buffer: 12 B of state + 4).

I/O. The nvme step moves 12 B per sharded parameter in and 12 B out. The same bytes are then moved by a
plain sequential write of a file of the state's size in the same directory followed by a read of it,
in chunks of the optimizer's chunk size, on both ranks at once (as the optimizer's two ranks share the
disk); the file is written once untimed first, as the state files are before the timed steps. Ratio = plain time / step time (>= 0.7 is the goal). Two cache regimes, each timed for both:
- warm: no fsync, no eviction: reads come from the page cache and writes only dirty it (what a step
  sees when the state fits in free RAM; mostly memory bandwidth);
- cold: before each timed step / plain read the files are fsynced and evicted from the page cache
  (posix_fadvise DONTNEED: no root needed), and the written data is fsynced inside the timed span, so
  both sides go to the device. A virtual disk's host may still cache below the guest: say which disk.
The step time includes the host AdamW and the parameter copy, which the read-ahead/write-behind
threads overlap with I/O; on a shared machine CPU contention shows up as lower ratios.

    python bench/offload.py [--dim 512 --n-layers 8 --n-heads 8 --ffn-dim 2048] [--buffer-mb 32]
                            [--dir DIR] [--steps 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from spawn import join_gloo, spawn_gloo  # noqa: E402  (bench/spawn.py)
from zero import _hwm, _reset_hwm, _rss, release_freed  # noqa: E402  (bench/zero.py)


def make_cfg(a, offload: str, regime: str):
    from meshlm.core import config as C
    cfg = C.Config()
    over = {"model.preset": "small", "model.dim": a.dim, "model.n_layers": a.n_layers, "model.n_heads": a.n_heads,
            "model.n_kv_heads": a.n_heads, "model.ffn_dim": a.ffn_dim, "data.seq_len": a.seq_len,
            "training.global_batch": 2, "training.micro_batch": 1, "training.steps": 1 + a.steps,
            "training.eval_every": 0, "metrics.progress": False, "metrics.every": 1000, "checkpoint.resume": "never",
            "training.device": "cpu", "parallel.dp": 2, "parallel.zero": 3, "parallel.offload": offload,
            "parallel.offload_dir": os.path.join(a.dir, f"{offload}-{regime}"), "parallel.offload_buffer_mb": a.buffer_mb}
    for k, v in over.items():
        C.apply(cfg, k, v)
    return cfg


def _evict(fds) -> None:
    for fd in fds:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def instrument(rec: dict, cold: bool):
    """Wrap the optimizer classes parallelize() builds (bench only): RSS around the constructor, the
    peak RSS rise and the wall time of every step; cold: evict the state files before each step and
    fsync them inside it."""
    import meshlm.parallel.compose as comp

    def wrap(cls):
        def make(*args, **kw):
            r0 = _rss()
            opt = cls(*args, **kw)
            rec["ctor"] = _rss() - r0
            rec["steps"] = []
            inner = opt.step
            fds = list(opt.files.fds.values()) if hasattr(opt, "files") else []

            def step(found_inf=None):
                if cold:
                    _evict(fds)
                r = _rss()
                _reset_hwm()
                t0 = time.perf_counter()
                inner(found_inf)
                if cold:
                    for fd in fds:
                        os.fsync(fd)
                rec.setdefault("start", r)  # the RSS at the start of the first step
                rec["steps"].append({"rise": _hwm() - rec["start"], "s": time.perf_counter() - t0})
            opt.step = step
            rec["opt"] = opt
            return opt
        return make
    comp.ZeroOptimizer = wrap(comp.ZeroOptimizer)
    comp.NvmeOptimizer = wrap(comp.NvmeOptimizer)


def plain_io(path: str, nbytes: int, chunk: int, cold: bool) -> float:
    """Seconds to write `nbytes` sequentially in `chunk`-byte pieces and read them back (see the doc).
    The file is written once untimed first: the optimizer's steps overwrite written blocks too (a
    fresh file's first write also allocates them)."""
    import numpy as np
    buf = np.ones(chunk, dtype=np.uint8)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        for off in range(0, nbytes, chunk):
            os.pwritev(fd, [mv[:min(chunk, nbytes - off)]], off)
        os.fsync(fd)
        if cold:
            _evict([fd])
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            os.pwritev(fd, [mv[:min(chunk, nbytes - off)]], off)
        if cold:
            _evict([fd])  # fsync (timed: the data reaches the device) and drop the cached pages
        for off in range(0, nbytes, chunk):
            os.preadv(fd, [mv[:min(chunk, nbytes - off)]], off)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def worker(rank: int, world: int, port: int, variant: tuple, a, out) -> None:
    join_gloo(rank, world, port)
    import torch.distributed as dist

    from meshlm.distributed.mesh import init_context, pick_device
    from meshlm.core.layout import build_layout
    from meshlm.core.config.model import model_args
    from meshlm.train.trainer import Trainer

    offload, regime = variant
    rec: dict = {}
    instrument(rec, regime == "cold" and offload == "nvme")
    cfg = make_cfg(a, offload, regime)
    layout = build_layout(cfg, world)
    ctx = init_context(layout.shape(), pick_device("cpu"))
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="meshlm-bench-offload-"), ctx, layout)
    opt = rec["opt"]
    shard = sum(u.shard_size for u in opt.zero.units)
    res = {"psi": model_args(cfg).num_params(), "shard": shard}
    try:
        for _ in range(1 + a.steps):  # the first step touches every page once: not timed
            tr.train_step(measure=False)
        steps = rec["steps"][1:]  # timed: the first step touches every page once
        res.update(ctor=rec["ctor"], rise=max(s["rise"] for s in rec["steps"]),
                   step_s=sorted(s["s"] for s in steps)[len(steps) // 2])
        res["growth"] = res["ctor"] + res["rise"]
        if offload == "nvme":
            res["chunk_bytes"] = opt.chunk * 4
            res["io_bytes"] = 24 * shard
            dist.barrier()
            path = os.path.join(cfg.parallel.offload_dir, f"plain-rank{rank}.bin")
            times = []
            for _ in range(a.steps):
                dist.barrier()
                times.append(plain_io(path, 12 * shard, opt.chunk * 4, regime == "cold"))
            res["plain_s"] = sorted(times)[len(times) // 2]
    finally:
        if hasattr(opt, "close"):
            opt.close()
    out.put((rank, res))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--ffn-dim", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--buffer-mb", type=float, default=32.0)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one untimed")
    ap.add_argument("--dir", default="", help="where the offload files go (default: a new temp dir)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.dir = a.dir or tempfile.mkdtemp(prefix="meshlm-offload-bench-")
    release_freed()
    runs = {}
    for variant in (("optimizer", "warm"), ("nvme", "warm"), ("nvme", "cold")):
        res = spawn_gloo(worker, 2, variant, a, timeout=1800)
        runs["/".join(variant)] = [res[r] for r in sorted(res)]
    one = runs["optimizer/warm"][0]
    psi, shard = one["psi"], max(r["shard"] for r in runs["optimizer/warm"])
    buf = a.buffer_mb * 2 ** 20
    lines = [f"model {psi / 1e6:.1f}M parameters, dp2 ZeRO-3 fp32 on CPU (gloo), {shard / 1e6:.2f}M sharded per rank; "
             f"offload_buffer_mb {a.buffer_mb:g}; dir {a.dir} (df: {os.statvfs(a.dir).f_bsize} B blocks); "
             f"machine shared with other jobs: times are noisy",
             f"{'variant':<16}{'ctor MiB':>10}{'step rise MiB':>15}{'growth MiB':>12}{'B/param':>9}{'step s':>9}"]
    for name, per in runs.items():
        worst = max(per, key=lambda r: r["growth"])
        lines.append(f"{name:<16}{worst['ctor'] / 2**20:>10.1f}{worst['rise'] / 2**20:>15.1f}{worst['growth'] / 2**20:>12.1f}"
                     f"{worst['growth'] / worst['shard']:>9.2f}{max(r['step_s'] for r in per):>9.3f}")
    summary = {"psi": psi, "shard": shard, "buffer_bytes": buf, "runs": runs}
    nv = max(r["growth"] for r in runs["nvme/warm"] + runs["nvme/cold"])
    op = max(r["growth"] for r in runs["optimizer/warm"])
    ok_mem = nv <= 1.1 * buf
    lines.append(f"nvme growth {nv / 2**20:.1f} MiB <= buffer {a.buffer_mb:g} MiB + 10%: {'PASS' if ok_mem else 'FAIL'}; "
                 f"optimizer growth {op / 2**20:.1f} MiB = {op / shard:.2f} B/param (16 expected): "
                 f"{'PASS' if abs(op / shard - 16) <= 1.6 else 'FAIL'}; nvme / optimizer {nv / op:.3f}")
    for regime in ("warm", "cold"):
        per = runs[f"nvme/{regime}"]
        step, plain = max(r["step_s"] for r in per), max(r["plain_s"] for r in per)
        gbps = lambda s: 2 * per[0]["io_bytes"] / s / 1e9  # noqa: E731 - both ranks' bytes
        ratio = plain / step
        summary[f"io_ratio_{regime}"] = ratio
        lines.append(f"I/O {regime}: step moves {2 * per[0]['io_bytes'] / 2**20:.0f} MiB (2 ranks) in {step:.3f} s = "
                     f"{gbps(step):.2f} GB/s; plain write+read of the same bytes {plain:.3f} s = {gbps(plain):.2f} GB/s; "
                     f"ratio {ratio:.2f} (goal >= 0.7): {'PASS' if ratio >= 0.7 else 'FAIL'}")
    summary.update(mem_pass=ok_mem, nvme_growth=nv, optimizer_growth=op)
    print("\n".join(lines))
    if a.json:
        print(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
