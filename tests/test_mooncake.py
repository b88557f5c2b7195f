"""hixl.mooncake across real processes: SGLang's disaggregation pattern (tests/_mc_sglang.py)
through the ``mooncake`` shim, the same program against the real Mooncake package (given
``HIXL_MOONCAKE_PYTHON``, a python with ``mooncake-transfer-engine-non-cuda`` 0.3.13), and the
shim's stepping aside."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from hixl.mooncake import shim

PROG = Path(__file__).with_name("_mc_sglang.py")
REAL_PY = os.environ.get("HIXL_MOONCAKE_PYTHON", "")

#: What _mc_sglang.py's prefill must report, whichever engine runs it.
EXPECTED = {
    "batch": 0,
    "aux": 0,
    "read": [0, True],
    "read_one": 0,
    "read_one_same": True,
    "async_id_positive": True,
    "async": 0,
    "async_read": 0,
    "async_read_same": True,
    "submit": 1,
    "after_oob": 0,
    "probe": 0,
    "opcode": [0, 1],
}


def _env(shim_on: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "HIXL_MOONCAKE_SHIM", "HIXL_MOONCAKE_STRICT")
    }
    if shim_on:
        clean["PYTHONPATH"] = shim.PATH
    return {**clean, **(extra or {})}


def _line(p: subprocess.Popen[str], timeout_s: float = 60) -> str:
    """The process's next stdout line, or a failure when none comes within ``timeout_s``."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    assert ready, f"no line from {p.args} within {timeout_s} s"
    return p.stdout.readline()


def _sglang_pair(
    python: str, env: dict[str, str], host_d: str, host_p: str, prog: Path = PROG
) -> dict:
    """Runs a decode and a prefill process of _mc_sglang.py; returns the prefill's report
    after the decode compared every byte."""
    dec = subprocess.Popen(
        [python, str(prog), "decode", host_d],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert dec.stdout is not None and dec.stdin is not None
        line = _line(dec)
        assert line, dec.stderr.read() if dec.stderr else "decode said nothing"
        info = json.loads(line)
        pre = subprocess.run(
            [python, str(prog), "prefill", host_p, line.strip()],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert pre.returncode == 0, pre.stderr[-3000:]
        report = json.loads(pre.stdout.strip().splitlines()[-1])
        check = {k: report[k] for k in ("src", "dst", "async_src", "async_dst")}
        dec.stdin.write("CHECK " + json.dumps(check) + "\n")
        dec.stdin.flush()
        verdict = _line(dec).strip()
        dec.stdin.write("QUIT\n")
        dec.stdin.flush()
        dec.wait(timeout=30)
        report["verdict"] = verdict
        report["session"] = info["session"]
        return report
    finally:
        if dec.poll() is None:
            dec.kill()
            dec.wait(timeout=10)


def _assert_sglang(report: dict) -> None:
    assert report["verdict"] == "OK", report
    for k, v in EXPECTED.items():
        assert report[k] == v, (k, report)
    assert report["oob"] < 0 and report["oob_async"] < 0, report


def test_sglang_pattern_through_the_shim():
    report = _sglang_pair(sys.executable, _env(True), "127.0.0.1", "127.0.0.1")
    _assert_sglang(report)


def test_sglang_pattern_across_loopback_addresses_with_rdma_hint(tmp_path):
    # SGLang hard-codes "rdma": without a device hixl carries it on its best backend.
    prog = tmp_path / PROG.name
    prog.write_text(PROG.read_text().replace('PROTOCOL = "tcp"', 'PROTOCOL = "rdma"'))
    report = _sglang_pair(sys.executable, _env(True), "127.0.0.2", "127.0.0.3", prog)
    _assert_sglang(report)
    assert report["session"].startswith("127.0.0.2:")


@pytest.mark.skipif(
    not REAL_PY,
    reason="HIXL_MOONCAKE_PYTHON is not set (a python with mooncake-transfer-engine-non-cuda "
    "0.3.13 installed): the real-package run is skipped",
)
def test_same_program_passes_against_the_real_mooncake():
    check = subprocess.run(
        [REAL_PY, "-c", "import mooncake.engine as e; print(getattr(e, '__hixl__', 'real'))"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(False),
    )
    assert check.returncode == 0 and check.stdout.strip() == "real", check.stderr[-2000:]
    real = _sglang_pair(REAL_PY, _env(False), "127.0.0.1", "127.0.0.1")
    _assert_sglang(real)
    ours = _sglang_pair(sys.executable, _env(True), "127.0.0.1", "127.0.0.1")
    _assert_sglang(ours)
    for k in EXPECTED:
        assert real[k] == ours[k], k


# --- the shim -----------------------------------------------------------------------------------

SHIM_PROG = """
import mooncake
from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify
print("HIXL" if getattr(mooncake, "__hixl__", False) else "OTHER", flush=True)
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert te.get_rpc_port() > 0 and int(TransferOpcode.Write) == 1
print("OK", flush=True)
"""


def _fake_real_mooncake(tmp_path: Path) -> str:
    root = tmp_path / "site"
    (root / "mooncake").mkdir(parents=True)
    (root / "mooncake" / "__init__.py").write_text("print('REAL MOONCAKE', flush=True)\n")
    (root / "mooncake" / "engine.py").write_text("raise SystemExit(7)\n")
    return str(root)


def _shim_run(
    tmp_path: Path, extra: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "hixl.mooncake.shim"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == shim.PATH, out.stderr
    prog = tmp_path / "prog.py"
    prog.write_text(SHIM_PROG)
    base = _env(False)
    base["PYTHONPATH"] = os.pathsep.join([out.stdout.strip(), *extra])
    return subprocess.run(
        [sys.executable, str(prog)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**base, **env},
    )


def test_shim_runs_unchanged_mooncake_programs(tmp_path):
    r = _shim_run(tmp_path, [], {})
    assert r.returncode == 0 and r.stdout.split() == ["HIXL", "OK"], r.stdout + r.stderr


def test_shim_steps_aside_for_the_real_mooncake(tmp_path):
    real = _fake_real_mooncake(tmp_path)
    r = _shim_run(tmp_path, [real], {})
    assert r.returncode == 7 and r.stdout.startswith("REAL MOONCAKE"), r.stdout + r.stderr
    forced = _shim_run(tmp_path, [real], {"HIXL_MOONCAKE_SHIM": "1"})
    assert forced.returncode == 0 and forced.stdout.split() == ["HIXL", "OK"], forced.stderr
    off = _shim_run(tmp_path, [], {"HIXL_MOONCAKE_SHIM": "0"})
    assert off.returncode != 0 and "No module named 'mooncake'" in off.stderr
    off_real = _shim_run(tmp_path, [real], {"HIXL_MOONCAKE_SHIM": "0"})
    assert off_real.returncode == 7 and off_real.stdout.startswith("REAL MOONCAKE")


def test_without_the_shim_import_mooncake_is_not_hixl(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", "import mooncake; print(getattr(mooncake, '__hixl__', False))"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_env(False, {"HIXL_MOONCAKE_SHIM": "1"}),
    )
    assert "True" not in r.stdout, "hixl's mooncake took effect without the shim on the path"
