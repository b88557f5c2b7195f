"""The initiator of the two-process NIXL tests (see _nixl_target.py).

python _nixl_initiator.py MODE DIR PORT
READ of the target's source rows with initialize_xfer (bytes compared), WRITE into its
destination with prepped lists and index selection (the target compares), a notification
alone (PING/PONG), check_xfer_state polling, telemetry, releasing every handle, and leaving
(remove_remote_agent; listen mode also invalidate_local_metadata).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from _nixl_common import ROWS, fail, ok, pattern, published, rows, wait

from hixl.nixl import nixl_agent, nixl_agent_config


def main() -> None:
    mode, out, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    got = np.zeros_like(pattern(1))
    mine = pattern(2)
    reg = agent.register_memory([got, mine])

    if mode == "md":
        peer = out / "target.md"
        name = agent.add_remote_agent(wait("target.md", lambda: published(peer)))
        tmp = out / "initiator.md.tmp"
        tmp.write_bytes(agent.get_agent_metadata())
        tmp.rename(out / "initiator.md")
    else:
        agent.fetch_remote_metadata("target", "127.0.0.1", port)
        agent.send_local_metadata("127.0.0.1", port)
        wait("target's metadata", lambda: agent.check_remote_metadata("target"))
        name = b"target"
    if name != b"target":
        fail(f"add_remote_agent returned {name!r}")
    ok("metadata")

    lists: dict[bytes, object] = {}

    def descs() -> bool:
        for m in agent.get_new_notifs().get("target", []):
            lists[m[:3]] = agent.deserialize_descs(m[3:])
        return len(lists) == 2

    wait("the target's descriptors", descs)
    src, dst = lists[b"SRC"], lists[b"DST"]

    # READ: the whole source tensor, row by row, in one request.
    local = agent.get_xfer_descs(rows(got), "DRAM")
    h = agent.initialize_xfer("READ", local, src, name, b"READ_DONE")
    state = agent.transfer(h)
    if state not in ("PROC", "DONE"):
        fail(f"transfer returned {state}")
    wait("READ", lambda: agent.check_xfer_state(h) != "PROC")
    if agent.check_xfer_state(h) != "DONE":
        fail(f"READ ended {agent.check_xfer_state(h)}: {h.error}")
    if not np.array_equal(got, pattern(1)):
        fail(f"READ row {int(np.argmax((got != pattern(1)).any(axis=1)))} differs")
    tel = agent.get_xfer_telemetry(h)
    if tel.totalBytes != got.nbytes or tel.descCount != ROWS:
        fail(f"telemetry {tel}")
    agent.release_xfer_handle(h)
    ok("read")

    # WRITE with prepped lists: local row perm[j] goes to remote row j.
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows(mine), "DRAM")
    rh = agent.prep_xfer_dlist("target", dst)
    perm = np.arange(ROWS)[::-1]
    wh = agent.make_prepped_xfer("WRITE", lh, perm, rh, list(range(ROWS)), b"WRITTEN")
    agent.transfer(wh)
    wait("WRITE", lambda: agent.check_xfer_state(wh) != "PROC")
    if agent.check_xfer_state(wh) != "DONE":
        fail(f"WRITE ended {agent.check_xfer_state(wh)}: {wh.error}")
    verdict = wait(
        "VERIFY",
        lambda: next(
            (m for m in agent.update_notifs().get("target", []) if m.startswith(b"VERIFY")), None
        ),
    )
    if verdict != b"VERIFY ok":
        fail(verdict.decode())
    ok("write")

    # A notification alone, with bytes that are not text.
    payload = bytes(range(256))
    agent.send_notif("target", b"PING" + payload)
    wait("PONG", lambda: agent.check_remote_xfer_done("target", b"PONG" + payload))
    ok("notif")

    agent.send_notif(name, b"BYE")
    time.sleep(0.05)
    agent.release_xfer_handle(wh)
    agent.release_dlist_handle(lh)
    agent.release_dlist_handle(rh)
    agent.remove_remote_agent("target")
    if mode == "listen":
        agent.invalidate_local_metadata("127.0.0.1", port)
    agent.deregister_memory(reg)
    ok("done")
    time.sleep(0.2)  # let the asynchronous invalidation go out before the engine stops
    agent.close()


if __name__ == "__main__":
    main()
