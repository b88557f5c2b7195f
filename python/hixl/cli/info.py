"""Show this hixl build and machine: version, the GPUs CUDA sees (or why CUDA was not found),
which transports and device paths work here (and why one does not: for RDMA, libibverbs not
loadable, no device, or the devices found), the host identity
same-host peers compare, and every engine option with its default.

The same-host check is real: it starts a second process with an engine and connects to it
with hixl.backends=shm, so the answer holds for peers started the same way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from .. import Hixl, HixlError, backends, option_keys
from .._hixl import _gpudirect_info, _host_facts, cuda_info
from ._machine import describe

NAME = "info"
HELP = "version, transports available here (and why not), host identity, options"

_PEER = (
    "import sys, hixl\n"
    "e = hixl.Hixl(); e.initialize('127.0.0.1:0')\n"
    "print(e.local_engine, flush=True); sys.stdin.read(); e.finalize()\n"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _probe(transport: str) -> tuple[bool, str]:
    """Connects to a fresh peer process with `transport` forced; (works, why)."""
    peer = subprocess.Popen(
        [sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert peer.stdout is not None
        addr = peer.stdout.readline().strip()
        if not addr:
            return False, "the probe peer process did not start"
        with Hixl() as e:
            e.initialize("127.0.0.1", {"hixl.backends": transport})
            try:
                e.connect(addr, timeout_ms=5000)
            except HixlError as exc:
                return False, str(exc)
            return True, f"works (backend {e.stats()[addr]['backend']})"
    finally:
        assert peer.stdin is not None
        peer.stdin.close()
        try:
            peer.wait(10)
        except subprocess.TimeoutExpired:
            peer.kill()


def no_cuda(reason: str) -> str:
    """Why CUDA is not usable, said once: the engine's reason when it already says CUDA was
    not found ("CUDA was not found: libcuda.so.1 could not be loaded ..."), else that reason
    after "CUDA not found: "."""
    return reason if reason.startswith("CUDA was not found") else f"CUDA not found: {reason}"


def gather() -> dict[str, Any]:
    transports: dict[str, dict[str, Any]] = {}
    cuda = cuda_info()
    # Every backend the CLI offers, from the engine's table, by a real connection; one that
    # `auto` offers only where CUDA is found is not probed without CUDA.
    for b in backends():
        if not b["cli"]:
            continue
        if "CUDA" in b["offered"] and not cuda["available"]:
            transports[b["name"]] = {
                "available": False,
                "detail": no_cuda(cuda["reason"]),
            }
            continue
        ok, why = _probe(b["name"])
        transports[b["name"]] = {"available": ok, "detail": why}
    # What each backend finds out here without a peer (from its own declaration): a device
    # listing where a connection cannot be probed (RDMA: "not loadable: ...", "no device ..."
    # or "devices: NAME (port 1 active), ..."), or a remark on a probed row.
    for name, (usable, note) in _host_facts().items():
        if name in transports:
            if note:
                transports[name]["detail"] += f"; {note}"
        elif usable is not None:
            transports[name] = {"available": usable, "detail": note}
    # GPU memory on RDMA (docs/RDMA.md): "dmabuf", "peermem" or "no (missing: ...)"; the row
    # shows the path, or what is missing.
    gpudirect = _gpudirect_info("verbs")
    no = gpudirect.startswith("no (")
    devices = [b["name"] for b in backends() if "GPUDirect" in b["domains"]]
    transports["gpudirect"] = {
        "available": any(transports.get(n, {}).get("available") for n in devices) and not no,
        "path": gpudirect,
        "detail": gpudirect[4:-1] if no else gpudirect,
    }
    transports["cuda_staging"] = {
        "available": bool(cuda["available"])
        and any(
            transports.get(b["name"], {}).get("available")
            for b in backends()
            if "staged" in b["domains"]
        ),
        "detail": (
            "device memory over tcp through pinned host buffers (hixl.cuda.stage_chunk, "
            "hixl.cuda.stage_depth)"
            if cuda["available"]
            else no_cuda(cuda["reason"])
        ),
    }
    return {
        **describe(),
        "cuda": cuda,
        "transports": transports,
        "options": [{"key": k, "default": d, "meaning": m} for k, d, m in option_keys()],
    }


def run(args: argparse.Namespace) -> int:
    info = gather()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"hixl {info['hixl_version']}")
    for k in ("host_identity", "cpu", "cores", "mem_gib", "kernel", "python"):
        print(f"  {k:14} {info[k]}")
    cuda = info["cuda"]
    if cuda["available"]:
        v = cuda["driver_version"]
        print(f"CUDA driver {v // 1000}.{v % 1000 // 10}, {len(cuda['devices'])} GPU(s):")
        for g in cuda["devices"]:
            cc = ".".join(str(x) for x in g["compute_capability"])
            print(
                f"  cuda:{g['ordinal']:<3} {g['name']}  {g['total_mem'] / 2**30:.1f} GiB  "
                f"pci {g['pci_bus_id']}  sm {cc}"
            )
    else:
        print(no_cuda(cuda["reason"]))
    print("transports:")
    for name, t in info["transports"].items():
        mark = "yes" if t["available"] else "no "
        print(f"  {name:12} {mark}  {t['detail']}")
    print("options (key, default, meaning):")
    w = max(len(o["key"]) for o in info["options"])
    for o in info["options"]:
        print(f"  {o['key']:{w}}  {o['default']:>8}  {o['meaning']}")
    return 0
