"""What machine a run happened on: CPU, cores, memory, kernel, host identity."""

from __future__ import annotations

import hashlib
import os
import platform
import sys

from .. import __version__
from .._hixl import _host_identity


def host_hash() -> int:
    """A 63-bit fingerprint of the host identity (boot id and host name)."""
    digest = hashlib.blake2b(_host_identity().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def describe() -> dict[str, object]:
    """A JSON-ready description of this machine and hixl build."""
    return {
        "hixl_version": __version__,
        "host_identity": _host_identity(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "mem_gib": _mem_gib(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
    }
