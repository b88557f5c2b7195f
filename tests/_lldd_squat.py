"""A process of another user that takes a TCP port, for tests/test_lldd_ranktable.py:
``python _lldd_squat.py IP PORT UID``. Drops to UID (gid UID, no supplementary groups), then
binds and listens at IP:PORT and prints "BOUND", or "REFUSED <errno name>" when the kernel
refuses the bind; holds the port until "exit" on stdin. Standard library only."""

from __future__ import annotations

import errno
import os
import socket
import sys


def main() -> None:
    ip, port, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    assert os.geteuid() == uid
    s = socket.socket()
    try:
        s.bind((ip, port))
        s.listen(8)
        print("BOUND", flush=True)
    except OSError as exc:
        print("REFUSED", errno.errorcode.get(exc.errno or 0, str(exc.errno)), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    s.close()


if __name__ == "__main__":
    main()
