"""A helper process driven by lines on stdin/stdout: the peers of the security tests. Its
first line starts with a ready word (READY unless told otherwise) and the words after it."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).parent


class LineProc:
    """`python ARGS...` in tests/, answering one line per command.

    ``python`` is another interpreter (default this one), ``env`` its environment and
    ``stderr`` a file for its stderr; its first line must come within ``ready_s`` seconds.
    ``wait=False`` returns at once: call ``await_ready``
    before the first command (so that several slow helpers start side by side). A helper
    with ``session=True`` leads a process group of its own, and ``close`` ends the group:
    the processes it started die with it."""

    def __init__(
        self,
        args: list[object],
        ready: str = "READY",
        *,
        python: str | None = None,
        env: dict[str, str] | None = None,
        stderr: object = None,
        wait: bool = True,
        session: bool = False,
        ready_s: float = 60,
    ) -> None:
        self.name = Path(str(args[0])).name
        self.ready_word = ready
        self.session = session
        self.p = subprocess.Popen(
            [python or sys.executable, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,  # type: ignore[arg-type]
            text=True,
            bufsize=1,
            cwd=HERE,
            env=env,
            start_new_session=session,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()
        self.words: list[str] = []
        if wait:
            self.await_ready(ready_s)

    def await_ready(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the first line, which must be the ready word."""
        first = self.line(timeout)
        assert first.startswith(self.ready_word), f"{self.name} said {first!r}"
        self.words = first.split()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())
        self.lines.put("")  # EOF

    def line(self, timeout: float = 30) -> str:
        """The next line ("" when the process ended); fails after `timeout` seconds."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no answer from {self.name} within {timeout} s")

    def send(self, *words: object) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(" ".join(map(str, words)) + "\n")
        self.p.stdin.flush()

    def cmd(self, *words: object, timeout: float = 30) -> str:
        self.send(*words)
        return self.line(timeout)

    def close(self, wait_s: float = 5) -> None:
        """Asks it to exit, then kills it after `wait_s` seconds."""
        if self.p.poll() is None:
            with contextlib.suppress(OSError):
                self.send("exit")
            try:
                self.p.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        if self.session:
            self.kill_group()
        self.pump.join(10)  # it read the end of the output: the pipes may close now
        for f in (self.p.stdin, self.p.stdout):
            with contextlib.suppress(OSError, ValueError):
                f.close()  # type: ignore[union-attr]

    def kill_group(self) -> None:
        """SIGKILL to the helper's process group (``session=True``): it and all it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)
