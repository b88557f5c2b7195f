"""hixl's records in Python's logging: the `hixl` logger hierarchy, records made during
finalize delivered, drops counted when Python does not keep up, and a clean exit."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import hixl
import hixl._logging


def run(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_records_reach_the_hixl_logger_hierarchy() -> None:
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    h = Keep()
    logging.getLogger("hixl").addHandler(h)
    before = hixl.get_log_level()
    try:
        # The call sites run once at WARN first: raising the level later must still show them.
        hixl.set_log_level("WARN")
        quiet = hixl.Hixl()
        quiet.initialize("127.0.0.1:0")
        quiet.finalize()
        hixl.set_log_level("INFO")
        assert logging.getLogger("hixl").level == logging.INFO
        e = hixl.Hixl()
        e.initialize("127.0.0.1:0")
        me = e.local_engine
        e.finalize()
        deadline = time.monotonic() + 5
        while not any("engine finalizing" in r.getMessage() for r in got):
            assert time.monotonic() < deadline, (
                [r.getMessage() for r in got],
                hixl._logging._drainer.is_alive(),
                hixl.get_log_level(),
                logging.getLogger("hixl.core.engine").disabled,
                hixl.log_dropped(),
                hixl._logging._running.is_set(),
            )
            time.sleep(0.01)
        rec = next(r for r in got if "engine initialized" in r.getMessage())
        assert rec.name == "hixl.core.engine" and rec.levelno == logging.INFO
        assert f"engine={me}" in rec.getMessage(), rec.getMessage()
    finally:
        logging.getLogger("hixl").removeHandler(h)
        hixl.set_log_level(before)


def test_records_made_during_finalize_are_delivered_before_exit() -> None:
    script = """
import logging, sys, numpy as np, hixl
FMT = "%(name)s|%(levelname)s|%(message)s"
logging.basicConfig(stream=sys.stdout, level=logging.DEBUG, format=FMT)
hixl.set_log_level("DEBUG")
t, i = hixl.Hixl(), hixl.Hixl()
opts = {"hixl.backends": "tcp"}
t.initialize("127.0.0.1:0", opts); i.initialize("127.0.0.1", opts)
buf = np.zeros(4096, np.uint8); t.register(buf); i.register(buf)
i.connect(t.local_engine, timeout_ms=5000)
i.put(t.local_engine, buf.ctypes.data, buf.ctypes.data, 4096, timeout_ms=5000)
i.finalize(); t.finalize()
"""
    r = run(script)
    assert r.returncode == 0, r.stderr
    assert "FATAL" not in r.stderr
    lines = r.stdout.splitlines()
    assert any(x.startswith("hixl.core.complete|DEBUG|transfer done") for x in lines), r.stdout
    assert sum("|INFO|engine finalizing" in x for x in lines) == 2, r.stdout


def test_records_lost_while_python_is_stalled_are_counted_and_reported() -> None:
    script = """
import logging, sys, numpy as np, hixl, hixl._logging
logging.basicConfig(stream=sys.stdout, level=logging.DEBUG, format="%(levelname)s|%(message)s")
hixl.set_log_level("DEBUG")
hixl._logging._running.clear()  # the drain thread stops taking records
t, i = hixl.Hixl(), hixl.Hixl()
opts = {"hixl.backends": "shm"}
t.initialize("127.0.0.1:0", opts); i.initialize("127.0.0.1", opts)
buf = np.zeros(4096, np.uint8); t.register(buf); i.register(buf)
i.connect(t.local_engine, timeout_ms=5000)
for _ in range(6000):
    i.put(t.local_engine, buf.ctypes.data, buf.ctypes.data, 64, timeout_ms=5000)
print("dropped", hixl.log_dropped(), flush=True)
hixl._logging._running.set()
i.finalize(); t.finalize()
"""
    r = run(script)
    assert r.returncode == 0, r.stderr
    dropped = int(next(x for x in r.stdout.splitlines() if x.startswith("dropped")).split()[1])
    assert dropped >= 6000 - 4096, r.stdout[-2000:]
    warn = [x for x in r.stdout.splitlines() if x.startswith("WARNING|") and "dropped" in x]
    assert warn, r.stdout[-2000:]
    assert int(warn[0].split("|")[1].split()[0]) >= dropped, warn
    done = sum("transfer done" in x for x in r.stdout.splitlines())
    assert 4000 <= done <= 4096 + 100, done  # what the queue held, then the rest live


def test_without_any_logging_configured_records_still_reach_stderr() -> None:
    script = "import hixl; e = hixl.Hixl(); e.initialize('127.0.0.1:0'); e.finalize()"
    r = run(script, HIXL_LOG_LEVEL="INFO")
    assert r.returncode == 0
    assert "INFO hixl.core.engine: engine initialized" in r.stderr, r.stderr


def test_a_forked_child_gets_its_own_drain_thread() -> None:
    script = """
import logging, os, sys, hixl
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(process)d|%(message)s")
hixl.set_log_level("INFO")
pid = os.fork()
if pid == 0:
    e = hixl.Hixl(); e.initialize("127.0.0.1:0"); e.finalize()
    import time; time.sleep(0.5)  # the child's own drain thread hands the records over
    sys.stdout.flush()
    os._exit(0)
os.waitpid(pid, 0)
print("child", pid, flush=True)
"""
    r = run(script)
    assert r.returncode == 0, r.stderr
    child = next(x.split()[1] for x in r.stdout.splitlines() if x.startswith("child "))
    assert f"{child}|engine initialized" in r.stdout, r.stdout
