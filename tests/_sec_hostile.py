"""Hostile targets for tests/test_security.py: Python processes that speak the wire protocol
(tests/_wire.py) from the target's side, without a hixl engine, and lie where an attacker would.

Start: python _sec_hostile.py MODE [ARGS...]. Prints "READY <host:port> <pid> <buf_addr>
<buf_len>" once it listens. Commands on stdin, one line each, answered by one line:
  dump PATH   the private buffer's bytes to PATH                           -> OK
  shrink      ftruncate(0) of the offered memfd                            -> OK | ERR <why>
  served      how many streams finished a handshake                        -> <n>
  answers     the same-host proof answers sent so far, as JSON              -> [...]
  bystander   the forked bystander's pid (mode bystander)                   -> <pid>
  frames      the kinds of the frames received after Hello, all streams      -> [...]
  grow LEN    sends every served stream a RegionsDelta that gives region 0 (same id and
              address) LEN bytes: a lie about a region the initiator may have mapped -> OK
  add_region NAME  (mode regions) adds a region to the table without telling anyone (no
              update, no delta): only a RegionsQuery finds it                 -> OK
  exit                                                                     -> OK

Modes:
  imposter VICTIM_HOST:PORT LO HI
      Learns the victim engine's Welcome as a raw client, then answers every Hello with a
      Welcome that carries the victim's host and same-host identity (v4: its capabilities,
      whose shm/self param names its local socket; v3: its local socket; v2: its pid and
      probe) and a region table of one writable region [LO, HI) of the victim's memory. Data
      frames are refused (Ack/ReadResp FAILED), so nothing arrives by TCP.
  memfd KIND [PATH [UID]]
      A real same-host endpoint: it answers the same-host proof truthfully (v3 and later: on
      an abstract Unix socket, named in Welcome by the param of the shm and self capabilities
      in v4, by local_socket in v3; v2: pid and probe in Welcome) and serves data frames into
      a private buffer, but offers, as the region's memfd (v4: its shm key), KIND = unsealed
      (a memfd named "hixl" without seals), sealed (sealed against shrink and grow), regular
      (the regular file PATH), or swap (fd number N alternates, in a tight loop, between a
      sealed memfd and an O_PATH descriptor of the root-only file PATH; the process drops to
      uid UID, an optional third argument, default 65534, "keep" stays root, after opening
      both and before it binds its Unix socket, so that the kernel records UID for it).
  bystander
      A real same-host endpoint whose abstract Unix listener was created by a forked child (the
      bystander) before any TCP connection: the child binds and listens, hands the listener to
      this process over a socketpair and sleeps, keeping its copy of this process's memory (the
      private buffer at the same address). This process answers the proof on that listener
      truthfully (its own accepted stream, its own descriptor number), offers a table of one
      writable region over its private buffer (no memfd) and serves data frames into it.
  regions
      Another host's engine with named regions in both memory domains, over its private
      buffer: "host" (host domain) at [0, 16 KiB) and "dev" (device domain) at [16, 32 KiB),
      both writable. Data frames are served into the buffer wherever they land in it (the
      domain is not checked here: a write that reached "dev" would change its bytes).
      `add_region NAME` adds [32, 48 KiB) in the host domain under NAME.
  readresp
      Another host's engine: every Write is answered by a ReadResp with status 0 carrying as
      many bytes (0xEE) as the write had.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import threading

import _wire as w

FAILED = 503900
LEN = 64 * 1024
SWAP_FD = 200


class Hostile:
    def __init__(self, argv: list[str]) -> None:
        self.mode = argv[0]
        self.args = argv[1:]
        self.lock = threading.Lock()
        self.served: list[socket.socket] = []
        self.buf = ctypes.create_string_buffer(LEN)
        self.buf_addr = ctypes.addressof(self.buf)
        self.probe = ctypes.c_uint64(int.from_bytes(os.urandom(8), "little") | 1)
        self.memfd = -1
        self.child = 0
        self.answers: list[str] = []
        self.local_name = ""
        self.capabilities: list[w.Capability] | None = None  # None: from local_name
        self.regions: list[w.Region] = []
        self.host = "elsewhere"
        self.v2_identity = (0, 0, 0)  # pid, probe_addr, probe_token (v2 Welcome)
        self.table_version = 1
        self.frames: list[int] = []
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        getattr(self, "setup_" + self.mode)()

    # --- modes -------------------------------------------------------------------------------

    def setup_imposter(self) -> None:
        host, port = self.args[0].rsplit(":", 1)
        lo, hi = int(self.args[1]), int(self.args[2])
        st, welcome = w.connect((host, int(port)), engine="curious", host="elsewhere")
        st.close()
        self.host = welcome["host"]
        if w.VERSION >= 3:
            self.local_name = welcome["local_socket"]
            self.table_version = welcome["table_version"]
            self.capabilities = welcome.get("capabilities")  # v4: replayed as they are
        else:
            self.v2_identity = (welcome["pid"], welcome["probe_addr"], welcome["probe_token"])
        self.regions = [w.Region(lo, hi - lo, 1)]

    def setup_memfd(self) -> None:
        kind = self.args[0]
        self.host = w.host_id()
        self.v2_identity = (os.getpid(), ctypes.addressof(self.probe), self.probe.value)
        if kind == "unsealed":
            fd = os.memfd_create("hixl", os.MFD_CLOEXEC)
            os.ftruncate(fd, LEN)
        elif kind in ("sealed", "swap"):
            fd = os.memfd_create("hixl", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, LEN)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        elif kind == "regular":
            fd = os.open(self.args[1], os.O_RDWR)
        else:
            raise SystemExit(f"unknown memfd kind {kind}")
        self.memfd = fd
        if kind == "swap":
            opath = os.open(self.args[1], os.O_PATH)  # a leaked descriptor of a root-only file
            os.dup2(fd, SWAP_FD)
            fd = SWAP_FD
            uid = self.args[2] if len(self.args) > 2 else "65534"
            if uid != "keep":  # dropped before the Unix socket is bound: the kernel records uid
                os.setgroups([])
                os.setgid(int(uid))
                os.setuid(int(uid))
            threading.Thread(target=self.swap_loop, args=(self.memfd, opath), daemon=True).start()
        if w.VERSION >= 3:
            self.local_name = f"hixl-hostile-{os.urandom(8).hex()}"
            self.usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.usock.bind("\0" + self.local_name)
            self.usock.listen(16)
            threading.Thread(target=self.local_loop, daemon=True).start()
        self.regions = [w.Region(self.buf_addr, LEN, 1, keys=(w.shm_key(fd),))]

    def setup_bystander(self) -> None:
        self.host = w.host_id()
        self.local_name = f"hixl-hostile-{os.urandom(8).hex()}"
        mine, theirs = socket.socketpair()
        parent = os.getpid()
        self.child = os.fork()
        if self.child == 0:  # the bystander: creates the listener, then only sleeps
            try:
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                if os.getppid() != parent:
                    os._exit(0)
                mine.close()
                self.lsock.close()  # it holds no TCP socket of H
                u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                u.bind("\0" + self.local_name)
                u.listen(16)
                socket.send_fds(theirs, [b"L"], [u.fileno()])
                u.close()
                theirs.close()
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        theirs.close()
        _, fds, _, _ = socket.recv_fds(mine, 1, 1)
        mine.close()
        self.usock = socket.socket(fileno=fds[0])
        threading.Thread(target=self.local_loop, daemon=True).start()
        self.regions = [w.Region(self.buf_addr, LEN, 1)]

    def setup_regions(self) -> None:
        q = LEN // 4
        self.regions = [
            w.Region(self.buf_addr, q, 1, name="host"),
            w.Region(self.buf_addr + q, q, 2, domain=w.DEVICE, name="dev"),
            w.Region(self.buf_addr + 3 * q, q, 4, domain=w.CUDA + 3, name="gpu"),
        ]

    def add_region(self, name: str) -> None:
        q = LEN // 4
        with self.lock:
            self.regions.append(w.Region(self.buf_addr + 2 * q, q, 3, name=name))
            self.table_version += 1

    def setup_readresp(self) -> None:
        self.regions = [w.Region(self.buf_addr, LEN, 1)]

    @staticmethod
    def swap_loop(memfd: int, opath: int) -> None:
        while True:
            for _ in range(1000):
                os.dup2(opath, SWAP_FD)
                os.dup2(memfd, SWAP_FD)

    # --- the same-host proof (v3 and later) -------------------------------------------------

    def local_loop(self) -> None:
        while True:
            c, _ = self.usock.accept()
            threading.Thread(target=self.local_answer, args=(c,), daemon=True).start()

    def local_answer(self, c: socket.socket) -> None:
        """Answers "HIXL-LOCAL 3 <initiator> <target>" (with the initiator's socket attached)
        truthfully: OK and the number of this process's own descriptor of that stream, only
        when one of the streams this process accepted has exactly those two ends. A request
        without a descriptor (the engine before ad2bfd7) gets that engine's answer instead:
        OK, the table version and this process's probe (address and token)."""
        with c:
            msg, fds, _, _ = socket.recv_fds(c, 512, 4)
            for fd in fds:
                os.close(fd)
            words = msg.decode().split()
            found = None
            if len(words) == 4 and words[0] == "HIXL-LOCAL":
                with self.lock:
                    for s in self.served:
                        try:
                            ends = (w.addr_text(s.getpeername()), w.addr_text(s.getsockname()))
                        except OSError:
                            continue
                        if ends == (words[2], words[3]):
                            found = s.fileno()
            if found is not None and fds:
                answer = f"OK {self.table_version} {found}"
            elif found is not None:
                answer = (
                    f"OK {self.table_version} {ctypes.addressof(self.probe)} {self.probe.value}"
                )
            else:
                answer = "NO no stream of mine has those ends"
            with self.lock:
                self.answers.append(answer)
            c.sendall(f"{answer}\n".encode())

    # --- TCP ---------------------------------------------------------------------------------

    def welcome(self) -> bytes:
        pid, probe_addr, probe_token = self.v2_identity
        return w.welcome_payload(
            "hostile",
            self.host,
            self.regions,
            capabilities=self.capabilities,
            local_socket=self.local_name,
            table_version=self.table_version,
            pid=pid,
            probe_addr=probe_addr,
            probe_token=probe_token,
        )

    def grow(self, n: int) -> None:
        with self.lock:
            old = self.table_version
            self.table_version += 1
            r = self.regions[0]
            big = w.Region(r.addr, n, r.id, r.writable, r.domain, r.name, r.keys)
            self.regions = [big, *self.regions[1:]]
            payload = w.regions_delta_payload(old, self.table_version, [big])
            delta = w.frame(w.REGIONS_DELTA, payload)
            for s in self.served:
                s.sendall(delta)

    def accept_loop(self) -> None:
        while True:
            c, _ = self.lsock.accept()
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c: socket.socket) -> None:
        try:
            kind, _, _, _ = w.read_frame(c)
            if kind != w.HELLO:
                return
            with self.lock:
                self.served.append(c)  # before Welcome: the proof may come right after it
            c.sendall(w.frame(w.WELCOME, self.welcome()))
            while True:
                kind, tag, bulk, payload = w.read_frame(c)
                with self.lock:
                    self.frames.append(kind)
                if kind == w.HEARTBEAT:
                    c.sendall(w.frame(w.HEARTBEAT_ACK, tag=tag))
                elif kind == w.REGIONS_QUERY:
                    with self.lock:
                        table = w.regions_table_payload(self.table_version, self.regions)
                    c.sendall(w.frame(w.REGIONS_TABLE, table, tag=tag))
                elif kind == w.NOTIFY:
                    c.sendall(w.frame(w.ACK, w.status_payload(0), tag=tag))
                elif kind == w.BYE:
                    c.sendall(w.frame(w.ACK, w.status_payload(0), tag=tag))
                    return
                elif kind in (w.WRITE, w.WRITE_STRIDED, w.READ, w.READ_STRIDED):
                    self.data(c, kind, tag, bulk, payload)
                elif kind != w.REGIONS_ACK:
                    return
        except (OSError, ConnectionError, AssertionError, ValueError):
            return
        finally:
            with self.lock:
                if c in self.served:
                    self.served.remove(c)
            c.close()

    def ranges(self, kind: int, payload: bytes) -> list[tuple[int, int]]:
        if kind in (w.WRITE, w.READ):
            (n,) = struct.unpack_from("<I", payload)
            return [struct.unpack_from("<QQ", payload, 4 + 16 * i) for i in range(n)]
        addr, count, size, stride = struct.unpack("<QQQQ", payload)
        return [(addr + i * stride, size) for i in range(count)]

    def data(self, c: socket.socket, kind: int, tag: int, bulk: int, payload: bytes) -> None:
        write = kind in (w.WRITE, w.WRITE_STRIDED)
        body = w.recv_exact(c, bulk) if write else b""
        if self.mode == "readresp" and write:
            c.sendall(
                w.frame(w.READ_RESP, w.status_payload(0), tag=tag, bulk=bulk) + b"\xee" * bulk
            )
            return
        ranges = self.ranges(kind, payload)
        lo, hi = self.buf_addr, self.buf_addr + LEN
        if self.mode == "imposter" or any(a < lo or a + n > hi for a, n in ranges):
            st = w.status_payload(FAILED, "refused by the hostile target")
            c.sendall(w.frame(w.ACK if write else w.READ_RESP, st, tag=tag))
            return
        if write:
            off = 0
            for a, n in ranges:
                ctypes.memmove(a, body[off : off + n], n)
                off += n
            c.sendall(w.frame(w.ACK, w.status_payload(0), tag=tag))
        else:
            out = b"".join(ctypes.string_at(a, n) for a, n in ranges)
            c.sendall(w.frame(w.READ_RESP, w.status_payload(0), tag=tag, bulk=len(out)) + out)


def main() -> None:
    h = Hostile(sys.argv[1:])
    threading.Thread(target=h.accept_loop, daemon=True).start()
    host, port = h.lsock.getsockname()
    print(f"READY {host}:{port} {os.getpid()} {h.buf_addr} {LEN}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "dump":
            with open(args[0], "wb") as f:
                f.write(ctypes.string_at(h.buf_addr, LEN))
            print("OK", flush=True)
        elif cmd == "shrink":
            try:
                os.ftruncate(h.memfd, 0)
                print("OK", flush=True)
            except OSError as e:
                print(f"ERR {e}", flush=True)
        elif cmd == "served":
            with h.lock:
                print(len(h.served), flush=True)
        elif cmd == "answers":
            with h.lock:
                print(json.dumps(h.answers), flush=True)
        elif cmd == "frames":
            with h.lock:
                print(json.dumps(h.frames), flush=True)
        elif cmd == "add_region":
            h.add_region(args[0])
            print("OK", flush=True)
        elif cmd == "grow":
            h.grow(int(args[0]))
            print("OK", flush=True)
        elif cmd == "bystander":
            print(h.child, flush=True)
        elif cmd == "exit":
            print("OK", flush=True)
            os._exit(0)


if __name__ == "__main__":
    main()
