"""A real link between two network namespaces (a veth pair): cut it in the middle of
transfers, bring it back, and degrade it with loss and a rate limit. Needs root and the `ip`
command; skips with the reason where namespaces cannot be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import random_bytes

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
ENDED = {hixl.TransferStatus.COMPLETED, hixl.TransferStatus.FAILED, hixl.TransferStatus.TIMEOUT}


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check)


@dataclass
class Net:
    ns: str  # the target's namespace; the test process stays in the root namespace
    dev: str  # the root namespace's end of the veth pair
    here: str  # its address
    there: str  # the target's address

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def link(self, up: bool) -> None:
        sh("ip", "link", "set", self.dev, "up" if up else "down")
        if up:  # wait until the route is back
            deadline = time.monotonic() + 5
            host = self.there.split(":")[0]
            while sh("ip", "route", "get", host, check=False).returncode != 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def _why_no_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "needs the 'ip' command (iproute2)"
    r = sh("ip", "netns", "add", f"hixl-probe-{os.getpid()}", check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    sh("ip", "netns", "del", f"hixl-probe-{os.getpid()}", check=False)
    return None


@pytest.fixture
def net() -> Iterator[Net]:
    why = _why_no_netns()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    ns, dev, peer_dev = f"hixl-t{tag}", f"hxa{tag}", f"hxb{tag}"
    octet = os.getpid() % 200 + 20
    here, there = f"10.{octet}.77.1", f"10.{octet}.77.2"
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", dev, "type", "veth", "peer", "name", peer_dev)
        sh("ip", "link", "set", peer_dev, "netns", ns)
        sh("ip", "addr", "add", f"{here}/24", "dev", dev)
        sh("ip", "link", "set", dev, "up")
        sh("ip", "-n", ns, "addr", "add", f"{there}/24", "dev", peer_dev)
        sh("ip", "-n", ns, "link", "set", peer_dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield Net(ns, dev, here, f"{there}:18515")
    finally:
        sh("ip", "link", "del", dev, check=False)
        sh("ip", "netns", "del", ns, check=False)


def test_link_cut_mid_transfer_then_reconnect(net: Net, make_peer) -> None:
    size = 32 << 20
    peer = make_peer(size, env={"HIXL_TEST_LISTEN": net.there}, prefix=net.exec_prefix())
    e = hixl.Hixl()
    e.initialize(net.here, {"hixl.backends": "tcp", "hixl.heartbeat_ms": "200"})
    try:
        src = random_bytes(size, 8)
        e.register(src)
        e.connect(peer.engine, timeout_ms=5000)
        e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, size)], 20_000)
        assert (peer.read() == src).all()

        timeout_ms = 4000
        reqs = [
            e.transfer_async(
                peer.engine, op, [(src.ctypes.data, peer.addr, size)], timeout_ms=timeout_ms
            )
            for op in (W, R) * 8
        ]
        time.sleep(0.01)
        t0 = time.monotonic()
        net.link(up=False)
        statuses = [r.wait(timeout_ms + 2000) for r in reqs]
        took = time.monotonic() - t0
        assert set(statuses) <= ENDED, statuses
        assert any(st != hixl.TransferStatus.COMPLETED for st in statuses)
        print(
            f"fault: link cut, heartbeat 200 ms: {len(statuses)} pending ended within {took:.3f} s"
        )
        assert took < timeout_ms / 1000 + 1, f"pending requests ended {took:.1f} s after the cut"
        with pytest.raises((hixl.NotConnected, hixl.Timeout)):
            e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, 4096)], 1000)

        net.link(up=True)
        src2 = random_bytes(size, 9)
        src[:] = src2
        e.connect(peer.engine, timeout_ms=5000)  # the dead link is replaced
        e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, size)], 20_000)
        assert (peer.read() == src2).all()
    finally:
        e.finalize()


def _degrade(net: Net) -> str:
    """Adds loss and delay (tc netem) where the kernel has it; otherwise 3 % random loss
    (nftables numgen) plus a 300 Mbit/s rate limit (tc tbf). Returns what was applied."""
    r = sh(
        "tc",
        "qdisc",
        "add",
        "dev",
        net.dev,
        "root",
        "netem",
        "delay",
        "5ms",
        "1ms",
        "loss",
        "3%",
        check=False,
    )
    if r.returncode == 0:
        return "netem delay 5ms±1ms loss 3%"
    if not shutil.which("nft"):
        pytest.skip(f"no tc netem in this kernel ({r.stderr.strip()}) and no nft command")
    rules = (
        "table inet hixl_loss {\n  chain input {\n    type filter hook input priority 0; "
        "policy accept;\n    numgen random mod 100 < 3 drop\n  }\n}\n"
    )
    subprocess.run(
        ["ip", "netns", "exec", net.ns, "nft", "-f", "-"],
        input=rules,
        text=True,
        check=True,
        capture_output=True,
    )
    sh(
        "tc",
        "qdisc",
        "add",
        "dev",
        net.dev,
        "root",
        "tbf",
        "rate",
        "300mbit",
        "burst",
        "256kb",
        "latency",
        "100ms",
    )
    return "nftables 3% loss + tbf 300mbit (no netem in this kernel)"


def test_loss_and_rate_limit_never_corrupt_data(net: Net, make_peer) -> None:
    size = 8 << 20
    peer = make_peer(size, env={"HIXL_TEST_LISTEN": net.there}, prefix=net.exec_prefix())
    e = hixl.Hixl()
    e.initialize(net.here, {"hixl.backends": "tcp"})
    try:
        src = random_bytes(size, 10)
        back = random_bytes(size, 11)
        e.register(src)
        e.register(back)
        e.connect(peer.engine, timeout_ms=5000)
        applied = _degrade(net)
        for i in range(3):
            src[:] = random_bytes(size, 20 + i)
            blocks = [
                (src.ctypes.data + k * 65536, peer.addr + ((k * 37) % 128) * 65536, 65536)
                for k in range(128)
            ]
            e.transfer_sync(peer.engine, W, blocks, 60_000)
            e.transfer_sync(peer.engine, R, [(back.ctypes.data, peer.addr, size)], 60_000)
            want = peer.read()
            assert (back == want).all(), applied
            print(f"fault: {applied}: round {i} of 8 MiB scattered + read back intact")
            for k in range(128):
                r = (k * 37) % 128
                assert (want[r * 65536 : (r + 1) * 65536] == src[k * 65536 : (k + 1) * 65536]).all()
    finally:
        e.finalize()
