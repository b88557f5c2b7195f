"""A same-host peer that execs a setuid program after the proof, for tests/test_security_exec.py.

Start (as root): python _sec_exec.py UID HELPER SECRET. Imports everything first, then drops to
UID (gid UID, no supplementary groups; "keep" stays root, the control), and only then binds its
abstract Unix socket, so the kernel records UID as the socket's creator. It speaks the wire
protocol (tests/_wire.py) from the target's side like tests/_sec_hostile.py's memfd mode: it
answers the same-host proof truthfully (its own accepted stream, its own descriptor number) and
serves data frames into its private buffer (a range outside it is answered FAILED). Prints
"READY <host:port> <pid> <buf_addr> <buf_len>" once it listens. Commands on stdin:

  exec   fork; this process (the proven pid) execs HELPER SECRET with descriptor 3 a pipe to the
         child, and the child keeps every stream this process served and serves them from then
         on. HELPER writes "ADDR <addr> <len> <euid>" to descriptor 3 (the address of its global
         buffer, filled from SECRET) and sleeps; the child then sends each control stream a
         RegionsDelta adding one writable region over that buffer, waits (10 s at most) for the
         initiator's RegionsAck, and prints "EXECED <addr> <len> <euid> <child pid> <acked>".
  exit   -> OK
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import sys
import threading

import _wire as w
from _sec_hostile import Hostile

ACK_WAIT_S = 10.0


class ExecPeer(Hostile):
    """Hostile's proof answer, Welcome and data handling; streams served by `loop`."""

    def __init__(self, argv: list[str]) -> None:
        self.control: set[socket.socket] = set()
        self.acked = threading.Event()
        super().__init__(["exec", *argv])

    def setup_exec(self) -> None:
        uid = self.args[0]
        if uid != "keep":
            os.setgroups([])
            os.setgid(int(uid))
            os.setuid(int(uid))
        self.host = w.host_id()
        self.local_name = f"hixl-exec-{os.urandom(8).hex()}"
        self.usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.usock.bind("\0" + self.local_name)  # after the drop: the kernel records UID
        self.usock.listen(16)
        threading.Thread(target=self.local_loop, daemon=True).start()
        self.regions = [w.Region(self.buf_addr, len(self.buf), 1)]

    def serve(self, c: socket.socket) -> None:
        try:
            kind, _, _, payload = w.read_frame(c)
            if kind != w.HELLO:
                return
            data_path = w.decode_hello(payload)["flags"] & w.FLAG_DATA_PATH
            with self.lock:
                self.served.append(c)  # before Welcome: the proof may come right after it
                if not data_path:
                    self.control.add(c)
            c.sendall(w.frame(w.WELCOME, self.welcome()))
            self.loop(c)
        except (OSError, ConnectionError, AssertionError, ValueError):
            return

    def loop(self, c: socket.socket) -> None:
        """Serves one stream after its handshake until it ends."""
        try:
            while True:
                kind, tag, bulk, payload = w.read_frame(c)
                if kind == w.HEARTBEAT:
                    c.sendall(w.frame(w.HEARTBEAT_ACK, tag=tag))
                elif kind == w.REGIONS_ACK:
                    self.acked.set()
                elif kind == w.REGIONS_QUERY:
                    with self.lock:
                        table = w.regions_table_payload(self.table_version, self.regions)
                    c.sendall(w.frame(w.REGIONS_TABLE, table, tag=tag))
                elif kind in (w.NOTIFY, w.BYE):
                    c.sendall(w.frame(w.ACK, w.status_payload(0), tag=tag))
                    if kind == w.BYE:
                        return
                elif kind in (w.WRITE, w.WRITE_STRIDED, w.READ, w.READ_STRIDED):
                    self.data(c, kind, tag, bulk, payload)  # outside the buffer: FAILED
                else:
                    return
        except (OSError, ConnectionError, AssertionError, ValueError):
            return
        finally:
            c.close()

    def exec_helper(self, helper: str, secret: str) -> None:
        r, wr = os.pipe()
        parent = os.getpid()
        with self.lock:  # no serving thread changes the lists while the child copies them
            pid = os.fork()
        if pid:  # the proven process: becomes the setuid program, same pid, same pidfd
            os.dup2(wr, 3)
            os.execv(helper, [helper, secret])
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the program
        if os.getppid() != parent:
            os._exit(0)
        os.close(wr)
        self.acked.clear()
        for c in self.served:  # the parent's serving threads are gone: serve them here
            threading.Thread(target=self.loop, args=(c,), daemon=True).start()
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([r], [], [], ACK_WAIT_S)
            chunk = os.read(r, 256) if ready else b""
            if not chunk:
                print(f"ERR the helper said {line!r}", flush=True)
                return
            line += chunk
        _, addr, n, euid = line.decode().split()
        with self.lock:
            old = self.table_version
            self.table_version += 1
            region = w.Region(int(addr), int(n), 2)
            self.regions.append(region)
            delta = w.frame(w.REGIONS_DELTA, w.regions_delta_payload(old, old + 1, [region]))
            for c in self.control:
                c.sendall(delta)
        acked = self.acked.wait(ACK_WAIT_S)
        print(f"EXECED {addr} {n} {euid} {os.getpid()} {int(acked)}", flush=True)


def main() -> None:
    p = ExecPeer(sys.argv[1:2])
    helper, secret = sys.argv[2], sys.argv[3]
    threading.Thread(target=p.accept_loop, daemon=True).start()
    host, port = p.lsock.getsockname()
    print(f"READY {host}:{port} {os.getpid()} {p.buf_addr} {len(p.buf)}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "exec":
            p.exec_helper(helper, secret)
        elif cmd == "exit":
            print("OK", flush=True)
            os._exit(0)


if __name__ == "__main__":
    main()
