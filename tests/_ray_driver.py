"""A Ray driver for tests/test_ray.py, run by a Python with Ray 2.60 and torch (HIXL_RAY_PYTHON).

It starts one local Ray cluster (Ray's workers inherit PYTHONPATH: hixl, the NIXL shim, tests/),
registers hixl.ray's transport, makes a sender and a receiver actor, prints "READY <node_ip>",
then answers each command line with one JSON line. TRANSPORT is "hixl", "nixl" (Ray's NIXL
transport, on hixl's NIXL face through the shim) or "object" (Ray's object store).

  send TRANSPORT SIZE COUNT SEED   COUNT tensors of SIZE bytes from the sender's method to the
                                   receiver: {"ok", "s", "object_size"} (ok: sha256 equal)
  put TRANSPORT SIZE SEED          the same with ray.put(_tensor_transport=) inside the sender
  get TRANSPORT SIZE SEED          ray.get of the sender's object in this driver
  kill TRANSPORT                   a fresh sender makes a 1 MiB object and is killed; the
                                   receiver's task on it: {"error", "s"}
  links TRANSPORT N                N objects of 64 KiB one after another, each freed before the
                                   next; the receiver's engine stats for the sender's engine
  abort                            hixl.ray's transport used directly in the actors: a READ
                                   posted then aborted, and one aborted before it was posted,
                                   each must raise; then a READ of the same tensor works
  where                            the engine addresses the actors advertise, and the node IP
  exit
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from typing import Any

import ray
import torch

import hixl.ray

MIB = 1 << 20


def tensors(size: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(count)]


def digest(ts: Any) -> str:
    h = hashlib.sha256()
    for t in ts if isinstance(ts, list) else [ts]:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine_stats(transport: str) -> dict[str, Any]:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    if transport == "nixl":
        return get_tensor_transport_manager("NIXL").get_nixl_agent().engine.stats()
    return hixl.ray._transport._Engine.get().stats()


def engine_address(transport: str) -> str:
    from ray.experimental.rdt.util import get_tensor_transport_manager

    if transport == "nixl":
        agent = get_tensor_transport_manager("NIXL").get_nixl_agent()
        return str(json.loads(agent.get_agent_metadata().split(b"\n", 1)[1])["engine"])
    return hixl.ray._transport._Engine.get().local_engine


@ray.remote(enable_tensor_transport=True)
class Sender:
    def make(self, size: int, count: int, seed: int) -> list[torch.Tensor]:
        return tensors(size, count, seed)

    def put(self, transport: str, size: int, seed: int) -> list[Any]:
        t = tensors(size, 1, seed)
        ref = ray.put(t, _tensor_transport=transport) if transport != "object" else ray.put(t)
        return [ref]

    def address(self, transport: str) -> str:
        return engine_address(transport)

    def hixl_meta(self, size: int, seed: int) -> Any:
        """Registers a tensor as Ray would at extraction; the metadata a receiver needs."""
        from ray.experimental.rdt.util import get_tensor_transport_manager

        self.kept = tensors(size, 1, seed)
        tm = get_tensor_transport_manager("HIXL")
        return tm.extract_tensor_transport_metadata("kept", self.kept)

    def pid(self) -> int:
        import os

        return os.getpid()


@ray.remote(enable_tensor_transport=True)
class Receiver:
    def digest(self, ts: Any) -> str:
        return digest(ts)

    def stats(self, transport: str) -> dict[str, Any]:
        return engine_stats(transport)

    def address(self, transport: str) -> str:
        return engine_address(transport)

    def abort(self, meta: Any) -> dict[str, Any]:
        from ray.exceptions import RayDirectTransportError
        from ray.experimental.rdt.util import get_tensor_transport_manager

        tm = get_tensor_transport_manager("HIXL")
        comm = hixl.ray.HixlCommunicatorMetadata()
        out: dict[str, Any] = {}
        fr = tm.fetch_multiple_tensors("posted", meta, comm)
        tm.abort_transport("posted", comm)
        try:
            tm.wait_fetch_complete(fr)
            out["posted"] = None
        except RayDirectTransportError as e:
            out["posted"] = str(e)
        tm.abort_transport("early", comm)
        try:
            tm.recv_multiple_tensors("early", meta, comm)
            out["early"] = None
        except RayDirectTransportError as e:
            out["early"] = str(e)
        out["after"] = digest(tm.recv_multiple_tensors("after", meta, comm))
        return out


def make(s: Any, transport: str, size: int, count: int, seed: int) -> Any:
    if transport == "object":
        return s.make.remote(size, count, seed)
    return s.make.options(tensor_transport=transport).remote(size, count, seed)


def object_size(ref: Any) -> int | None:
    ray.wait([ref], timeout=60)
    loc = ray.experimental.get_object_locations([ref], timeout_ms=10000)
    return loc.get(ref, {}).get("object_size")


def gone(pid: int, deadline_s: float) -> None:
    """Waits until process `pid` has ended (no longer exists, or is a zombie), up to
    `deadline_s` seconds."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} was still running {deadline_s} s after ray.kill")


def main() -> None:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    hixl.ray.register()
    s, r = Sender.remote(), Receiver.remote()
    ray.get([s.pid.remote(), r.digest.remote([])])
    print("READY", ray.util.get_node_ip_address(), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "exit":
            break
        try:
            out = run(s, r, words)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out = {"exception": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(json.dumps(out), flush=True)
    ray.shutdown()


def run(s: Any, r: Any, words: list[str]) -> dict[str, Any]:
    cmd, args = words[0], words[1:]
    if cmd == "send":
        t, size, count, seed = args[0], int(args[1]), int(args[2]), int(args[3])
        want = digest(tensors(size, count, seed))
        t0 = time.monotonic()
        ref = make(s, t, size, count, seed)
        got = ray.get(r.digest.remote(ref), timeout=120)
        dt = time.monotonic() - t0
        return {"ok": got == want, "s": dt, "object_size": object_size(ref)}
    if cmd == "put":
        t, size, seed = args[0], int(args[1]), int(args[2])
        want = digest(tensors(size, 1, seed))
        (ref,) = ray.get(s.put.remote(t, size, seed), timeout=60)
        got = ray.get(r.digest.remote(ref), timeout=120)
        return {"ok": got == want, "object_size": object_size(ref)}
    if cmd == "get":
        t, size, seed = args[0], int(args[1]), int(args[2])
        want = digest(tensors(size, 1, seed))
        got = digest(ray.get(make(s, t, size, 1, seed), timeout=120))
        return {"ok": got == want}
    if cmd == "kill":
        t = args[0]
        victim = Sender.remote()
        pid = ray.get(victim.pid.remote(), timeout=60)
        ref = make(victim, t, 1 << 20, 1, 7)
        ray.wait([ref], timeout=60)
        ray.kill(victim, no_restart=True)
        gone(pid, 60)  # ray.kill returns before the process has ended
        t0 = time.monotonic()
        try:
            ray.get(r.digest.remote(ref), timeout=120)
            return {"error": None, "s": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001 - the error Ray reports is the result
            return {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - t0}
    if cmd == "links":
        t, n = args[0], int(args[1])
        peer = ray.get(s.address.remote(t), timeout=60)
        ok = True
        for i in range(n):
            ref = make(s, t, 64 << 10, 1, 100 + i)
            ok &= ray.get(r.digest.remote(ref), timeout=60) == digest(tensors(64 << 10, 1, 100 + i))
            del ref
            time.sleep(0.05)  # Ray frees the sender's copy in the background
        return {"ok": ok, "peer": peer, "stats": ray.get(r.stats.remote(t), timeout=60).get(peer)}
    if cmd == "abort":
        meta = ray.get(s.hixl_meta.remote(MIB, 31), timeout=60)
        out = ray.get(r.abort.remote(meta), timeout=60)
        out["ok"] = out["after"] == digest(tensors(MIB, 1, 31))
        return out
    if cmd == "where":
        out: dict[str, Any] = {"node_ip": ray.util.get_node_ip_address()}
        for t in ("hixl", "nixl"):
            out[t] = [ray.get(a.address.remote(t), timeout=60) for a in (s, r)]
        return out
    raise ValueError(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main()
