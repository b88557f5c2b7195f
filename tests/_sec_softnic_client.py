"""A local client of a soft RDMA NIC's abstract socket, for tests/test_security_caps.py.

Start (as root): python _sec_softnic_client.py NAME UID N WAIT_S. Imports everything first
(the interpreter may live where UID cannot read), then drops to UID (gid UID, no
supplementary groups; UID "keep" stays root, as a control), and only then opens N
connections to the abstract socket NAME, sending nothing. Waits up to WAIT_S seconds for the
device to close them and prints "TIMES t1 ... tN": the seconds each took to be closed, -1
for one still open at the end. Only the standard library.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time


def main() -> None:
    name, who, n, wait_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    if who != "keep":
        uid = int(who)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        assert os.geteuid() == uid and os.getegid() == uid
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + name)
        socks.append(s)
    t0 = time.monotonic()
    closed: dict[int, float] = {}
    while len(closed) < n and time.monotonic() - t0 < wait_s:
        open_ = [s for i, s in enumerate(socks) if i not in closed]
        ready, _, _ = select.select(open_, [], [], 0.05)
        for s in ready:
            try:
                gone = s.recv(1) == b""
            except ConnectionError:
                gone = True
            if gone:
                closed[socks.index(s)] = time.monotonic() - t0
    print("TIMES " + " ".join(f"{closed.get(i, -1):.3f}" for i in range(n)), flush=True)
    for s in socks:
        s.close()


if __name__ == "__main__":
    main()
