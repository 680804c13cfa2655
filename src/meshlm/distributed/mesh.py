"""The device mesh (islands, pp, dp_replicate, dp_shard, cp, tp) and the process groups along it, plus the
expert view of the dp×cp ranks when `shape["ep"] > 1` (`expert_groups`). `islands` (DiLoCo, docs/diloco.md)
is outermost and absent from a shape at 1: every group but `world` and `islands` lies inside one island,
`island` is this rank's island, and `islands` the ranks at the same place in every island (the outer sync).

Rank r sits at coordinates given by r in row-major order over that shape, so tp neighbours are
consecutive ranks (one node) and pp is outermost. Groups are created once, on every rank, in the same
order (c10d requires it), and handed around in a `ParallelContext`; nothing is kept in globals.
"""
from __future__ import annotations

import gc
import itertools
import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.config import apply_device
from .comm import Comm
from .link import LinkComm, island_job

DIMS = ("islands", "pp", "dp_replicate", "dp_shard", "cp", "tp")
ISLAND = DIMS[1:]  # the dimensions inside one island
# Groups that span several mesh dimensions at once.
# dp_cp / dp_shard_cp: context-parallel ranks hold the same weights and see other tokens, so gradients
# are averaged over dp×cp and ZeRO shards over dp_shard×cp (as torchtitan does).
COMPOSITES = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
              "dp_cp": ("dp_replicate", "dp_shard", "cp")}


def coords_of(rank: int, shape: dict[str, int]) -> dict[str, int]:
    out = {}
    for d in reversed(DIMS):
        out[d] = rank % shape.get(d, 1)
        rank //= shape.get(d, 1)
    return {d: out[d] for d in DIMS}


def rank_of(coords: dict[str, int], shape: dict[str, int]) -> int:
    r = 0
    for d in DIMS:
        r = r * shape.get(d, 1) + coords[d]
    return r


def groups_along(dims: tuple[str, ...], shape: dict[str, int]) -> list[list[int]]:
    """Every set of ranks that differ only in `dims` (each set sorted), in a fixed order."""
    fixed = [d for d in DIMS if d not in dims]
    out = []
    for fixed_vals in itertools.product(*(range(shape.get(d, 1)) for d in fixed)):
        base = dict(zip(fixed, fixed_vals))
        members = []
        for var_vals in itertools.product(*(range(shape.get(d, 1)) for d in dims)):
            c = dict(base, **dict(zip(dims, var_vals)))
            members.append(rank_of(c, shape))
        out.append(sorted(members))
    return out


def zpp_groups(shape: dict[str, int], k: int) -> dict[str, list[list[int]]]:
    """ZeRO++'s view of each shard group (dp_shard × cp, in its rank order): `zpp_intra` = blocks of k
    consecutive members (a node: hpZ's secondary copies, qgZ's first all-to-all), `zpp_inter` = the
    members at the same place in every block (qgZ's second, cross-node all-to-all)."""
    out: dict[str, list[list[int]]] = {"zpp_intra": [], "zpp_inter": []}
    for g in groups_along(("dp_shard", "cp"), shape):
        out["zpp_intra"] += [g[i:i + k] for i in range(0, len(g), k)]
        out["zpp_inter"] += [g[j::k] for j in range(k)]
    return out


def expert_groups(shape: dict[str, int], ep: int) -> dict[str, list[list[int]]]:
    """The expert view of the dp_replicate × dp_shard × cp block (flattened row-major, per pp and tp
    coordinate): `ep` = runs of ep consecutive ranks (each holds E/ep experts), `edp` = the ranks
    holding the same experts (every ep-th), `edp_shard` = those inside one dp_replicate slice (ZeRO's
    expert shard group; only when ep divides dp_shard × cp)."""
    inner = shape["dp_shard"] * shape["cp"]
    out: dict[str, list[list[int]]] = {"ep": [], "edp": [], "edp_shard": []}
    for g in groups_along(("dp_replicate", "dp_shard", "cp"), shape):
        out["ep"] += [g[i:i + ep] for i in range(0, len(g), ep)]
        out["edp"] += [g[r::ep] for r in range(ep)]
        if inner % ep == 0:
            for rep in range(0, len(g), inner):
                out["edp_shard"] += [g[rep:rep + inner][r::ep] for r in range(ep)]
    return out


@dataclass
class ParallelContext:
    """This rank's place in the mesh and one `Comm` (a group with accounting) per dimension."""
    rank: int
    world_size: int
    shape: dict[str, int]
    device: torch.device
    comms: dict[str, Comm] = field(default_factory=dict)
    restarts: int = 0  # the job's restart count, agreed by every rank (`join_world`)
    base: int = 0  # island jobs (distributed/link.py): the mesh rank of this c10d job's rank 0
    job_size: int | None = None  # the ranks of this c10d job (None: the world)

    @property
    def job_rank(self) -> int:
        """This rank in its c10d job (the job's store and watchdog speak these numbers)."""
        return self.rank - self.base

    @property
    def job_world(self) -> int:
        return self.job_size or self.world_size

    @property
    def coords(self) -> dict[str, int]:
        return coords_of(self.rank, self.shape)

    def size(self, dim: str) -> int:
        dims = COMPOSITES.get(dim, (dim,))
        return math.prod(self.shape.get(d, 1) for d in dims)

    def index(self, dim: str) -> int:
        """This rank's position within the group along `dim` (composite dims row-major)."""
        c = self.coords
        idx = 0
        for d in COMPOSITES.get(dim, (dim,)):
            idx = idx * self.shape.get(d, 1) + c[d]
        return idx

    def data_index(self) -> int:
        """This rank's data-parallel replica over the job: islands split the global batch like dp."""
        return self.coords["islands"] * self.size("dp") + self.index("dp")

    def comm(self, dim: str) -> Comm:
        return self.comms[dim]

    @property
    def is_logger(self) -> bool:
        return self.rank == 0

    def all_comms(self) -> list[Comm]:
        return list(self.comms.values())

    def close(self) -> None:
        """Let go of every process group: autograd graphs and optimizers keep Comms alive past the
        trainer, and a group's C++ object (its gloo threads) lives as long as a Comm points at it."""
        for c in self.comms.values():
            c.release()


def ranks_share_gpus() -> bool:
    """More local ranks than CUDA devices: ranks take the devices round-robin and talk over gloo through
    host memory (NCCL refuses two ranks on one device): a way to run multi-rank CUDA paths on one GPU,
    for checking, not for speed (docs/architecture.md, "Ranks sharing a GPU")."""
    return torch.cuda.is_available() and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()


def pick_device(kind: str = "auto") -> torch.device:
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if kind in ("cuda", "auto"):
        local = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    raise ValueError(f"training.device: unknown device '{kind}'")


def device_defaults(cfg):
    """training.precision / compile and model.attn_impl = "auto" resolved for the device training.device
    names (`cfg`, a Config, in place): a CUDA device, with or without bf16, or a CPU. A GPU job resolves
    on every rank, each for its own; the rule itself is core/config/sections.py `apply_device`."""
    t = cfg.training
    if "auto" not in (t.precision, t.compile, cfg.model.attn_impl):  # nothing to probe (still checked)
        return apply_device(cfg, False)
    cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    # bf16 support is asked only where it decides something (precision "auto")
    bf16 = t.precision == "auto" and cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return apply_device(cfg, cuda, bf16)


def agent_restarts() -> int:
    """This process's agent's restart count: not the job's when agents joined at different times."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def join_world(device: torch.device, timeout_s: float = 300.0) -> int:
    """Form the default (world) process group if there is none, and return the job's restart count:
    the largest of every rank's agent's count (one all-reduce MAX). An agent that joined a grown job
    later counts from 0, so its ranks would otherwise treat a restart as a fresh launch: the layout,
    the resume and the restart line must see one value on every rank (docs/fault_tolerance.md,
    "Growing back"). Start-up runs it before the layout is resolved."""
    if not _init_world(device, timeout_s):
        return agent_restarts()
    count = torch.tensor([agent_restarts()], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _init_world(device: torch.device, timeout_s: float) -> bool:
    """The default process group of the torchrun environment (made once); False when running alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is
        # imported, and torch._dynamo (the first optimizer) imports it: imported after the world group
        # exists, those defaults would hold the group until the interpreter's finalization, past
        # destroy_process_group, with its gloo threads. Imported first, they hold None.
        import torch.distributed.nn.functional  # noqa: F401
        nccl = device.type == "cuda" and not ranks_share_gpus()
        dist.init_process_group("nccl" if nccl else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=device if nccl else None,
                                **_attempt_store(int(os.environ.get("RANK", "0")), world, timeout_s))
    return world > 1


def init_context(shape: dict[str, int], device: torch.device, timeout_s: float = 300.0,
                 restarts: int | None = None) -> ParallelContext:
    """Join the job described by the torchrun environment (or run alone) and build all groups.
    `restarts`: the count `join_world` agreed on (None: join and agree now)."""
    job = int(os.environ.get("WORLD_SIZE", "1"))  # this c10d job's ranks: the world, or one island job's
    island = island_job()
    base = island[0] * job if island else 0  # the mesh rank of this job's rank 0
    world, rank = job * (island[1] if island else 1), base + int(os.environ.get("RANK", "0"))
    need = math.prod(shape.get(d, 1) for d in DIMS)
    if need != world:
        raise RuntimeError(f"layout needs {need} ranks but WORLD_SIZE is {world}")
    _init_world(device, timeout_s)
    if restarts is None:
        restarts = join_world(device, timeout_s)
    ctx = ParallelContext(rank=rank, world_size=world, shape=dict(shape), device=device, restarts=restarts,
                          base=base, job_size=job)

    def comm(name: str, groups: list[list[int]]) -> Comm:
        """Every group lies inside one island; an island job makes only its own, in its own rank numbers."""
        mine = [[r - base for r in g] for g in groups if base <= g[0] < base + job]
        return _make_comm(name, mine, rank - base, job, timeout_s)
    for name in DIMS + tuple(COMPOSITES):
        if name != "islands" or not island:
            ctx.comms[name] = comm(name, groups_along(COMPOSITES.get(name, (name,)), shape))
    # The two ends of each pipeline (first and last stage): the copies of a tied embedding. Middle
    # stages are alone in theirs.
    ends = []
    for g in groups_along(("pp",), shape):
        ends.append([g[0], g[-1]] if len(g) > 1 else g)
        ends += [[r] for r in g[1:-1]]
    ctx.comms["pp_ends"] = comm("pp_ends", ends)
    # Expert parallelism: a second view of the dp×cp ranks (experts × expert-data), groups of its own.
    ep = shape.get("ep", 1)
    if ep > 1:
        for name, groups in expert_groups(shape, ep).items():
            if groups:
                ctx.comms[name] = comm(name, groups)
    if shape.get("zpp", 0):  # ZeRO++ (docs/zero.md): node-sized blocks of each shard group
        for name, groups in zpp_groups(shape, shape["zpp"]).items():
            ctx.comms[name] = comm(name, groups)
    ctx.comms["world"] = Comm("world", dist.group.WORLD if job > 1 else None, list(range(job)), rank - base)
    # This rank's island: the training math's world (docs/architecture.md, "Islands"); at one island the
    # world group itself (no new group), booked apart. An island job's `islands` Comm is its link's.
    ctx.comms["island"] = comm("island", groups_along(ISLAND, shape))
    if island:
        ctx.comms["islands"] = LinkComm("islands", [island[0]], island[0])
    return ctx


def _attempt_store(rank: int, world: int, timeout_s: float) -> dict:
    """After an elastic restart, a key prefix of this attempt's own in the job's store: the agent's
    store outlives the workers, and the first attempt's process-group keys (peer addresses of dead
    workers) would otherwise be read back and make the new ranks' connections fail. The
    workers of one round may have different restart counts (a node that joined later: its agent's
    count starts at 0), so the prefix is only used where the store outlives rounds: the agent's own.
    Otherwise each round's rank 0 hosts a fresh store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    attempt = agent_restarts()  # the group does not exist yet: nothing to agree with
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if attempt == 0 or "MASTER_ADDR" not in os.environ or not agent:
        return {}
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=False, timeout=timedelta(seconds=timeout_s))
    return {"store": dist.PrefixStore(f"meshlm/attempt_{attempt}", base), "rank": rank, "world_size": world}


def _make_comm(name: str, all_groups: list[list[int]], rank: int, world: int, timeout_s: float) -> Comm:
    mine = next(g for g in all_groups if rank in g)
    handle = None
    for g in all_groups:  # every rank creates every group, in the same order
        if len(g) == 1 or len(g) == world:  # no group needed (the same choice on every rank)
            continue
        pg = dist.new_group(g, timeout=timedelta(seconds=timeout_s))
        if rank in g:
            handle = pg
    if len(mine) == 1:
        return Comm(name, None, mine, rank)
    if len(mine) == world:
        return Comm(name, dist.group.WORLD, mine, rank)
    return Comm(name, handle, mine, rank)


def shutdown(ctx: ParallelContext | None = None, finished: bool = False, since: set[int] | None = None) -> list[str]:
    """Tear this rank's side of the job down while the interpreter is whole (docs/fault_tolerance.md,
    "Exit status"): every group destroyed and its last reference dropped, so the C++ objects and their
    gloo threads end here and not in the interpreter's finalization. `finished`: every rank got here
    after the last step, so a barrier first (no rank closes a connection a peer still reads from);
    after a failure there is none (the peers may be gone). Returns the threads still alive after it
    that were not there before `since` (`thread_ids()` taken at start-up)."""
    if finished and ctx is not None and ctx.world_size > 1:
        try:
            ctx.comm("world").barrier()
        except Exception:  # noqa: BLE001 - a peer that left early; tearing down goes on
            pass
    if ctx is not None:
        ctx.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups held by reference cycles (modules, hooks, graphs) end now
    return threads_alive(since)


# Threads of c10d's gloo backend, by the names they give themselves (/proc/self/task/*/comm).
GLOO_THREADS = ("gloo", "pt_gloo")
TASKS = "/proc/self/task"


def thread_ids() -> set[int]:
    """This process's OS thread ids (Linux; empty elsewhere)."""
    return {int(t) for t in os.listdir(TASKS)} if os.path.isdir(TASKS) else set()


def threads_alive(since: set[int] | None = None) -> list[str]:
    """Threads that outlive a teardown: gloo's C++ threads (a process group still referenced
    somewhere), and Python threads other than the main one (with `since`: started after it; a caller's
    own threads are not the run's). Other C++ threads (torch's intra-op pool) end with the process."""
    import threading
    python = {t.native_id: t.name for t in threading.enumerate() if t is not threading.main_thread()}
    out = []
    for tid in sorted(thread_ids()):
        try:
            with open(os.path.join(TASKS, str(tid), "comm")) as f:
                name = f.read().strip()
        except OSError:
            continue
        if tid in python and tid not in (since or set()):
            out.append(f"{python[tid]} (python)")
        elif tid not in python and name.startswith(GLOO_THREADS):
            out.append(name)
    return out
