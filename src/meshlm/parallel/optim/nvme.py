"""AdamW with the fp32 masters and Adam moments in per-rank files (parallel.offload = "nvme", ZeRO-Infinity
style; docs/zero.md "NVMe offload").

This rank's shards of every ZeRO unit lie back to back in three files under `offload_dir/rank{r}/`
(master.f32, exp_avg.f32, exp_avg_sq.f32). Host memory holds only a bounded buffer
(`offload_buffer_mb`, pinned on CUDA) cut into three slots of `chunk` elements. The step streams the state
through them: while the main thread applies Adam to chunk i, one background thread reads chunk i+1
(read-ahead) and another writes chunk i-1 back (write-behind); plain `os.preadv` / `os.pwritev` into
the slots, so nothing is memory-mapped and the resident set stays the buffer whatever the state's size
(the page cache is the kernel's, not the process's). Each chunk's updated masters are copied into the
device's parameter shard (async from pinned memory on CUDA).

The arithmetic is torch's AdamW (`torch.optim.adam.adam` with decoupled weight decay, fused where torch
has it for the CPU, as parallel/optim/adamw chooses) on the same elements with the same per-tensor weight
decay, so losses equal ZeRO without offload. Checkpoints read and write each parameter's range straight
from the files (`FileRange`): nothing is gathered into memory beyond one stored piece at a time. The
files are scratch: removed on exit, replaced on start; a checkpoint is what survives a crash.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.optim.adam import adam as adam_fn

from ...core.config import ConfigError, OptimConfig
from ..dims.zero.sync import ZeroSync
from ..dims.zero.units import Unit
from .adamw import fused_adamw_supported

KINDS = ("master", "exp_avg", "exp_avg_sq")
SLOTS = 3  # one being read ahead, one being stepped, one being written behind
ALIGN = 1024  # elements per chunk are a multiple of this (4 KiB of fp32)


class OffloadError(ConfigError):
    """The offload directory cannot hold the state; one line naming it."""


def state_bytes(numel: int) -> int:
    """Disk bytes of `numel` sharded parameters: fp32 master, m and v."""
    return 12 * numel


def chunk_elements(buffer_bytes: int, staging: bool) -> int:
    """Elements per chunk so that SLOTS slots of (master, m, v [+ an fp32 gradient staging buffer on
    CUDA]) fit in `buffer_bytes`."""
    per = SLOTS * (16 if staging else 12)
    return max(ALIGN, buffer_bytes // per // ALIGN * ALIGN)


def check_dir(path: str, need: int, what: str) -> None:
    """`path` (created if missing) is a writable directory with `need` bytes free, or one line why not."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OffloadError(f"parallel.offload_dir: cannot create {path} ({e.strerror})") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise OffloadError(f"parallel.offload_dir: {path} is not a writable directory")
    free = shutil.disk_usage(path).free
    if free < need:
        raise OffloadError(f"parallel.offload_dir: {path} has {free / 2**30:.2f} GiB free, {what} needs "
                           f"{need / 2**30:.2f} GiB")


def preflight(parallel, layout, local_ranks: int, num_params: int) -> None:
    """Before any worker starts (offload = "nvme"): offload_dir is writable and holds this node's ranks'
    state, 12 B per parameter each holds (Ψ·dp_replicate/world on average; each rank checks its exact
    size again when it reserves its files)."""
    if parallel.offload != "nvme":
        return
    per_rank = num_params * layout.dp_replicate / layout.world_size
    check_dir(parallel.offload_dir, state_bytes(int(per_rank * local_ranks)),
              f"the optimizer state of {local_ranks} rank{'s' if local_ranks > 1 else ''}")


class StateFiles:
    """The three state files of one rank: created (space reserved) on open, removed on close. A lock
    file keeps two live runs from sharing a rank directory; a killed run's directory is scratch and
    replaced."""

    def __init__(self, root: str, rank: int, numel: int):
        self.dir = os.path.join(root, f"rank{rank}")
        self.numel = numel
        check_dir(root, state_bytes(numel), f"rank {rank}'s optimizer state")
        self.lock = os.open(os.path.join(root, f"rank{rank}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.lock)
            raise OffloadError(f"parallel.offload_dir: {self.dir} is in use by another run") from None
        shutil.rmtree(self.dir, ignore_errors=True)  # a killed run's scratch
        os.makedirs(self.dir)
        self.fds = {}
        try:
            for k in KINDS:
                fd = os.open(os.path.join(self.dir, f"{k}.f32"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self.fds[k] = fd
                if numel:
                    os.posix_fallocate(fd, 0, 4 * numel)  # reads as zeros: the moments start there
        except OSError as e:
            self.close()
            raise OffloadError(f"parallel.offload_dir: cannot reserve {state_bytes(numel) / 2**30:.2f} GiB "
                               f"in {root} ({e.strerror})") from None

    def read(self, kind: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of `kind` into `out` (contiguous fp32, host)."""
        _io(os.preadv, self.fds[kind], out, 4 * start)

    def write(self, kind: str, start: int, src: torch.Tensor) -> None:
        _io(os.pwritev, self.fds[kind], src, 4 * start)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.lock is not None:
            try:
                os.unlink(self.dir + ".lock")
            except OSError:
                pass
            os.close(self.lock)
            self.lock = None


def _io(call, fd: int, t: torch.Tensor, offset: int) -> None:
    """Whole-buffer pread/pwrite (they may move fewer bytes than asked)."""
    mv = memoryview(t.numpy()).cast("B")
    done = 0
    while done < len(mv):
        n = call(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(f"offload file: {'read' if call is os.preadv else 'write'} stopped at byte {offset + done}")
        done += n


class FileRange:
    """One unit's shard of one kind inside a state file, for checkpoints: a meta tensor of the shard's
    size stands for it (`meta`), and any view of that (a parameter's box) is read or written in place
    (docs/checkpoints.md; train/checkpoint.Pieces.backing)."""

    def __init__(self, files: StateFiles, kind: str, base: int, size: int):
        self.files, self.kind, self.base = files, kind, base
        self.meta = torch.empty(size, device="meta")

    @staticmethod
    def _span(view: torch.Tensor) -> tuple[int, int]:
        extent = 1 + sum((s - 1) * st for s, st in zip(view.shape, view.stride())) if view.numel() else 0
        return view.storage_offset(), extent

    def read(self, view: torch.Tensor) -> torch.Tensor:
        """A new host tensor with the values of `view` (a view of `meta`)."""
        lo, n = self._span(view)
        buf = torch.empty(n, dtype=torch.float32)
        if n:
            self.files.read(self.kind, self.base + lo, buf)
        return torch.as_strided(buf, view.shape, view.stride()).contiguous()

    def write(self, view: torch.Tensor, values: torch.Tensor) -> None:
        lo, n = self._span(view)
        if not n:
            return
        if view.is_contiguous():
            self.files.write(self.kind, self.base + lo, values.detach().float().contiguous().reshape(-1))
            return
        buf = torch.empty(n, dtype=torch.float32)  # a box narrower than its rows: read, patch, write
        self.files.read(self.kind, self.base + lo, buf)
        torch.as_strided(buf, view.shape, view.stride()).copy_(values)
        self.files.write(self.kind, self.base + lo, buf)


class NvmeOptimizer:
    """The optimizer `parallelize` returns for zero >= 1 with offload = "nvme" (the interface of
    ZeroOptimizer and parallel/optim/master.MasterOptimizer)."""

    def __init__(self, zero: ZeroSync, cfg: OptimConfig, root: str, buffer_mb: float, rank: int):
        self.zero, self.cfg = zero, cfg
        self.params = [p for u in zero.units for p in u.params]
        self.names = [n for u in zero.units for n in u.names]
        self.lr = cfg.lr
        self.step_n = 0
        dev = zero.units[0].device
        self.cuda = dev.type == "cuda"
        self.base, total = {}, 0
        for u in zero.units:
            self.base[id(u)] = total
            total += u.shard_size
        self.files = StateFiles(root, rank, total)
        self.chunk = min(chunk_elements(int(buffer_mb * 2 ** 20), self.cuda), -(-max(total, 1) // ALIGN) * ALIGN)
        width = 4 if self.cuda else 3  # master, m, v (+ the gradient staged from the device)
        self.buffer = torch.empty(SLOTS * width * self.chunk, dtype=torch.float32, pin_memory=self.cuda)
        self.slots = [self.buffer[i * width * self.chunk:(i + 1) * width * self.chunk].view(width, self.chunk)
                      for i in range(SLOTS)]
        self.events: list = [None] * SLOTS  # CUDA: the host-to-device copy out of each slot
        self.fused = fused_adamw_supported("cpu")
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="offload-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write")
        # (unit, start, end) of every chunk, and each chunk's parameter pieces (decay?, a, b) in shard terms
        self.chunks = [(u, a, min(a + self.chunk, u.shard_size)) for u in zero.units
                       for a in range(0, u.shard_size, self.chunk)]
        self.decay = {id(u): u.decay_runs() for u in zero.units}
        self.stats = {"steps": 0, "read_bytes": 0, "write_bytes": 0, "step_s": 0.0, "read_wait_s": 0.0,
                      "write_wait_s": 0.0}
        self._lock = threading.Lock()
        with torch.no_grad():
            for u, a, b in self.chunks:  # the masters start as the initial parameters
                s = self.slots[0][0, :b - a]
                s.copy_(u.shard[a:b])
                self.files.write("master", self.base[id(u)] + a, s)

    # -- the step ------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def _read(self, i: int, slot: int) -> None:
        u, a, b = self.chunks[i]
        for k, kind in enumerate(KINDS):
            self.files.read(kind, self.base[id(u)] + a, self.slots[slot][k, :b - a])
        with self._lock:
            self.stats["read_bytes"] += 12 * (b - a)

    def _write(self, i: int, slot: int) -> None:
        u, a, b = self.chunks[i]
        for k, kind in enumerate(KINDS):
            self.files.write(kind, self.base[id(u)] + a, self.slots[slot][k, :b - a])
        with self._lock:
            self.stats["write_bytes"] += 12 * (b - a)

    def _adam(self, u: Unit, a: int, b: int, slot: torch.Tensor, grad: torch.Tensor) -> None:
        """AdamW on the parameter pieces inside [a, b) of unit `u`'s shard, held in `slot`."""
        groups: dict[bool, list] = {True: [[], [], [], []], False: [[], [], [], []]}
        for decay, s0, s1 in self.decay[id(u)]:
            lo, hi = max(a, s0), min(b, s1)
            if lo >= hi:
                continue
            g = groups[decay]
            for lst, t in zip(g, (slot[0], grad, slot[1], slot[2])):
                lst.append(t[lo - a:hi - a])
        for decay, (p, gr, m, v) in groups.items():
            if not p:
                continue
            steps = [torch.full((), float(self.step_n), dtype=torch.float32) for _ in p]
            adam_fn(p, gr, m, v, [], steps, foreach=not self.fused, fused=self.fused,
                    decoupled_weight_decay=True, amsgrad=False, beta1=self.cfg.beta1,
                    beta2=self.cfg.beta2, lr=self.lr, eps=self.cfg.eps, maximize=False,
                    weight_decay=self.cfg.weight_decay if decay else 0.0)

    def _stream(self, apply) -> None:
        """Every chunk through the slots: read ahead, `apply(i, slot)`, write behind."""
        n = len(self.chunks)
        reads: list[Future | None] = [None] * SLOTS
        writes: list[Future | None] = [None] * SLOTS
        for i in range(min(SLOTS - 1, n)):
            reads[i % SLOTS] = self.reader.submit(self._read, i, i % SLOTS)
        try:
            for i in range(n):
                s = i % SLOTS
                t0 = time.perf_counter()
                reads[s].result()
                self.stats["read_wait_s"] += time.perf_counter() - t0
                apply(i, s)
                writes[s] = self.writer.submit(self._write, i, s)
                nxt = i + SLOTS - 1
                if nxt < n:  # its slot last held chunk i-1: written back and copied out first
                    k = nxt % SLOTS
                    t0 = time.perf_counter()
                    if writes[k] is not None:
                        writes[k].result()
                    if self.events[k] is not None:
                        self.events[k].synchronize()
                    self.stats["write_wait_s"] += time.perf_counter() - t0
                    reads[k] = self.reader.submit(self._read, nxt, k)
        finally:
            t0 = time.perf_counter()
            for f in reads + writes:
                if f is not None:
                    f.result()
            self.stats["write_wait_s"] += time.perf_counter() - t0

    def _publish_chunk(self, i: int, s: int) -> None:
        u, a, b = self.chunks[i]
        u.shard[a:b].copy_(self.slots[s][0, :b - a], non_blocking=self.cuda)
        if self.cuda:
            self.events[s] = torch.cuda.Event()
            self.events[s].record()

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """`found_inf` (fp16 loss scaling): 1.0 skips the step. The step runs on the host, so the flag
        is read there (as the unfused path of parallel/optim/adamw `adamw_step`)."""
        if found_inf is not None and bool(found_inf):
            self.zero.release_grads()
            return
        t0 = time.perf_counter()

        def apply(i: int, s: int) -> None:
            u, a, b = self.chunks[i]
            slot = self.slots[s]
            if self.cuda:  # stage the gradient chunk in the slot (pinned), then step on the host
                grad = slot[3, :b - a]
                grad.copy_(u.grad_shard[a:b], non_blocking=True)
                torch.cuda.current_stream().synchronize()
            else:
                grad = u.grad_shard[a:b]
            self._adam(u, a, b, slot, grad)
            self._publish_chunk(i, s)

        self._stream(apply)
        self.step_n += 1
        self.zero.release_grads()
        self.zero.publish()
        self.stats["steps"] += 1
        self.stats["step_s"] += time.perf_counter() - t0

    # -- what the trainer and checkpoints ask ---------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        return [u.shard if self.zero.switches.shard_params else u.full for u in self.zero.units]

    def state_bytes(self) -> int:
        """Host bytes the optimizer keeps: the streaming buffer (the state itself is on disk)."""
        return self.buffer.untyped_storage().nbytes()

    def disk_bytes(self) -> int:
        return state_bytes(self.files.numel)

    def step_count(self) -> int:
        return self.step_n

    def state_storage(self) -> list[tuple[str, str, torch.Tensor]]:
        """(name, kind, range) as ZeroOptimizer gives them, but each range is a view of a meta tensor
        standing for the unit's stretch of a state file; `backing(name, kind)` reads and writes it."""
        self.zero.wait_params()
        out, self._backing = [], {}
        for u in self.zero.units:
            ranges = {k: FileRange(self.files, k, self.base[id(u)], u.shard_size) for k in KINDS}
            for seg, name in zip(u.pieces, u.names):
                for k in KINDS:
                    out.append((name, k, ranges[k].meta[seg.start:seg.end]))
                    self._backing[(name, k)] = ranges[k]
        return out

    def backing(self, name: str, kind: str) -> FileRange:
        return self._backing[(name, kind)]

    @torch.no_grad()
    def loaded(self, step: int) -> None:
        """The files were filled from a checkpoint: set Adam's step, copy the masters to the shards."""
        self.step_n = int(step)
        for u, a, b in self.chunks:
            s = self.slots[0][0, :b - a]
            self.files.read("master", self.base[id(u)] + a, s)
            u.shard[a:b].copy_(s)
        self.zero.publish()

    def close(self) -> None:
        """Remove the scratch files (a clean exit; a killed run's are replaced by the next start)."""
        self.reader.shutdown()
        self.writer.shutdown()
        self.files.close()
