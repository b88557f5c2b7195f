"""A relay without the cluster secret, for tests/test_security.py: it listens on its own port
and forwards every connection to the target, byte for byte, parsing the target's frames. Once
a Welcome has gone through (the handshake that it relayed succeeded), it stops forwarding and
uses the target's side of the stream for itself: it sends its own Read of the target's memory.
It does the same when the relayed handshake ends any other way (an Error, the initiator
leaving), as long as the target's side is open.

Start: python _sec_relay.py TARGET_HOST:PORT MODE READ_ADDR READ_LEN, MODE = hijack (forward
unchanged) or rewrite (rewrite Hello's `dialled` to the target's own address, so that the
target's address check passes). Prints "READY <host:port>". Commands on stdin:
  report   waits (bounded) for every relayed connection to end, then prints a JSON list with
           one entry per connection: {"welcome": bool, "stolen": hex or null, "end": why}
  exit
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import sys
import threading
import time
from typing import Any

import _wire as w


class Relay:
    def __init__(self, target: tuple[str, int], mode: str, addr: int, n: int) -> None:
        self.target, self.mode, self.addr, self.n = target, mode, addr, n
        self.results: list[dict[str, Any]] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)

    def accept_loop(self) -> None:
        while True:
            a, _ = self.lsock.accept()
            t = threading.Thread(target=self.handle, args=(a,), daemon=True)
            with self.lock:
                self.threads.append(t)
            t.start()

    def handle(self, a: socket.socket) -> None:
        res: dict[str, Any] = {"welcome": False, "stolen": None, "end": ""}
        t = socket.create_connection(self.target, timeout=5)
        a.settimeout(5)
        hijacked = threading.Event()

        def pump() -> None:  # initiator -> target, until the hijack
            try:
                if self.mode == "rewrite":
                    kind, tag, bulk, payload = w.read_frame(a)
                    if kind == w.HELLO and w.VERSION >= 3:
                        h = w.decode_hello(payload)
                        payload = w.hello_payload(
                            h["engine_id"],
                            h["host"],
                            h["stream_index"],
                            h["auth_nonce"],
                            h["link_nonce"],
                            h["stream_count"],
                            h["flags"],
                            w.addr_text(t.getpeername()),
                        )
                    t.sendall(w.frame(kind, payload, tag, bulk))
                while not hijacked.is_set():
                    data = a.recv(65536)
                    if not data:
                        break
                    if not hijacked.is_set():
                        t.sendall(data)
            except OSError:
                pass
            hijacked.set()  # the initiator is gone (or the relay took over): stop forwarding

        threading.Thread(target=pump, daemon=True).start()
        sealed = False
        try:
            while True:
                if not select.select([t], [], [], 0.1)[0]:
                    if hijacked.is_set():
                        res["end"] = "the initiator left"
                        break
                    continue
                head = w.recv_exact(t, 24)
                _, _, kind, plen, _, bulk = w.HEADER.unpack(head)
                body = w.recv_exact(t, plen)
                if sealed:
                    body += w.recv_exact(t, w.MAC_LEN)
                body += w.recv_exact(t, bulk)
                with contextlib.suppress(OSError):
                    a.sendall(head + body)
                if kind == w.AUTH_CHALLENGE and w.VERSION >= 3:
                    sealed = True  # everything after the challenge carries a MAC
                if kind == w.ERROR:
                    res["end"] = "target sent Error: " + w.status_of(body[:plen])[1]
                    break
                if kind == w.WELCOME:
                    res["welcome"] = True
                    res["end"] = "Welcome went through"
                    break
        except (OSError, ConnectionError, ValueError) as e:
            res["end"] = f"closed: {e!r}"
        # Whatever ended the relayed handshake, the relay now uses the target's side itself.
        hijacked.set()
        res["stolen"], why = self.steal(t, sealed)
        res["end"] += "; then " + why
        t.close()
        a.close()
        with self.lock:
            self.results.append(res)

    def steal(self, t: socket.socket, sealed: bool) -> tuple[str | None, str]:
        """Sends the relay's own Read on the target's side of the stream; the bytes if any."""
        try:
            t.sendall(w.frame(w.READ, w.segs([(self.addr, self.n)]), tag=777))
            while True:
                head = w.recv_exact(t, 24)
                _, _, kind, plen, tag, bulk = w.HEADER.unpack(head)
                payload = w.recv_exact(t, plen)
                if sealed:
                    w.recv_exact(t, w.MAC_LEN)
                if kind == w.READ_RESP and tag == 777:
                    status = struct.unpack_from("<I", payload)[0]
                    data = w.recv_exact(t, bulk)
                    if status == 0 and data:
                        return data.hex(), "read the target's memory"
                    return None, f"ReadResp status {status}"
                w.recv_exact(t, bulk)
                if kind == w.ERROR:
                    return None, "target sent Error: " + w.status_of(payload)[1]
        except (OSError, ConnectionError) as e:
            return None, f"closed after the hijack: {e!r}"


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    r = Relay((host, int(port)), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    threading.Thread(target=r.accept_loop, daemon=True).start()
    h, p = r.lsock.getsockname()
    print(f"READY {h}:{p}", flush=True)
    for line in sys.stdin:
        if line.strip() == "report":
            deadline = time.monotonic() + 15
            with r.lock:
                threads = list(r.threads)
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            with r.lock:
                print(json.dumps(r.results), flush=True)
        elif line.strip() == "exit":
            print("OK", flush=True)
            return


if __name__ == "__main__":
    main()
