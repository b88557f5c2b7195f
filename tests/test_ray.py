"""hixl under Ray 2.60 (Ray Direct Transport), with real Ray: one local cluster for the module,
driven by tests/_ray_driver.py in a Python with Ray and torch (HIXL_RAY_PYTHON, or this one when
it has them). Two transports: hixl.ray's own ("hixl") and Ray's NIXL transport running on
hixl's NIXL face through the shim ("nixl"); Ray's object store ("object") is the reference.
Bytes are compared by sha256 of what the receiver got against what the sender made."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _lineproc import LineProc

HERE = Path(__file__).parent
PY_DIR = HERE.parent / "python"
KIB, MIB = 1 << 10, 1 << 20
# A dead sender must be reported within this, from ray.kill to the receiving task's error: the
# NIXL face's and hixl.ray's probe of a dead peer is 300 ms (measured here: 0.1-0.4 s), the rest
# is slack for Ray's scheduling on a loaded machine. Before the fix the face waited 10 s.
DEAD_SENDER_BOUND_S = 3.0


def _ray_env() -> tuple[str | None, dict[str, str], str]:
    """A Python with Ray and torch, the environment its driver runs in, and a word on it (why
    there is none). hixl is this test run's own: the source tree's python/ when that is what
    this process imports, else the one installed in that Python (CI installs the wheel there)."""
    import hixl

    py = os.environ.get("HIXL_RAY_PYTHON") or sys.executable
    own = Path(hixl.__file__).resolve().parent.parent
    extra = [str(own)] if own == PY_DIR.resolve() else []
    path = [*extra, str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "RAY_DISABLE_USAGE_STATS": "1"}
    env.pop("HIXL_NIXL_LISTEN", None)
    probe = "import ray, torch, hixl.nixl.shim as s; print(ray.__version__, s.PATH)"
    try:
        r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, env, f"{py}: {e}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        why = f"Ray, torch and hixl are not importable by {py} ({last}); set HIXL_RAY_PYTHON"
        return None, env, why
    version, shim = r.stdout.split()
    # Ray's workers inherit the driver's environment: `import nixl` is hixl's there too.
    env["PYTHONPATH"] = os.pathsep.join([shim, env["PYTHONPATH"]])
    return py, env, version


@pytest.fixture(scope="module")
def driver() -> Iterator[LineProc]:
    py, env, why = _ray_env()
    if py is None:
        pytest.skip(why)
    p = LineProc([HERE / "_ray_driver.py"], python=py, env=env, ready_s=180)
    try:
        yield p
    finally:
        p.close(60)


def ask(driver: LineProc, *words: object, timeout: float = 180) -> dict[str, Any]:
    line = driver.cmd(*words, timeout=timeout)
    out: dict[str, Any] = json.loads(line)
    assert "exception" not in out, out.get("trace", out)
    return out


SIZES = [
    pytest.param(4 * KIB, 1, id="4KiB"),
    pytest.param(1 * MIB, 1, id="1MiB"),
    pytest.param(64 * MIB, 1, id="64MiB"),
    pytest.param(256 * KIB, 100, id="100x256KiB"),
]


@pytest.mark.parametrize("transport", ["hixl", "nixl"])
@pytest.mark.parametrize(("size", "count"), SIZES)
def test_tensors_arrive_byte_exact_and_out_of_band(
    driver: LineProc, transport: str, size: int, count: int
) -> None:
    """An actor method's tensors reach another actor byte-exact, and the ref's object in Ray's
    object store holds only the metadata (a few KiB, not the tensors' bytes)."""
    out = ask(driver, "send", transport, size, count, size % 1000 + count)
    assert out["ok"], out
    assert out["object_size"] is not None and out["object_size"] < 16 * KIB + 64 * count, out


def test_object_store_size_sees_in_band_bytes(driver: LineProc) -> None:
    """The reference: the same 1 MiB through Ray's object store is 1 MiB there, so the size the
    test above reads is the bytes the object store holds."""
    out = ask(driver, "send", "object", MIB, 1, 3)
    assert out["ok"], out
    assert out["object_size"] >= MIB, out


@pytest.mark.parametrize("transport", ["hixl", "nixl"])
def test_ray_put_with_the_transport(driver: LineProc, transport: str) -> None:
    """ray.put(tensor, _tensor_transport=...) inside an actor, consumed by another actor."""
    out = ask(driver, "put", transport, MIB, 11)
    assert out["ok"], out
    assert out["object_size"] < 16 * KIB, out


@pytest.mark.parametrize("transport", ["hixl", "nixl"])
def test_ray_get_in_the_driver(driver: LineProc, transport: str) -> None:
    """ray.get of an actor's tensor in the driver reads it over the transport, byte-exact."""
    assert ask(driver, "get", transport, MIB, 12)["ok"]


@pytest.mark.parametrize("transport", ["hixl", "nixl"])
def test_dead_sender_is_reported_and_the_receiver_keeps_working(
    driver: LineProc, transport: str
) -> None:
    """A sender killed after making its object: the receiver's task on it fails within the
    bound with the transport's error, and the receiver's next receive works."""
    out = ask(driver, "kill", transport)
    assert out["error"], out
    assert "RayDirectTransportError" in out["error"] or "ActorDied" in out["error"], out
    assert out["s"] < DEAD_SENDER_BOUND_S, out
    print(f"{transport}: dead sender reported after {out['s']:.2f} s")
    after = ask(driver, "send", transport, 4 * KIB, 1, 21)
    assert after["ok"], after


@pytest.mark.parametrize("transport", ["hixl", "nixl"])
def test_one_link_carries_every_object(driver: LineProc, transport: str) -> None:
    """Ten objects one after another, each freed before the next (Ray's NIXL transport then
    removes and re-adds the sender's agent every time): the receiver's engine keeps one link to
    the sender, whose counters saw all ten READs (a new link would start them from zero)."""
    out = ask(driver, "links", transport, 10)
    assert out["ok"], out
    assert out["stats"] is not None and out["stats"]["alive"], out
    assert out["stats"]["ops_read"] >= 10, out


def test_abort_ends_a_receive_and_the_next_one_works(driver: LineProc) -> None:
    """hixl.ray's abort_transport (Ray calls it after a failure or its own timeout) ends a
    receive that is waiting, and one not started yet, with RayDirectTransportError; the same
    receiver then reads the same tensor byte-exact."""
    out = ask(driver, "abort")
    assert out["posted"] and "aborted" in out["posted"], out
    assert out["early"] and "aborted" in out["early"], out
    assert out["ok"], out


def test_engines_advertise_the_ray_node_ip(driver: LineProc) -> None:
    """Inside Ray workers, hixl.ray's engine and the NIXL face's agents listen on and advertise
    Ray's node IP (not loopback), so peers on other nodes can reach them."""
    out = ask(driver, "where")
    node = out["node_ip"]
    ipaddress.ip_address(node)
    for t in ("hixl", "nixl"):
        for addr in out[t]:
            assert addr.rsplit(":", 1)[0].strip("[]") == node, out
