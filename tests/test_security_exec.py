"""Exec after the same-host proof (issue 34, High 1): a proven same-host peer must not turn a
privileged initiator's direct copies (cross-memory attach, mapped memfds) into reads and
writes of a setuid program it execs afterwards. The rule is docs/RELIABILITY.md's "exec after
proof"; these tests perform the attack against real processes.

Root only: the attack needs a root initiator and a setuid-root program."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _lineproc import LineProc

import hixl

HERE = Path(__file__).parent
NOBODY = 65534
SECRET_LEN = 4096
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: a root initiator and a setuid-root program"
)

# The setuid-root program: reads the root-only file argv[1] into a page-aligned global buffer,
# tells descriptor 3 where that buffer is (and its effective uid), then sleeps until killed.
HELPER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
static char buf[4096] __attribute__((aligned(4096)));
int main(int argc, char **argv) {
    int fd = argc > 1 ? open(argv[1], O_RDONLY) : -1;
    if (fd < 0 || read(fd, buf, sizeof buf) != (ssize_t)sizeof buf) {
        dprintf(3, "ERR cannot read the secret as euid %d\n", (int)geteuid());
        return 1;
    }
    close(fd);
    dprintf(3, "ADDR %lu %zu %d\n", (unsigned long)buf, sizeof buf, (int)geteuid());
    close(3);
    for (;;)
        pause();
}
"""


def suid_dir() -> Path:
    """A fresh directory that other users can traverse, on a file system that honours setuid
    bits (not mounted nosuid)."""
    for base in (tempfile.gettempdir(), "/var/tmp", str(HERE)):
        if os.path.isdir(base) and not os.statvfs(base).f_flag & os.ST_NOSUID:
            d = Path(tempfile.mkdtemp(prefix="hixl-suid-", dir=base))
            d.chmod(0o755)
            return d
    pytest.skip("no file system here honours setuid bits (all are mounted nosuid)")


@pytest.fixture(scope="module")
def setuid_helper() -> Iterator[tuple[Path, Path, bytes]]:
    """(the setuid-root program, the root-only secret file, its bytes)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the setuid-root program")
    d = suid_dir()
    try:
        src, exe, secret = d / "helper.c", d / "helper", d / "secret.bin"
        src.write_text(HELPER_C)
        subprocess.run(["gcc", "-O1", "-o", exe, src], check=True, timeout=120)
        os.chown(exe, 0, 0)
        exe.chmod(0o4755)
        content = np.random.default_rng(34).integers(1, 256, SECRET_LEN, dtype=np.uint8).tobytes()
        secret.write_bytes(content)
        os.chown(secret, 0, 0)
        secret.chmod(0o600)
        yield exe, secret, content
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Peer(LineProc):
    """tests/_sec_exec.py run as `uid`: a same-host target that execs `exe` on "exec"."""

    def __init__(self, uid: int | str, exe: Path, secret: Path) -> None:
        super().__init__([HERE / "_sec_exec.py", uid, exe, secret])
        _, self.engine, pid, buf, n = self.words
        self.pid, self.buf, self.len = int(pid), int(buf), int(n)
        assert self.pid == self.p.pid

    def close(self, wait_s: float = 0) -> None:
        # The proven pid is the setuid program after "exec": killed (the child dies with it).
        with contextlib.suppress(OSError):
            self.p.kill()
        self.p.wait(10)


def ids(pid: int) -> tuple[list[str], list[str]]:
    """(real, effective, saved, fs uids), (the same gids) of process `pid`."""
    with open(f"/proc/{pid}/status") as f:
        lines = dict(line.split(":", 1) for line in f)
    return lines["Uid"].split(), lines["Gid"].split()


def memory(pid: int, addr: int, n: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(addr)
        return f.read(n)


def test_exec_after_proof_cannot_reach_setuid_program(
    setuid_helper: tuple[Path, Path, bytes],
) -> None:
    """An unprivileged peer (uid 65534) answers the same-host proof truthfully to a root
    initiator (default backends), then execs a setuid-root program (same pid, same pidfd, not
    exited) while a forked child keeps the streams and announces a region over the program's
    buffer, which holds a root-only file's bytes. Before the fix the link was `shm`: the root
    initiator's put wrote into the euid-0 program by cross-memory attach and its get read the
    root-only bytes out of it. Now a root initiator takes the direct path only with a root
    peer: the link is `tcp` and says why, the put and get reach only the child (which refuses
    them: the range is not in its memory), the program's buffer is byte for byte the secret,
    and no secret byte comes back."""
    exe, secret_file, secret = setuid_helper
    peer = Peer(NOBODY, exe, secret_file)
    try:
        assert ids(peer.pid) == ([str(NOBODY)] * 4, [str(NOBODY)] * 4), "the peer must be nobody"
        data = np.full(SECRET_LEN, 0xAB, np.uint8)
        got = np.full(SECRET_LEN, 0x5A, np.uint8)
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", {"hixl.heartbeat_ms": "0"})
            a.register(data)
            a.register(got)
            a.connect(peer.engine, timeout_ms=10000)
            link = a.stats()[peer.engine]
            said = peer.cmd("exec", timeout=30)
            assert said.startswith("EXECED"), said
            _, addr_s, n_s, euid, child, acked = said.split()
            addr, n = int(addr_s), int(n_s)
            assert euid == "0" and acked == "1", f"the program must run as euid 0: {said}"
            uids, _ = ids(peer.pid)
            assert uids[1] == "0" and uids[0] == str(NOBODY), f"pid {peer.pid} is setuid: {uids}"
            assert memory(peer.pid, addr, n) == secret, "the program holds the secret"
            outcome = {}
            for what, call in (
                ("put", lambda: a.put(peer.engine, data.ctypes.data, addr, 48, timeout_ms=10000)),
                ("get", lambda: a.get(peer.engine, got.ctypes.data, addr, n, timeout_ms=10000)),
            ):
                try:
                    call()
                    outcome[what] = "done"
                except hixl.HixlError as e:
                    outcome[what] = f"{type(e).__name__}: {e}"
            print(f"link {link}; peer {said}; {outcome}")
            after = memory(peer.pid, addr, n)
            written = sum(x != y for x, y in zip(after, secret, strict=True))
            assert after == secret, f"the root initiator wrote {written} bytes into the program"
            assert got.tobytes() == bytes([0x5A]) * SECRET_LEN, (
                f"the get returned bytes ({np.count_nonzero(got == 0x5A)} of {n} unchanged); "
                f"secret bytes among them: {got.tobytes() == secret}"
            )
            assert link["backend"] == "tcp", f"a root initiator took the direct path: {link}"
            assert "shm:" in link["not_chosen"] and "root" in link["not_chosen"], link
            assert str(NOBODY) in link["not_chosen"], f"the reason names the peer's uid: {link}"
            assert int(child) != peer.pid
    finally:
        peer.close()


def test_forced_shm_to_unprivileged_peer_is_unsupported(
    setuid_helper: tuple[Path, Path, bytes],
) -> None:
    """`hixl.backends=shm` from a root initiator to an unprivileged peer raises Unsupported
    and the message gives the reason (this process may access any process's memory, the
    peer, uid 65534, may not)."""
    exe, secret_file, _ = setuid_helper
    peer = Peer(NOBODY, exe, secret_file)
    try:
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", {"hixl.backends": "shm", "hixl.heartbeat_ms": "0"})
            with pytest.raises(hixl.Unsupported) as e:
                a.connect(peer.engine, timeout_ms=10000)
        print(e.value)
        assert "root" in str(e.value) and str(NOBODY) in str(e.value), e.value
    finally:
        peer.close()


def test_root_peer_keeps_the_direct_path(setuid_helper: tuple[Path, Path, bytes]) -> None:
    """No regression: a root initiator and a root peer (same credentials) still take `shm`,
    and a put lands in the peer's buffer by cross-memory attach (byte for byte)."""
    exe, secret_file, _ = setuid_helper
    peer = Peer("keep", exe, secret_file)
    try:
        assert ids(peer.pid) == (["0"] * 4, ["0"] * 4)
        data = np.random.default_rng(7).integers(0, 256, SECRET_LEN, dtype=np.uint8)
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", {"hixl.heartbeat_ms": "0"})
            a.register(data)
            a.connect(peer.engine, timeout_ms=10000)
            a.put(peer.engine, data.ctypes.data, peer.buf, SECRET_LEN, timeout_ms=10000)
            link = a.stats()[peer.engine]
        assert link["backend"] == "shm", f"root to root must stay direct: {link}"
        assert link["not_chosen"] == "" or "shm:" not in link["not_chosen"], link
        assert memory(peer.pid, peer.buf, SECRET_LEN) == data.tobytes(), "the put did not land"
    finally:
        peer.close()
