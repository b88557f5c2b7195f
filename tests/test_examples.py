"""The programs in examples/ run as written, as real processes, and the README and docs/ show them.

Each pair starts its waiting side first (target.py, kv_decode.py), takes the address from its
"READY ip:port" line, runs the other side against it, and requires exit 0 from both and the
lines each prints on success. The Rust example runs only where CI asks for it
(HIXL_EXAMPLES_RUST=1 and cargo on the PATH): building it takes minutes."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"
# Where excerpts of the examples are shown: the README (the quick start) and the guides in docs/
# (docs/GUIDE.md has the whole Python walkthrough, docs/KV.md the KV-cache example).
SHOWN_IN = [README, *sorted((ROOT / "docs").glob("*.md"))]
LIMIT_S = 120  # per process; each pair takes about a second


class Example:
    """One example program as a subprocess; its stdout lines are collected as they come."""

    def __init__(self, script: str, *args: str) -> None:
        self.name = script
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.err = ""
        self._new = threading.Condition()
        self._out = threading.Thread(target=self._read_out, daemon=True)
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._out.start()
        self._err.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()

    def ready(self, timeout_s: float = LIMIT_S) -> str:
        """The address of the "READY ip:port" line, waiting for it at most timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._new:
            while True:
                for line in self.lines:
                    if line.startswith("READY "):
                        return line.split()[1]
                left = deadline - time.monotonic()
                if self.proc.poll() is not None and not self._out.is_alive():
                    break
                if left <= 0:
                    break
                self._new.wait(min(left, 0.1))
        self.kill()
        pytest.fail(f"{self.name} printed no READY line:\n{self.report()}")

    def finish(self, timeout_s: float = LIMIT_S) -> int:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name} did not end within {timeout_s} s:\n{self.report()}")
        self._out.join(10)
        self._err.join(10)
        return rc

    def succeeds(self, *expected: str, timeout_s: float = LIMIT_S) -> list[str]:
        """Waits for exit 0 and a line starting with each of `expected`; returns the lines."""
        rc = self.finish(timeout_s)
        assert rc == 0, f"{self.name} exited {rc}:\n{self.report()}"
        for want in expected:
            assert any(line.startswith(want) for line in self.lines), (
                f"{self.name} printed no line starting {want!r}:\n{self.report()}"
            )
        return self.lines

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def report(self) -> str:
        return "stdout:\n" + "\n".join(self.lines) + "\nstderr:\n" + self.err


@pytest.fixture
def run() -> Iterator:
    started: list[Example] = []

    def start(script: str, *args: str) -> Example:
        ex = Example(script, *args)
        started.append(ex)
        return ex

    yield start
    for ex in started:
        ex.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TARGET_LINES = ("notify kv: page 0", "notify kv: layer 2", "notify done: ", "'kv' holds what")
INITIATOR_LINES = (
    "connected to ",
    "write 16777216 bytes, read them back: ok",
    "async write 'first page': TransferStatus.COMPLETED",
    "put 4096 bytes, get 16384: ok",
    "strided put/get of layers 1 and 2 (4096 rows each): ok",
    "backend ",
    "sent 'done'",
)


@pytest.mark.parametrize("backends", ["auto", "tcp"])
def test_target_and_initiator(run, backends: str) -> None:
    target = run("target.py", "--listen", "127.0.0.1:0")
    remote = target.ready()
    out = run("initiator.py", "--remote", remote, "--backends", backends).succeeds(*INITIATOR_LINES)
    target.succeeds(*TARGET_LINES)
    backend = next(line.split()[1] for line in out if line.startswith("backend "))
    # auto: the same-host backend, or TCP where this process may not attach to the target
    allowed = ("cuda_ipc", "shm", "tcp") if backends == "auto" else ("tcp",)
    assert backend.rstrip(":") in allowed, out


def test_target_and_initiator_started_together(run) -> None:
    """The README's `target.py & initiator.py`: the initiator may connect before the target
    listens or before it has registered "kv", and must wait for both."""
    remote = f"127.0.0.1:{free_port()}"
    target = run("target.py", "--listen", remote)
    run("initiator.py", "--remote", remote).succeeds(*INITIATOR_LINES)
    target.succeeds(*TARGET_LINES)


def test_kv_prefill_pushes_layer_by_layer_to_decode(run) -> None:
    decode = run("kv_decode.py", "--listen", "127.0.0.1:0")
    address = decode.ready()
    prefill = run("kv_prefill.py", "--decode", address)
    prefill.succeeds(
        *(f"layer {k}: computed, sending" for k in range(8)),
        "pushed 16777216 bytes in 8 layers to rank 1",
    )
    decode.succeeds(
        *(f"layer {k}: arrived and used" for k in range(8)),
        "received 16777216 bytes in 8 layers from rank 0",
    )


def test_examples_fail_with_a_nonzero_exit(run) -> None:
    """Every wait has a timeout, and a failure is an exit status, not a hang."""
    target = run("target.py", "--timeout-s", "0.5")
    target.ready()
    assert target.finish() == 1
    assert "no 'done' notification within 0.5 s" in target.err, target.report()
    nobody = f"127.0.0.1:{free_port()}"
    initiator = run("initiator.py", "--remote", nobody, "--timeout-ms", "300")
    assert initiator.finish() != 0, initiator.report()
    decode = run("kv_decode.py", "--timeout-s", "0.5")
    decode.ready()
    assert decode.finish() != 0, decode.report()


@pytest.mark.skipif(
    os.environ.get("HIXL_EXAMPLES_RUST") != "1" or shutil.which("cargo") is None,
    reason="the Rust example builds with cargo (minutes): set HIXL_EXAMPLES_RUST=1, as CI "
    "does, with cargo on the PATH",
)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", ["two_engines", "async_service"])
def test_rust_examples(example: str) -> None:
    proc = subprocess.run(
        ["cargo", "run", "--release", "-q", "-p", "hixl-core", "--example", example],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "read back and verified" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(
    os.environ.get("HIXL_EXAMPLES_RUST") != "1" or shutil.which("cargo") is None,
    reason="the Rust example builds with cargo (minutes): set HIXL_EXAMPLES_RUST=1, as CI "
    "does, with cargo on the PATH",
)
@pytest.mark.timeout(900)
def test_rdma_raw_latency_example_runs_on_the_soft_provider() -> None:
    """benches/rdma.py's raw baseline (one QP, post a WRITE, poll the CQ) between two
    processes; its last line is what the bench parses."""
    args = ["--provider", "soft", "--size", "4096", "--iters", "50"]
    proc = subprocess.run(
        ["cargo", "run", "--release", "-q", "-p", "hixl-core", "--example", "rdma_raw_lat", "--"]
        + args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    want = r"raw_write_lat size=4096 iters=50 median_us=[\d.]+ p99_us=[\d.]+"
    assert re.fullmatch(want, last), last


RUST_SNIPPET_MAIN = """#![allow(unused)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
%s
    Ok(())
}
"""


def rust_snippets() -> list[tuple[str, str]]:
    """Every ```rust block of the README and docs/, as (where, code)."""
    out = []
    for doc in SHOWN_IN:
        for i, m in enumerate(re.finditer(r"^```rust\n(.*?)^```", doc.read_text(), re.S | re.M)):
            out.append((f"{doc.relative_to(ROOT)}#{i}", m.group(1)))
    return out


def test_docs_show_rust_snippets() -> None:
    """The README and the guide show the Rust API, the notify path included (a user must not
    have to guess how a NotifyDesc is made)."""
    shown = rust_snippets()
    assert any(w.startswith("README.md") for w, _ in shown), shown
    assert any("NotifyDesc::new(" in code for _, code in shown), "no Rust snippet sends a notify"


@pytest.mark.skipif(
    os.environ.get("HIXL_EXAMPLES_RUST") != "1" or shutil.which("cargo") is None,
    reason="the Rust snippets build with cargo (minutes): set HIXL_EXAMPLES_RUST=1, as CI "
    "does, with cargo on the PATH",
)
@pytest.mark.timeout(900)
def test_rust_snippets_in_the_docs_compile(tmp_path: Path) -> None:
    """Every ```rust block of the README and docs/ compiles against hixl-core, each as the body
    of a main returning a Result (they connect to peers that are not there: built, not run)."""
    crate = tmp_path / "snippets"
    (crate / "src" / "bin").mkdir(parents=True)
    core = ROOT / "crates" / "hixl-core"
    (crate / "Cargo.toml").write_text(
        '[package]\nname = "doc-snippets"\nversion = "0.0.0"\nedition = "2021"\n'
        f'publish = false\n\n[dependencies]\nhixl-core = {{ path = "{core}" }}\n\n'
        "[workspace]\n"
    )
    shutil.copy(ROOT / "Cargo.lock", crate / "Cargo.lock")
    where = {}
    for i, (w, code) in enumerate(rust_snippets()):
        body = "\n".join("    " + line for line in code.splitlines())
        (crate / "src" / "bin" / f"s{i}.rs").write_text(RUST_SNIPPET_MAIN % body)
        where[f"s{i}"] = w
    proc = subprocess.run(
        ["cargo", "build", "--release", "-q", "--bins"],
        cwd=crate,
        env={**os.environ, "CARGO_TARGET_DIR": str(ROOT / "target")},
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, f"{where}\n{proc.stderr[-6000:]}"


def readme_excerpts(doc: Path = README) -> list[tuple[str, list[str]]]:
    """Code blocks of `doc` whose first line is `# examples/NAME` (or `// examples/...`)."""
    out = []
    for m in re.finditer(r"^```\w*\n(.*?)^```", doc.read_text(), re.S | re.M):
        lines = m.group(1).splitlines()
        head = re.match(r"^(?:#|//) (examples/\S+|crates/\S+)", lines[0]) if lines else None
        if head:
            out.append((head.group(1), lines[1:]))
    return out


def test_readme_shows_the_example_files() -> None:
    """Each block of the README or docs/ headed by a file's path is an excerpt of that file: its
    lines appear in the file, in order, indentation aside (a line `...` stands for lines left
    out)."""
    in_readme = {path for path, _ in readme_excerpts()}
    for name in ("target.py", "initiator.py"):  # the README's quick start
        assert f"examples/{name}" in in_readme, f"README shows no excerpt of examples/{name}"
    excerpts = [(doc, path, lines) for doc in SHOWN_IN for path, lines in readme_excerpts(doc)]
    shown = {path for _, path, _ in excerpts}
    for name in ("target.py", "initiator.py", "kv_prefill.py", "kv_decode.py"):
        assert f"examples/{name}" in shown, f"README and docs/ show no excerpt of examples/{name}"
    for doc, path, lines in excerpts:
        file_lines = (ROOT / path).read_text().splitlines()
        i = 0
        for line in lines:
            if line.strip() in ("...", "# ...", "// ..."):
                continue
            while i < len(file_lines) and file_lines[i].strip() != line.strip():
                i += 1
            where = f"{doc.name}'s excerpt of {path}"
            assert i < len(file_lines), f"{where}: {line!r} is not in the file"
            i += 1
