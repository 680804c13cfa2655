"""A gloo group's synchronous exchanges over sockets its ranks' own threads read and write, when every
member runs on this host (docs/architecture.md, "Collectives on gloo").

gloo hands each collective from the calling thread to a work thread and from there to its transport's
event loop and back: on two cores that is ~0.2 ms a call whatever its size, and a tensor-parallel step
makes hundreds of calls. An exchange of the same bytes over a TCP connection per pair of ranks, written
and read by the calling thread itself, took 20-50 µs there. Only synchronous calls come here: an async
one returns before its bytes move, and only gloo's threads move them later.

Every message carries a header (the sender's call number, its byte count): a rank that reached another
collective than its peer fails at once, naming both, instead of reading the wrong bytes.
"""
from __future__ import annotations

import ctypes
import os
import secrets
import select
import socket
import struct
import time
import zlib

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch's current name
HEADER = struct.Struct("<QQ")  # the sender's call number, the payload's bytes
HELLO = struct.Struct("<QQ")  # the connecting rank's index in the group, the listener's token


def enabled() -> bool:
    """MESHLM_GLOO_SOCKETS=0 leaves every exchange to gloo's all-to-all (to compare, or to bisect)."""
    return os.environ.get("MESHLM_GLOO_SOCKETS", "1") not in ("0", "false", "no")


def host_key() -> int:
    """Equal on two processes only when they share a host, its boot and its network namespace (two
    containers on one host have different namespaces: their loopbacks do not meet)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:  # not Linux: the host name alone
        pass
    return zlib.crc32("|".join(parts).encode()) & 0x7FFFFFFF


def group_timeout(group) -> float:
    """The group's own timeout (what gloo would wait), 30 min where torch does not say."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 1800.0


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own memory, writable, no copy. Read by address: it is the transport's
    job (gloo does the same in C++), and a training step must not call the tensor's host-read methods
    (tests/test_sync_free.py forbids them: on a GPU they would wait for the device)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"a socket exchange takes contiguous host tensors, not {t.device} {tuple(t.stride())}")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(bytearray())


class Links:
    """One connected socket to every other member of a group; `exchange` is an all-to-all of blocks."""

    def __init__(self, socks: dict[int, socket.socket], index: int, timeout_s: float):
        self.socks, self.index, self.timeout_s = socks, index, timeout_s
        self.calls = 0

    @classmethod
    def connect(cls, group, index: int, size: int) -> Links | None:
        """Every member listens on loopback and tells the others its port through one gloo all-gather;
        each connects to the members before it and accepts the ones after it. None (on every member
        alike) when they are not all on this host, or one of them could not listen (port 0)."""
        timeout_s = group_timeout(group)
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(size)
            port = listener.getsockname()[1]
        except OSError:  # no IPv4 loopback here: this group keeps gloo, on every member alike
            port = 0
        token = secrets.randbits(62)
        mine = torch.tensor([host_key(), port, token], dtype=torch.int64)
        every = torch.empty(size * 3, dtype=torch.int64)
        _all_gather(every, mine, group=group)
        flat = struct.unpack(f"<{3 * size}q", _bytes(every))
        rows = [flat[3 * r:3 * r + 3] for r in range(size)]
        if len({r[0] for r in rows}) != 1 or any(r[1] == 0 for r in rows):
            listener.close()
            return None
        socks: dict[int, socket.socket] = {}
        try:
            for peer in range(index):
                s = socket.create_connection(("127.0.0.1", rows[peer][1]), timeout=timeout_s)
                s.sendall(HELLO.pack(index, rows[peer][2]))
                socks[peer] = s
            listener.settimeout(timeout_s)
            while len(socks) < size - 1:
                s, _ = listener.accept()
                s.settimeout(timeout_s)
                peer, tok = HELLO.unpack(_read(s, HELLO.size))
                if tok != token or not index < peer < size or peer in socks:
                    s.close()  # not one of ours
                    continue
                socks[peer] = s
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        finally:
            listener.close()
        for s in socks.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        return cls(socks, index, timeout_s)

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.socks = {}

    def exchange(self, recv: list[torch.Tensor], send: list[torch.Tensor]) -> None:
        """send[p] goes to member p and recv[p] is filled from member p (contiguous CPU tensors; this
        member's own block is copied). All members call it with matching blocks, in the same order."""
        recv[self.index].copy_(send[self.index])
        self.move({p: send[p] for p in self.socks}, {p: recv[p] for p in self.socks})

    def move(self, send: dict[int, torch.Tensor], recv: dict[int, torch.Tensor]) -> None:
        """Send each send[p] to member p while filling each recv[p] from member p; every member of the
        group calls it at the same point (its call number is in each header), with the matching blocks."""
        self.calls += 1
        outgoing = {p: [memoryview(HEADER.pack(self.calls, t.numel() * t.element_size())), _bytes(t)]
                    for p, t in send.items()}
        incoming = {p: _Incoming(_bytes(t)) for p, t in recv.items()}
        deadline = time.monotonic() + self.timeout_s
        while outgoing or incoming:
            if self._send(outgoing) | self._recv(incoming):
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"socket exchange #{self.calls} waited {self.timeout_s:.0f} s for member(s) "
                                   f"{sorted(incoming) or sorted(outgoing)} of the group")
            self._wait(incoming, outgoing, left)

    def _wait(self, incoming: dict, outgoing: dict, seconds: float) -> None:
        """Sleep until a socket this exchange still reads or writes is ready (poll: no limit on the
        descriptors' numbers, where select stops at 1024)."""
        poller = select.poll()
        for p in set(incoming) | set(outgoing):
            events = (select.POLLIN if p in incoming else 0) | (select.POLLOUT if p in outgoing else 0)
            poller.register(self.socks[p], events)
        poller.poll(seconds * 1000)

    def _send(self, outgoing: dict[int, list[memoryview]]) -> bool:
        moved = False
        for p in list(outgoing):
            try:
                n = self.socks[p].sendmsg(outgoing[p])
            except BlockingIOError:
                continue
            except OSError as e:
                raise ConnectionError(f"member {p} of the group is gone ({e.strerror or e})") from e
            moved = True
            if not _advance(outgoing[p], n):
                del outgoing[p]
        return moved

    def _recv(self, incoming: dict[int, _Incoming]) -> bool:
        moved = False
        for p in list(incoming):
            msg = incoming[p]
            try:
                n = self.socks[p].recvmsg_into(msg.bufs)[0]
            except BlockingIOError:
                continue
            except OSError as e:
                raise ConnectionError(f"member {p} of the group is gone ({e.strerror or e})") from e
            if n == 0:
                raise ConnectionError(f"member {p} of the group closed its connection (it ended or failed)")
            moved = True
            if not msg.took(n, self.calls, p):
                del incoming[p]
        return moved


class _Incoming:
    """One message being read: its header, then the payload straight into the receiving tensor."""

    def __init__(self, payload: memoryview):
        self.header = bytearray(HEADER.size)
        self.size = len(payload)
        self.bufs = [memoryview(self.header), payload]
        self.got = 0

    def took(self, n: int, call: int, peer: int) -> bool:
        """Book n more bytes; False once the message is whole. The header is checked once it is in."""
        before, self.got = self.got, self.got + n
        if before < HEADER.size <= self.got:
            their_call, size = HEADER.unpack(self.header)
            if (their_call, size) != (call, self.size):
                raise RuntimeError(f"member {peer} of the group is at another collective: its call "
                                   f"#{their_call} sends {size} bytes, this rank's #{call} expects {self.size}")
        return _advance(self.bufs, n)


def _read(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("a connecting member closed its connection")
        out += chunk
    return out


def _advance(bufs: list[memoryview], n: int) -> bool:
    """Drop the first n bytes of a list of buffers (what a sendmsg or recvmsg moved); whether any are left."""
    while n and bufs:
        if n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][n:]
            n = 0
    while bufs and not len(bufs[0]):
        bufs.pop(0)
    return bool(bufs)
