"""Counting relays for tests/test_regions.py: N TCP relays in one process, each listening on
its own port and forwarding every connection to one target, byte for byte, both ways. Each
relay parses the target's frames (tests/_wire.py; no cluster secret, so nothing is sealed)
and counts the bytes and frames that flow target -> initiator, per frame kind, before it
forwards them: once an initiator has acted on a frame, the frame is counted.

Start: python _count_relay.py TARGET_HOST:PORT N. Prints "READY <host:port> ..." (the N
relays' addresses). Commands on stdin, one line each, answered by one line:
  counts   a JSON list, one entry per relay:
           {"bytes": n, "conns": n, "kinds": {"<kind>": [frames, bytes], ...}}
  exit     -> OK
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from collections import defaultdict

import _wire as w


class Relay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.lock = threading.Lock()
        self.bytes = 0
        self.conns = 0
        self.kinds: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        threading.Thread(target=self.accept_loop, daemon=True).start()

    def addr(self) -> str:
        return w.addr_text(self.lsock.getsockname())

    def accept_loop(self) -> None:
        while True:
            a, _ = self.lsock.accept()
            t = socket.create_connection(self.target, timeout=5)
            t.settimeout(None)
            with self.lock:
                self.conns += 1
            threading.Thread(target=self.up, args=(a, t), daemon=True).start()
            threading.Thread(target=self.down, args=(t, a), daemon=True).start()

    @staticmethod
    def up(a: socket.socket, t: socket.socket) -> None:
        """initiator -> target, unparsed."""
        try:
            while data := a.recv(65536):
                t.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            t.shutdown(socket.SHUT_WR)

    def down(self, t: socket.socket, a: socket.socket) -> None:
        """target -> initiator, frame by frame, each counted before it is forwarded."""
        try:
            while True:
                head = w.recv_exact(t, 24)
                _, _, kind, plen, _, bulk = w.HEADER.unpack(head)
                body = w.recv_exact(t, plen + bulk)
                with self.lock:
                    n = len(head) + len(body)
                    self.bytes += n
                    self.kinds[kind][0] += 1
                    self.kinds[kind][1] += n
                a.sendall(head + body)
        except (OSError, ConnectionError):
            pass
        with contextlib.suppress(OSError):
            a.shutdown(socket.SHUT_WR)

    def counts(self) -> dict[str, object]:
        with self.lock:
            kinds = {str(k): list(v) for k, v in sorted(self.kinds.items())}
            return {"bytes": self.bytes, "conns": self.conns, "kinds": kinds}


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    relays = [Relay((host, int(port))) for _ in range(int(sys.argv[2]))]
    print("READY " + " ".join(r.addr() for r in relays), flush=True)
    for line in sys.stdin:
        if line.strip() == "counts":
            print(json.dumps([r.counts() for r in relays]), flush=True)
        elif line.strip() == "exit":
            print("OK", flush=True)
            return


if __name__ == "__main__":
    main()
