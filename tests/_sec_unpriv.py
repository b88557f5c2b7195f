"""A same-host client of another user, for tests/test_security.py: asks a target engine for
the same-host proof about its own stream, truthfully, then never confirms a region update.

Start (as root): python _sec_unpriv.py TARGET_HOST:PORT UID. Imports everything first (the
interpreter may live where UID cannot read), then drops to UID (gid UID, no supplementary
groups; UID "keep" stays root, as a control), and only then opens its sockets, so the kernel
records UID for both of them. It connects to the target by TCP, sends a Hello (no secret),
reads the Welcome, connects to the abstract Unix socket the Welcome names (v4: the param of
its shm capability) and sends "HIXL-LOCAL 3 <its end> <target's end>" with its own TCP
socket attached. Prints "ANSWER <euid> <the answer line>", then keeps the TCP stream open
without reading it or sending anything (no RegionsAck) until "exit" on stdin.

Only the standard library and tests/_wire.py.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (getaddrinfo encodes host names with it, lazily)
import os
import socket
import sys

import _wire as w


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    if sys.argv[2] != "keep":
        uid = int(sys.argv[2])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        assert os.geteuid() == uid and os.getegid() == uid
    tcp = socket.create_connection((host, int(port)), timeout=5)
    tcp.sendall(w.hello(engine="other-user", host=w.host_id(), dialled=w.dialled_of(tcp)))
    kind, _, _, payload = w.read_frame(tcp)
    assert kind == w.WELCOME, f"kind {kind}: {payload!r}"
    name = w.decode_welcome(payload)["local_socket"]
    line = f"HIXL-LOCAL 3 {w.addr_text(tcp.getsockname())} {w.addr_text(tcp.getpeername())}\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:
        u.settimeout(5)
        u.connect("\0" + name)
        socket.send_fds(u, [line.encode()], [tcp.fileno()])
        answer = b""
        while chunk := u.recv(512):
            answer += chunk
    print(f"ANSWER {os.geteuid()} {answer.decode().strip()}", flush=True)
    for cmd in sys.stdin:  # the TCP stream stays open, unread, never confirming anything
        if cmd.strip() == "exit":
            print("OK", flush=True)
            break
    tcp.close()


if __name__ == "__main__":
    main()
