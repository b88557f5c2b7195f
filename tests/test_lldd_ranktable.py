"""LLM-DataDist rank tables as Ascend writes them (version 1.2, device_ip but no device_port):
two real processes link with one (tests/_lldd_noport.py), each listening on its own rank's
device_ip at the derived port, and the decoder pulls the prompt's cache byte for byte."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_llm_datadist import free_ports

import hixl.llm_datadist as ld
from hixl.llm_datadist import _ranktable

HERE = Path(__file__).parent


def _run_pair(base: int, decoder_port: str = "", *extra: str) -> dict[str, dict[str, str]]:
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(HERE / "_lldd_noport.py"), role, str(base), decoder_port, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        for role in ("prompt", "decoder")
    }
    out: dict[str, dict[str, str]] = {}
    try:
        for role, p in procs.items():
            assert p.stdout is not None
            got: dict[str, str] = {}
            while len(got) < (3 if extra else 2):
                line = p.stdout.readline()
                assert line, f"{role} ended: {p.stderr.read() if p.stderr else ''}"
                tag, _, rest = line.strip().partition(" ")
                if tag in ("ADDR", "SAME", "INIT"):
                    got[tag] = rest
            out[role] = got
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        for role, p in procs.items():
            assert p.wait(timeout=60) == 0, f"{role}: {p.stderr.read() if p.stderr else ''}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return out


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _base() -> int:
    """A base whose ports base+0 and base+1 were free a moment ago."""
    for _ in range(20):
        a = free_ports(1)[0]
        if a < 65000 and _free(a + 1):
            return a
    pytest.skip("no two adjacent free ports found")


def test_rank_table_without_ports_links_and_pulls():
    base = _base()
    out = _run_pair(base)
    assert out["prompt"]["ADDR"] == f"127.0.0.2:{base}"  # device 0: base + 0, its device_ip
    assert out["decoder"]["ADDR"] == f"127.0.0.3:{base + 1}"  # device 1: base + 1
    assert out["prompt"]["SAME"].startswith("True") and out["decoder"]["SAME"].startswith("True")


def test_rank_table_device_port_beside_derived_ports():
    base = _base()
    port = free_ports(1)[0]
    out = _run_pair(base, str(port))
    assert out["prompt"]["ADDR"] == f"127.0.0.2:{base}"
    assert out["decoder"]["ADDR"] == f"127.0.0.3:{port}"
    assert out["prompt"]["SAME"].startswith("True") and out["decoder"]["SAME"].startswith("True")


def _table(**dev: str) -> str:
    return json.dumps({"version": "1.2", "server_list": [{"host_ip": "10.0.0.9", "device": [dev]}]})


def test_rank_table_addresses_and_their_errors():
    e = _ranktable.entries(_table(device_id="3", device_ip="10.0.0.5", rank_id="0"))
    assert _ranktable.address(e[0], _ranktable.DEFAULT_DEVICE_PORT_BASE) == "10.0.0.5:16669"
    e = _ranktable.entries(_table(device_id="1", rank_id="0"))  # no device_ip: the host's
    assert _ranktable.address(e[0], 20000) == "10.0.0.9:20001"
    e = _ranktable.entries(_table(device_id="x", device_ip="10.0.0.5", rank_id="0"))
    with pytest.raises(ld.LLMException, match="device_id='x'"):
        _ranktable.address(e[0], 20000)
    e = _ranktable.entries(
        _table(device_id="0", device_ip="1.2.3.4", device_port="99999", rank_id="0")
    )
    with pytest.raises(ld.LLMException, match="99999"):
        _ranktable.address(e[0], 20000)
    with pytest.raises(ld.LLMException, match="llm.hixlDevicePortBase='abc'"):
        _ranktable.port_base({"llm.hixlDevicePortBase": "abc"})
    assert _ranktable.port_base({}) == 16666
    with pytest.raises(ld.LLMException, match="malformed"):
        _ranktable.entries("{not json")


def test_placement_device_without_an_accelerator_stays_a_clear_error():
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 0)
    dd.init({})
    try:
        desc = ld.CacheDesc(1, [1, 4], ld.DataType.DT_FLOAT16, ld.Placement.DEVICE)
        with pytest.raises(ld.LLMException, match="Placement.DEVICE") as err:
            dd.kv_cache_manager.allocate_cache(desc)
        assert err.value.status_code == ld.LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    finally:
        dd.finalize()


NOBODY = 65534


@contextmanager
def _squatter(ip: str, port: int) -> Iterator[str]:
    """A uid-65534 process trying to take ip:port: yields its answer (BOUND or REFUSED ...)."""
    p = subprocess.Popen(
        [sys.executable, str(HERE / "_lldd_squat.py"), ip, str(port), str(NOBODY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdin is not None
        yield p.stdout.readline().strip()
        p.stdin.write("exit\n")
        p.stdin.flush()
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _bind_opts(base: int) -> dict[str, str]:
    cfg = ld.LLMConfig()
    cfg.device_id = 1
    cfg.hixl_options = {"llm.hixlDevicePortBase": str(base), "llm.hixlDeviceIp": "127.0.0.3"}
    return cfg.generate_options()


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root, to run the squatter as another user (uid 65534)"
)


@needs_root
def test_derived_port_taken_before_init_fails_init():
    """A process of another user holds the derived address (device_ip, base + device_id)
    before init: init fails, naming that address and port, instead of starting elsewhere and
    leaving the links meant for this rank to the squatter."""
    base = _base()
    port = base + 1
    with _squatter("127.0.0.3", port) as got:
        assert got == "BOUND", got
        dd = ld.LLMDataDist(ld.LLMRole.DECODER, 1)
        with pytest.raises(ld.LLMException, match=f"127.0.0.3:{port}") as err:
            dd.init(_bind_opts(base))
        assert f"port {port}" in str(err.value) and "llm.hixlDeviceIp" in str(err.value)
        assert ld.LLMDataDist.llm_engine_instance is None


@needs_root
def test_derived_port_is_bound_at_init(caplog: pytest.LogCaptureFixture):
    """With llm.hixlDeviceIp, init listens at the derived address at once: a squatter of
    another user that comes after init cannot take the port; without a secret init says so
    (a WARNING)."""
    base = _base()
    caplog.set_level(logging.WARNING, logger="hixl")
    dd = ld.LLMDataDist(ld.LLMRole.DECODER, 1)
    env = os.environ.pop("HIXL_SECRET", None)
    try:
        dd.init(_bind_opts(base))
        assert dd.local_address == f"127.0.0.3:{base + 1}"
        with _squatter("127.0.0.3", base + 1) as got:
            assert got == "REFUSED EADDRINUSE", got
        assert "without a secret" in caplog.text, caplog.text
    finally:
        dd.finalize()
        if env is not None:
            os.environ["HIXL_SECRET"] = env


def test_rank_table_bound_at_init_links_and_pulls():
    """Both processes bind their derived addresses at init; link() finds them there (no
    move), and the decoder pulls the prompt's cache byte for byte."""
    base = _base()
    out = _run_pair(base, "", "bind")
    assert out["prompt"]["INIT"] == out["prompt"]["ADDR"] == f"127.0.0.2:{base}"
    assert out["decoder"]["INIT"] == out["decoder"]["ADDR"] == f"127.0.0.3:{base + 1}"
    assert out["prompt"]["SAME"].startswith("True") and out["decoder"]["SAME"].startswith("True")
