"""A gloo group's synchronous exchanges over its ranks' own sockets (distributed/sockets.py): the same bytes
as gloo's all-to-all, and every way an exchange can fail says so in one line instead of hanging."""
from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshlm.distributed import sockets
from meshlm.distributed.comm import CollectiveError, Comm

# (dtype, rows per block): one element, a block no socket buffer holds whole (4 MiB), sub-byte-free odd sizes
BLOCKS = [(torch.float32, 1), (torch.bfloat16, 1023), (torch.int64, 5), (torch.bool, 3), (torch.float32, 1 << 20)]


def _comm(group, members: list[int], sockets_on: bool) -> Comm:
    """A Comm on the group; without sockets it is one that found them unusable (as MESHLM_GLOO_SOCKETS=0
    leaves it), so the pool worker's environment, which later cases share, is never changed."""
    comm = Comm("t", group, members, dist.get_rank())
    if not sockets_on:
        comm._links = False
    return comm


def _data(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 100).to(dtype)


def same_bytes_case(ranks: list[int] | None) -> dict | None:
    """Every block size and dtype, equal and uneven splits (empty blocks among them), through the
    sockets and through gloo; both results and which path each Comm took."""
    group = dist.new_group(ranks) if ranks else dist.group.WORLD
    me, members = dist.get_rank(), ranks or list(range(dist.get_world_size()))
    if me not in members:
        return None
    k, i = len(members), members.index(me)
    out: dict = {}
    comms = {}
    for path in ("sockets", "gloo"):
        comm = comms[path] = _comm(group, members, path == "sockets")
        for dtype, rows in BLOCKS:
            inp = _data(dtype, rows * k, 7 * i + rows)
            got = torch.empty_like(inp)
            comm.all_to_all(got, inp)
            out[f"{path}-{dtype}-{rows}"] = hashlib.sha256(got.view(torch.uint8).numpy().tobytes()).hexdigest()
        # uneven: member j gets j rows from me (member 0 gets none), I get i rows from each
        inp = _data(torch.float32, sum(range(k)), 100 + i)
        got = torch.empty(i * k)
        comm.all_to_all(got, inp, [i] * k, list(range(k)))
        out[f"{path}-uneven"] = got.tolist()
        full, mine = _data(torch.float32, 64 * k, 200 + i), torch.empty(64)
        comm.reduce_scatter(mine, full)
        out[f"{path}-rs"] = mine.tolist()
    out["paths"] = [type(c._links).__name__ for c in comms.values()]
    for c in comms.values():
        c.release()
    return out


@pytest.mark.parametrize("world,ranks", [(2, None), (4, None), (4, [1, 3])], ids=["2", "4", "sub-1-3"])
def test_sockets_move_the_same_bytes_as_gloo(pools, world, ranks):
    for got in filter(None, pools(world).run(same_bytes_case, ranks)):
        assert got.pop("paths") == ["Links", "bool"]  # the sockets were used; the other took gloo's
        for key in [k for k in got if k.startswith("sockets-")]:
            # exact: both paths move the same bytes, and the reduce-scatter folds them with the same code
            # (direct.fold, rank order) whichever transport brought them
            assert got[key] == got[key.replace("sockets-", "gloo-")], key


def ring_case() -> tuple[list, list[float], int]:
    """A symmetric ring shift (context parallelism's rotation): each member sends to the next and
    receives from the previous, twice (a 2 MiB block, then a small one); the works left to wait on."""
    world, me = dist.get_world_size(), dist.get_rank()
    comm = _comm(dist.group.WORLD, list(range(world)), True)
    got = []
    for n in (1 << 19, 3):
        send, recv = torch.full((n,), float(me)), torch.empty(n)
        works = comm.batch_p2p([("send", send, (me + 1) % world), ("recv", recv, (me - 1) % world)], symmetric=True)
        got.append(recv.unique().tolist())
    comm.release()
    return works, got, comm.stats["send"].calls


@pytest.mark.parametrize("world", [2, 4])
def test_a_ring_shift_completes_over_the_sockets(pools, world):
    for me, (works, got, sends) in enumerate(pools(world).run(ring_case)):
        assert works == [] and sends == 2  # done on return, and booked as gloo's would be
        assert got == [[float((me - 1) % world)]] * 2


def failure_case(kind: str) -> str:
    """Rank 1 misbehaves after one good exchange; rank 0's next all-reduce's error, or '' on rank 1."""
    timeout = 2 if kind == "late" else 30
    group = dist.new_group([0, 1], timeout=timedelta(seconds=timeout))
    if dist.get_rank() > 1:
        return ""
    comm = _comm(group, [0, 1], True)
    comm.all_reduce(torch.ones(4))  # connects
    me = dist.get_rank()
    try:
        if me == 1 and kind == "gone":
            comm.release()  # closes its sockets: rank 0 reads end-of-stream
            return ""
        if me == 1 and kind == "late":
            time.sleep(timeout + 1)  # rank 0 gives up first
            return ""
        comm.all_reduce(torch.ones(4 if kind != "other" or me == 0 else 8))
        return "no error"
    except CollectiveError as e:
        return str(e)
    finally:
        comm.release()


@pytest.mark.parametrize("kind,said", [
    ("other", "member 1 of the group is at another collective: its call #2 sends 32 bytes, this rank's #2 expects 16"),
    ("gone", "member 1 of the group"),
    ("late", "socket exchange #2 waited 2 s for member(s) [1] of the group")])
def test_a_failed_exchange_is_named_on_one_line(pools, kind, said):
    msg = pools(2).run(failure_case, kind)[0]
    assert msg.startswith("rank 0: all_reduce on group 't' (ranks [0, 1]) failed: "), msg
    assert said in msg.splitlines()[0], msg


def _sum_of_ranks() -> tuple[str, list[float]]:
    """An all-reduce of (rank + 1) on the world: which path the Comm took, and the sum."""
    comm = _comm(dist.group.WORLD, list(range(dist.get_world_size())), True)
    t = torch.full((3,), float(dist.get_rank() + 1))
    comm.all_reduce(t)
    return type(comm._links).__name__, t.tolist()


def two_hosts_case() -> tuple[str, list[float]]:
    """Rank 1 says it is on another host: neither rank uses sockets, and the all-reduce still holds."""
    real = sockets.host_key
    if dist.get_rank() == 1:
        sockets.host_key = lambda: 12345  # this pool worker's module only; restored below
    try:
        return _sum_of_ranks()
    finally:
        sockets.host_key = real


def no_loopback_case() -> tuple[str, list[float]]:
    """Rank 0 cannot listen on 127.0.0.1 (an IPv6-only host): both keep gloo, and the all-reduce holds."""
    import socket as socket_module

    def refuse(self, address):
        raise OSError(99, "Cannot assign requested address")
    assert "bind" not in vars(socket_module.socket)  # inherited from _socket.socket: deleting ours restores it
    if dist.get_rank() == 0:
        socket_module.socket.bind = refuse
    try:
        return _sum_of_ranks()
    finally:
        if "bind" in vars(socket_module.socket):
            del socket_module.socket.bind


@pytest.mark.parametrize("case", ["other-host", "no-loopback"])
def test_members_that_cannot_connect_keep_gloo(pools, case):
    fn = two_hosts_case if case == "other-host" else no_loopback_case
    assert pools(2).run(fn) == [("bool", [3.0, 3.0, 3.0])] * 2


def test_the_header_reads_in_pieces():
    """A message read a few bytes at a time (how a loaded socket delivers it) is checked once its
    header is whole, then lands in the tensor."""
    payload = torch.zeros(3)
    msg = sockets._Incoming(memoryview(payload.view(torch.uint8).numpy()).cast("B"))
    wire = sockets.HEADER.pack(5, 12) + torch.tensor([1.0, 2.0, 3.0]).view(torch.uint8).numpy().tobytes()
    left = True
    for start in range(0, len(wire), 5):
        chunk = wire[start:start + 5]
        n = 0
        for buf in list(msg.bufs):  # what recvmsg_into does: fill the buffers in order
            k = min(len(buf), len(chunk) - n)
            buf[:k] = chunk[n:n + k]
            n += k
            if n == len(chunk):
                break
        left = msg.took(len(chunk), 5, 1)
    assert not left and payload.tolist() == [1.0, 2.0, 3.0]
    bad = sockets._Incoming(memoryview(bytearray(12)))
    bad.bufs[0][:16] = sockets.HEADER.pack(4, 12)
    with pytest.raises(RuntimeError, match="its call #4 sends 12 bytes, this rank's #5 expects 12"):
        bad.took(16, 5, 1)


def test_only_contiguous_host_memory_is_sent():
    """The socket path reads memory by address: a strided view would send the wrong bytes."""
    x = torch.arange(8, dtype=torch.float32)
    assert bytes(sockets._bytes(x[2:4])) == x[2:4].numpy().tobytes()
    with pytest.raises(ValueError, match="contiguous host tensors"):
        sockets._bytes(x[::2])
