"""The initiator side of the README's basic flow, against a running examples/target.py.

Connects, finds the target's region "kv" by name, writes random bytes into it and reads them
back, runs an async transfer with a notification, the one-sided put/get helpers and strided
put/get of KV-cache layers, then tells the target "done" with the sha256 that "kv" must hold.

    python examples/target.py --listen 127.0.0.1:18001 &
    python examples/initiator.py --remote 127.0.0.1:18001

Exits 0 when every byte read back is right, 1 (with the reason on stderr) otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np

import hixl


def check(what: str, ok: bool) -> None:
    if not ok:
        raise SystemExit(f"{what}: wrong bytes")
    print(f"{what}: ok", flush=True)


def find_region(e: hixl.Hixl, remote: str, name: str, timeout_ms: int) -> hixl.RemoteRegion:
    """The peer's region called `name`. The target listens before it registers its memory,
    so an initiator started at the same moment may connect first: ask again until then."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        try:
            return e.remote_region(remote, name)  # one round trip when not known yet
        except hixl.ParamInvalid:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--remote", required=True, help="the target's ip:port (its READY line)")
    p.add_argument("--local", default="127.0.0.1", help="this engine's ip ('ip' alone: client)")
    p.add_argument("--backends", default="auto", help="hixl.backends: auto, shm, tcp, ...")
    p.add_argument("--timeout-ms", type=int, default=10_000, help="connect and transfer timeout")
    args = p.parse_args()
    remote, ms = args.remote, args.timeout_ms

    with hixl.Hixl() as e:  # finalized on exit
        e.initialize(args.local, {"hixl.backends": args.backends})  # "ip" alone: client only
        e.connect(remote, timeout_ms=ms)  # retries until the target listens, up to timeout_ms
        kv = find_region(e, remote, "kv", ms)  # by name; e.remote_regions() lists them all
        print(f"connected to {remote}; its 'kv' is {kv.len} bytes at {kv.addr:#x}", flush=True)

        # WRITE random bytes over all of "kv", then READ them back into a zeroed buffer.
        rng = np.random.default_rng()
        src = hixl.aligned_empty(kv.len)
        src[:] = rng.integers(0, 256, kv.len, dtype=np.uint8)
        dst = hixl.aligned_empty(kv.len)
        dst[:] = 0
        hs, hd = e.register(src), e.register(dst)
        # A batch: a list of (local_addr, remote_addr, length) descriptors.
        e.transfer_sync(remote, hixl.TransferOp.WRITE, [(hs.addr, kv.addr, kv.len)], timeout_ms=ms)
        e.transfer_sync(remote, hixl.TransferOp.READ, [(hd.addr, kv.addr, kv.len)], timeout_ms=ms)
        check(f"write {kv.len} bytes, read them back", np.array_equal(src, dst))

        # Async, with user data and a notification that reaches the target after the bytes.
        # A large batch is cheaper as an (N, 3) uint64 array of (local, remote, length) rows.
        req = e.transfer_async(
            remote,
            hixl.TransferOp.WRITE,
            np.array([[hs.addr, kv.addr, 4096]], np.uint64),
            user_data="first page",
            notify=hixl.NotifyDesc("kv", "page 0"),
            timeout_ms=ms,
        )
        status = req.wait(timeout_ms=ms)  # -> hixl.TransferStatus; GIL released, Ctrl-C works
        print(f"async write '{req.user_data}': {status}", flush=True)
        req.result()  # raises the request's error if it failed

        # One-sided helpers: put = WRITE, get = READ of one contiguous range.
        e.put(remote, hs.addr + 8192, kv.addr + 8192, 4096, timeout_ms=ms)
        dst[:] = 0
        e.get(remote, hd.addr, kv.addr, 16384, timeout_ms=ms)
        check("put 4096 bytes, get 16384", np.array_equal(dst[:16384], src[:16384]))

        # Strided: one call moves one layer of a paged KV cache (head rows padded to 64 bytes).
        lay = hixl.KVLayout(
            num_layers=4,
            num_kv_heads=8,
            head_dim=96,
            dtype="float16",
            block_tokens=16,
            num_blocks=16,
        )  # head rows: 192 bytes used, padded to 256
        if lay.nbytes > kv.len:
            raise SystemExit(f"the target's 'kv' ({kv.len} bytes) is under {lay.nbytes} bytes")
        cache = lay.empty()  # 4 KiB aligned, lay.nbytes bytes
        cache[:] = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
        back = lay.empty()
        back[:] = 0
        hc, hb = e.register(cache), e.register(back)
        off, d = lay.layer_desc(1)  # (byte offset, StridedDesc) of layer 1
        e.put_strided(remote, hc.addr + off, kv.addr + off, d, timeout_ms=ms)
        off2, d2 = lay.layer_desc(2)
        req = e.put_strided_async(
            remote,
            hc.addr + off2,
            kv.addr + off2,
            d2,
            notify=hixl.NotifyDesc("kv", "layer 2"),
            timeout_ms=ms,
        )
        req.wait(timeout_ms=ms)
        req.result()
        e.get_strided(remote, hb.addr + off, kv.addr + off, d, timeout_ms=ms)
        e.get_strided(remote, hb.addr + off2, kv.addr + off2, d2, timeout_ms=ms)

        # What each side should hold now: head rows are (layers, K/V, blocks, tokens, heads,
        # padded row) of 2-byte values; the strided calls moved the first head_dim of each row
        # (compared as uint16: random bits include float16 NaNs, which never compare equal).
        def rows(buf: np.ndarray) -> np.ndarray:
            return buf[: lay.nbytes].view(np.uint16).reshape(lay.shape)[..., : lay.head_dim]

        want = src.copy()
        rows(want)[1:3] = rows(cache)[1:3]
        check(
            f"strided put/get of layers 1 and 2 ({d.count} rows each)",
            np.array_equal(rows(back)[1:3], rows(cache)[1:3]),
        )

        s = e.stats()[remote]  # per peer: backend, bytes and ops each way, latency, ...
        print(f"backend {s['backend']}: wrote {s['bytes_write']} bytes, read {s['bytes_read']}")
        # Tell the target we are done and what "kv" must hold (it checks out of band).
        digest = hashlib.sha256(want.tobytes()).hexdigest()
        e.send_notify(remote, hixl.NotifyDesc("done", digest), timeout_ms=ms)
        print("sent 'done'", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
