"""Resource caps of issue 34 (its Low items), each attack performed against a real target
process over real sockets: established streams per source (and one descriptor per stream),
RDMA queue pairs per engine and per source, and the software RDMA NIC's abstract socket.
docs/RELIABILITY.md ("Resource caps") cites these tests by name.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import _wire as w
import numpy as np
import pytest
from test_security import Engine, Proc, good_peer_seconds, procs  # noqa: F401  (procs: a fixture)

import hixl

HERE = Path(__file__).parent
SOFT = {"hixl.rdma.provider": "soft"}
BACKEND_OPEN, BACKEND_OPENED = 21, 22


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def raise_own_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


def open_idle_streams(
    addr: tuple[str, int], source: str, n: int
) -> tuple[list[w.Stream], list[str]]:
    """Up to `n` streams from `source`, each handshaken (Hello, Welcome) and then left idle.
    Returns the streams the target welcomed and the Error messages of those it refused;
    stops early when the target stops answering within 5 s (it ran out of descriptors)."""
    kept: list[w.Stream] = []
    refused: list[str] = []
    for i in range(n):
        try:
            st, _ = w.connect(addr, source=source, engine="idle", link_nonce=i + 1, timeout=5)
        except w.Refused as e:
            refused.append(e.message)
            continue
        except (TimeoutError, ConnectionError, OSError) as e:
            refused.append(f"no answer: {e!r}")
            break
        kept.append(st)
    return kept, refused


# --- established streams ---------------------------------------------------------------------


def test_established_streams_capped_per_source(procs: Callable[..., Proc]) -> None:  # noqa: F811
    """One source opens 400 idle handshaken streams against a target whose descriptor limit
    is 384. Uncapped, each stream cost two descriptors, so 186 streams used them all up and
    the target could accept nothing more. Now the source gets `hixl.max_streams_per_source`
    streams (default 0: a quarter of the descriptor limit, 96) and an Error naming that cap
    for the rest; each stream costs one descriptor, the target's descriptor count stays
    bounded, a good peer from another address still moves 4 KiB each way (bytes compared),
    and once the flood closes its streams the same source is served again."""
    raise_own_fd_limit(4096)
    t = Engine(procs)
    limit = 384
    cap = limit // 4
    resource.prlimit(t.pid, resource.RLIMIT_NOFILE, (limit, limit))
    base = fd_count(t.pid)
    kept, refused = open_idle_streams(t.addr, "127.0.0.7", 400)
    try:
        time.sleep(0.5)  # the refused streams' handshake threads end
        fds = fd_count(t.pid)
        print(f"{len(kept)} streams welcomed, {len(refused)} refused; descriptors {base} -> {fds}")
        assert len(kept) == cap, f"{len(kept)} streams welcomed; refusals: {refused[:1]}"
        assert refused and all("hixl.max_streams_per_source" in m for m in refused), refused[:3]
        assert "127.0.0.7" in refused[0], refused[0]
        assert fds <= base + cap + 16, f"{fds} descriptors for {len(kept)} streams (base {base})"
        took = good_peer_seconds(t)
        assert took < 5, f"the good peer took {took:.1f} s"
    finally:
        for st in kept:
            st.close()
    # Closed streams no longer count: the same source is served again.
    deadline = time.monotonic() + 10
    while fd_count(t.pid) > base + 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    again, refused = open_idle_streams(t.addr, "127.0.0.7", 4)
    for st in again:
        st.close()
    assert len(again) == 4, refused


# --- RDMA queue pairs ------------------------------------------------------------------------


def rdma_open(qpns: range) -> bytes:
    """A BackendOpen("rdma") frame's payload asking for one target QP per number in `qpns`
    (docs/PROTOCOL.md: u8 retired count, u8 QP count, then GID, LID, QPN, PSN, MTU each)."""
    qps = b"".join(bytes([0xFE] * 16) + struct.pack("<HIIB", 0, q, 7, 5) for q in qpns)
    body = bytes([0, len(qpns)]) + qps
    return bytes([4]) + b"rdma" + struct.pack("<I", len(body)) + body


def backend_opened(st: w.Stream, tag: int) -> tuple[int, str, bytes]:
    """(status, message, payload) of the BackendOpened answering `tag`."""
    while True:
        kind, got, _, payload = st.recv()
        if kind in w.TABLE_CHANGES:
            continue
        assert kind == BACKEND_OPENED and got == tag, (kind, got, payload[:80])
        status, n = struct.unpack_from("<II", payload)
        message = payload[8 : 8 + n].decode()
        (m,) = struct.unpack_from("<I", payload, 8 + n)
        return status, message, payload[12 + n : 12 + n + m]


def good_rdma_peer(t: Engine) -> None:
    """A good engine connects over rdma (soft) and puts and gets 4 KiB (bytes compared)."""
    data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    back = np.zeros(4096, np.uint8)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "rdma", **SOFT})
        e.register(data)
        e.register(back)
        e.connect(t.engine, timeout_ms=5000)
        assert e.stats()[t.engine]["backend"] == "rdma"
        e.put(t.engine, data.ctypes.data, t.buf, 4096, timeout_ms=5000)
        e.get(t.engine, back.ctypes.data, t.buf, 4096, timeout_ms=5000)
    assert (back == data).all()


def test_rdma_qps_capped_per_source(procs: Callable[..., Proc]) -> None:  # noqa: F811
    """Eight raw control links from one address each ask the target for 2 x 64 RDMA QPs
    (BackendOpen, the most one link may hold): uncapped, the target made all 1,024. Now it
    makes `hixl.rdma.max_qps_per_source` (256) for that source and answers the rest
    RESOURCE_EXHAUSTED naming the cap; a good peer from another address still gets an rdma
    link (bytes compared), and the QPs of closed links are given back."""
    t = Engine(procs, SOFT)

    def attack(links: int) -> tuple[int, list[str], list[w.Stream]]:
        granted, refused, streams = 0, [], []
        for i in range(links):
            st, welcome = w.connect(t.addr, source="127.0.0.9", link_nonce=100 + i)
            streams.append(st)
            assert any(c[0] == "rdma" for c in welcome["capabilities"]), welcome
            for k in range(2):
                tag = 10 + k
                st.send(BACKEND_OPEN, rdma_open(range(0x100 + 64 * k, 0x140 + 64 * k)), tag=tag)
                status, message, payload = backend_opened(st, tag)
                if status == 0:
                    granted += payload[1]  # the target's QP count
                else:
                    refused.append(message)
        return granted, refused, streams

    granted, refused, streams = attack(8)
    try:
        print(f"{granted} target QPs made for one source; {len(refused)} opens refused")
        assert granted == 256, f"the target made {granted} QPs for one source"
        assert refused and all("hixl.rdma.max_qps_per_source" in m for m in refused), refused[:2]
        assert "127.0.0.9" in refused[0], refused[0]
        good_rdma_peer(t)
    finally:
        for st in streams:
            st.close()
    # The links' QPs go with them: the source may open again.
    deadline = time.monotonic() + 10
    while True:
        granted, refused, streams = attack(1)
        for st in streams:
            st.close()
        if granted == 128 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert granted == 128, refused


# --- the software RDMA NIC's socket ----------------------------------------------------------


def soft_nic_socket(pid: int) -> str:
    """The abstract name of the soft NIC socket that process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    with open("/proc/net/unix") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("@hixl-softrdma-"):
                return parts[7][1:]
    raise AssertionError(f"process {pid} listens on no soft RDMA socket")


def threads_named(pid: int, name: str) -> int:
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
            n += f.read().strip() == name
    return n


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_soft_nic_refuses_other_users(procs: Callable[..., Proc]) -> None:  # noqa: F811
    """A process of another user (uid 65534; the target runs as root) connects to the target's
    soft RDMA NIC socket: the kernel's credentials of the connection (SO_PEERCRED) name it,
    and the device closes it at once without starting a responder for it. Uncapped, it held a
    responder thread for 10 s. Control: a root client's idle connection is kept until its
    Hello wait (1 s) ends."""
    t = Engine(procs, SOFT)
    name = soft_nic_socket(t.pid)
    other = procs(HERE / "_sec_softnic_client.py", name, 65534, 3, 3, ready="TIMES")
    times = [float(x) for x in other.words[1:]]
    print(f"uid 65534: closed after {times} s")
    assert all(0 <= x < 0.5 for x in times), f"another user's connections stayed open: {times}"
    root = procs(HERE / "_sec_softnic_client.py", name, "keep", 1, 5, ready="TIMES")
    (kept,) = (float(x) for x in root.words[1:])
    print(f"root: closed after {kept} s")
    assert 0.7 < kept < 3, f"a root client's idle connection was closed after {kept} s"
    good_rdma_peer(t)


def test_soft_nic_idle_flood_capped(procs: Callable[..., Proc]) -> None:  # noqa: F811
    """300 idle connections (of the target's own user) to its soft RDMA NIC socket, none
    sending a Hello: uncapped, that was 300 responder threads for 10 s each. Now at most 32
    wait for their Hello at once (the others are closed at once), each at most 1 s; a good
    peer's rdma link still works (bytes compared)."""
    raise_own_fd_limit(4096)
    t = Engine(procs, SOFT)
    name = soft_nic_socket(t.pid)
    socks = []
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + name)
            socks.append(s)
        time.sleep(0.3)
        most = threads_named(t.pid, "hixl-softnic-r")
        print(f"300 idle connections: {most} responder threads")
        assert most <= 32, f"{most} responder threads for 300 idle connections"
        t0 = time.monotonic()
        for s in socks:
            s.settimeout(max(0.01, t0 + 3 - time.monotonic()))
            try:
                assert s.recv(1) == b""
            except ConnectionError:
                pass
            except TimeoutError:
                pytest.fail(
                    f"an idle connection was still open {time.monotonic() - t0:.1f} s later"
                )
        good_rdma_peer(t)
    finally:
        for s in socks:
            s.close()
