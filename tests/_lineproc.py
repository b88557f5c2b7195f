"""A helper process driven by lines on stdin/stdout: the peers of the security tests. Its
first line starts with a ready word (READY unless told otherwise) and the words after it."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).parent


class LineProc:
    """`python ARGS...` in tests/, answering one line per command."""

    def __init__(
        self,
        args: list[object],
        ready: str = "READY",
        python: str | None = None,
        env: dict[str, str] | None = None,
        ready_s: float = 60,
    ) -> None:
        """`python` (default: this interpreter) runs ARGS with `env` (default: this one's); its
        first line must come within `ready_s` seconds."""
        self.name = Path(str(args[0])).name
        self.p = subprocess.Popen(
            [python or sys.executable, *map(str, args)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=HERE,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        first = self.line(ready_s)
        assert first.startswith(ready), f"{self.name} said {first!r}"
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
