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
import time
from collections.abc import Callable

import _wire as w
import pytest
from test_security import Engine, Proc, good_peer_seconds, procs  # noqa: F401  (procs: a fixture)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def raise_own_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))


def open_idle_streams(addr: tuple[str, int], source: str, n: int) -> tuple[list[w.Stream], list[str]]:
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
    is 384. Uncapped, each stream cost two descriptors, so about 170 streams used them all up
    and the target could accept nothing more. Now the source gets
    `hixl.max_streams_per_source` (256) streams and an Error naming that cap for the rest;
    each stream costs one descriptor, the target's descriptor count stays bounded, a good
    peer from another address still moves 4 KiB each way (bytes compared), and once the
    flood closes its streams the same source is served again."""
    raise_own_fd_limit(4096)
    t = Engine(procs)
    limit, cap = 384, 256
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
