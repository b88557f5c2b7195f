"""Imported at the start of every Python process of a test's vLLM engine (this directory is
on its PYTHONPATH). With ``HIXL_TEST_VLLM_KV_CPUS=0`` (a comma list of CPUs) vLLM's NIXL
worker pins itself to those CPUs instead of the ones it chose (the last core of each NUMA
node): the push-mode test puts its two engines on different cores, as two hosts would be."""

import os

_cpus = os.environ.get("HIXL_TEST_VLLM_KV_CPUS", "")
if _cpus:
    _wanted = {int(c) for c in _cpus.split(",")}
    _pin = os.sched_setaffinity

    def _sched_setaffinity(pid, mask, _pin=_pin, _wanted=_wanted):  # noqa: ANN001
        _pin(pid, _wanted)

    os.sched_setaffinity = _sched_setaffinity
