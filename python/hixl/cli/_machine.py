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


def cpu_times(stat: str = "/proc/stat") -> list[int] | None:
    """The machine's CPU time so far, in ticks, from the first line of /proc/stat: user, nice,
    system, idle, iowait, irq, softirq, steal (fewer where the kernel gives fewer); None where
    there is no such file."""
    try:
        with open(stat) as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    return [int(x) for x in first[1:9]]


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of CPU time the hypervisor gave to others (steal) between two `cpu_times`
    readings; None without both readings, a steal column or any time passed."""
    if before is None or after is None or min(len(before), len(after)) < 8:
        return None
    delta = [a - b for a, b in zip(after[:8], before[:8], strict=True)]
    total = sum(delta)
    return delta[7] / total if total > 0 else None


def load_during(before: list[int] | None) -> dict[str, object]:
    """What made a run's measurements noisy, read at its end: the load average (1, 5 and 15
    minutes), the cores, and the CPU steal share since `before` (``cpu_times()`` at its
    start; None where /proc/stat is missing)."""
    try:
        loadavg: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        loadavg = None
    return {
        "loadavg": loadavg,
        "cores": os.cpu_count(),
        "steal_share": steal_share(before, cpu_times()),
    }
