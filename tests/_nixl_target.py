"""The target of the two-process NIXL tests, written the way NIXL's users write one.

python _nixl_target.py MODE DIR   (MODE: md | listen)
It registers a source tensor (pattern 1) and a zeroed destination tensor, publishes its
metadata (md: to DIR/target.md; listen: its listen thread serves it, port on the READY line),
learns the initiator's (md: from DIR/initiator.md; listen: the initiator sends it), sends the
initiator its serialized row descriptors as notifications, then answers: WRITTEN -> checks its
destination byte for byte and says VERIFY ok/bad; PING<x> -> PONG<x>; BYE -> exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from _nixl_common import ROWS, fail, ok, pattern, published, rows, wait

from hixl.nixl import nixl_agent, nixl_agent_config


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    agent = nixl_agent("target", nixl_agent_config(True, mode == "listen", 0))
    src = pattern(1)
    dst = np.zeros_like(src)
    reg = agent.register_memory([src, dst])
    src_descs = agent.get_xfer_descs(rows(src), "DRAM")
    dst_descs = agent.get_xfer_descs(rows(dst), "DRAM")
    if mode == "md":
        tmp = out / "target.md.tmp"
        tmp.write_bytes(agent.get_agent_metadata())
        tmp.rename(out / "target.md")
    print(f"READY {agent.listen_port or 0}", flush=True)

    peer = out / "initiator.md"
    if mode == "md":
        name = agent.add_remote_agent(wait("initiator.md", lambda: published(peer)))
    else:
        wait("initiator's metadata", lambda: agent.check_remote_metadata("initiator"))
        name = b"initiator"
    if name != b"initiator":
        fail(f"add_remote_agent returned {name!r}")
    ok("metadata")
    agent.send_notif("initiator", b"SRC" + agent.get_serialized_descs(src_descs))
    agent.send_notif("initiator", b"DST" + agent.get_serialized_descs(dst_descs))

    wait("READ_DONE", lambda: agent.check_remote_xfer_done("initiator", b"READ_DONE"))
    ok("read notified")
    wait("WRITTEN", lambda: agent.check_remote_xfer_done("initiator", b"WRITTEN"))
    # The initiator wrote its pattern-2 row perm[j] into row j (perm: reversed rows).
    want = pattern(2)[np.arange(ROWS)[::-1]]
    if np.array_equal(dst, want):
        agent.send_notif("initiator", b"VERIFY ok")
        ok("write verified")
    else:
        bad = int(np.argmax((dst != want).any(axis=1)))
        agent.send_notif("initiator", f"VERIFY bad row {bad}".encode())
        fail(f"destination row {bad} differs")

    def ping() -> bytes | None:
        for m in agent.update_notifs().get("initiator", []):
            if m.startswith(b"PING"):
                agent.notifs["initiator"].remove(m)
                return m
        return None

    msg = wait("PING", ping)
    agent.send_notif("initiator", b"PONG" + msg[4:])
    ok("ping")
    wait("BYE", lambda: agent.check_remote_xfer_done("initiator", b"BYE"))
    if mode == "listen":
        wait("invalidation", lambda: not agent.check_remote_metadata("initiator"))
        ok("invalidated")
    agent.deregister_memory(reg)
    ok("done")
    agent.close()


if __name__ == "__main__":
    main()
