"""Shared fixtures: a target engine in a separate process, and helpers to compare its bytes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import numpy as np
import pytest

import hixl

PEER = Path(__file__).with_name("_peer.py")


def proc_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R running, S sleeping, T stopped, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class Peer:
    """A target process with one registered buffer."""

    def __init__(
        self,
        size: int,
        options: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        args = [*(prefix or []), sys.executable, str(PEER), str(size)]
        if options:
            args.append(json.dumps(options))
        self.size = size
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )
        line = self._line()
        tag, self.engine, addr = line.split()
        assert tag == "READY", line
        self.addr = int(addr)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait(10)}")
        return line.strip()

    def cmd(self, *words: object) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def read(self, off: int = 0, n: int | None = None) -> np.ndarray:
        """The target's bytes [off, off+n), fetched out of band (not through hixl)."""
        n = self.size - off if n is None else n
        fd, path = tempfile.mkstemp(prefix="hixl-peer-")
        os.close(fd)
        try:
            assert self.cmd("save", off, n, path) == "OK"
            return np.fromfile(path, dtype=np.uint8)
        finally:
            os.unlink(path)

    def notifies(self) -> list[list[str]]:
        return json.loads(self.cmd("notifies"))

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """Freezes the peer (SIGSTOP) for the block, so transfers to it cannot finish; it is
        resumed on exit whatever happens inside. Returns once the kernel reports it stopped
        (the signal is delivered asynchronously: a request sent at once could still be served)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 5
            while proc_state(self.proc.pid) != "T":
                assert time.monotonic() < deadline, "the peer did not stop within 5 s"
                time.sleep(0.001)
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Asks the peer to exit (never waiting on its answer), killing it after 10 s."""
        if self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Lateness:
    """How late this process runs: a thread sleeps `tick` seconds again and again and keeps the
    worst oversleep. A timing bound in a test adds what this saw, so that it asserts what the
    code does and not how punctually a busy machine schedules this process (the engine's own
    timer is late by about as much)."""

    def __init__(self, tick: float = 0.005) -> None:
        import threading

        self.tick, self.worst = tick, 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="lateness-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            time.sleep(self.tick)
            self.worst = max(self.worst, time.monotonic() - t0 - self.tick)

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)


@pytest.fixture
def make_peer() -> Iterator:
    peers: list[Peer] = []

    def make(
        size: int,
        options: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> Peer:
        p = Peer(size, options, env, prefix)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()


@pytest.fixture
def engine(request) -> Iterator[hixl.Hixl]:
    """An initiator engine; TCP data path unless parametrized indirectly with a transport (a
    name of `hixl.backends()`)."""
    backend = getattr(request, "param", "tcp")
    names = [b["name"] for b in hixl.backends()]
    assert backend in names, f"engine fixture: {backend!r} is not a backend of {names}"
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": backend})
    yield e
    e.finalize()


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=float(os.environ.get("HIXL_SOAK_SECONDS", "20")),
        help="duration of tests/test_soak.py (default 20, or $HIXL_SOAK_SECONDS)",
    )


@pytest.fixture
def soak_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--soak-seconds"))
