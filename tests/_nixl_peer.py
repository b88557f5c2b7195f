"""A hixl.nixl agent in its own process, driven over stdin/stdout by tests/test_nixl.py.

python _nixl_peer.py NAME SIZE BACKEND
Registers a zeroed SIZE-byte buffer and prints "READY <metadata hex>". Commands, one a line,
each answered by one line:
  sha          sha256 of the buffer            -> <hex>
  fill SEED    fill it with seeded bytes       -> OK
  notifs       get_new_notifs() as JSON         -> {"agent": ["hex", ...]}
  exit         close the agent and exit         -> OK
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from hixl.nixl import nixl_agent, nixl_agent_config


def main() -> None:
    name, size, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
    buf = np.zeros(size, np.uint8)
    agent.register_memory(buf)
    print(f"READY {agent.get_agent_metadata().hex()}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "sha":
            print(hashlib.sha256(buf.tobytes()).hexdigest(), flush=True)
        elif cmd == "fill":
            rng = np.random.default_rng(int(args[0]))
            buf[:] = rng.integers(0, 256, size, dtype=np.uint8)
            print("OK", flush=True)
        elif cmd == "notifs":
            got = agent.get_new_notifs()
            print(json.dumps({k: [m.hex() for m in v] for k, v in got.items()}), flush=True)
        elif cmd == "exit":
            agent.close()
            print("OK", flush=True)
            return


if __name__ == "__main__":
    main()
