"""A hixl.nixl agent with its listen thread on, for the listener attacks of
tests/test_security_nixl_listener.py.

python _sec_nixl_victim.py NAME SIZE [KEYWORD=VALUE ...]

KEYWORD=VALUE pairs are nixl_agent_config's hixl_* keywords (ints and floats as such; one this
build does not have is ignored, with a note on stderr), and ``secret=HEX`` gives the engine
that cluster secret. It registers SIZE zeroed bytes and prints
``READY <listen port> <metadata hex>``. Then it answers, one line each:
``rss`` -> ``<VmRSS kB> <VmHWM kB>`` (this process's resident and peak resident memory),
``agents`` -> ``<agents loaded> <regions in all> <most regions of one>``,
``dump`` -> the SHA-256 of its buffer; ``exit`` ends it.
"""

from __future__ import annotations

import hashlib
import inspect
import sys

import numpy as np

from hixl.nixl import nixl_agent, nixl_agent_config


def memory_kb() -> tuple[int, int]:
    got = {}
    with open("/proc/self/status") as f:
        for row in f:
            key, _, value = row.partition(":")
            if key in ("VmRSS", "VmHWM"):
                got[key] = int(value.split()[0])
    return got["VmRSS"], got["VmHWM"]


def main() -> None:
    name, size = sys.argv[1], int(sys.argv[2])
    kw: dict[str, object] = {}
    options: dict[str, str | int | bool] = {}
    for arg in sys.argv[3:]:
        key, _, value = arg.partition("=")
        if key == "secret":
            options["hixl.secret"] = value
        else:
            kw[key] = float(value) if "." in value else int(value)
    known = inspect.signature(nixl_agent_config).parameters
    for key in [k for k in kw if k not in known]:  # a build without it (the test's "before")
        print(f"NOTE {key} is not a keyword of this build: ignored", file=sys.stderr, flush=True)
        del kw[key]
    conf = nixl_agent_config(True, True, 0, hixl_options=options, **kw)  # type: ignore[arg-type]
    buf = np.zeros(size, np.uint8)
    with nixl_agent(name, conf) as agent:
        agent.register_memory(buf)
        print(f"READY {agent.listen_port} {agent.get_agent_metadata().hex()}", flush=True)
        for line in sys.stdin:
            word = line.strip()
            if word == "rss":
                print(*memory_kb(), flush=True)
            elif word == "agents":
                with agent._lock:
                    counts = [r.starts.shape[0] for r in agent._remotes.values()]
                print(len(counts), sum(counts), max(counts, default=0), flush=True)
            elif word == "dump":
                print(hashlib.sha256(buf.tobytes()).hexdigest(), flush=True)
            elif word == "exit":
                break


if __name__ == "__main__":
    main()
