"""The rdma backend between two hosts: two VMs of scripts/rxe_vm.sh (`pair`), each with its own
NIC (virtio-net, one link between them) and rxe0 on it, the real verbs provider on both.

    HIXL_SECRET=$(hixl secret) scripts/rxe_vm.sh pair \\
        -- env HIXL_SECRET=$HIXL_SECRET python scripts/rxe_pair_check.py initiator \\
        -- env HIXL_SECRET=$HIXL_SECRET python scripts/rxe_pair_check.py target

The target (192.0.2.2) registers 80 MiB and waits. The initiator (192.0.2.1) connects over
rdma, WRITEs 4,096 scattered 16 KiB pages and one 8 MiB range, READs them back and compares
them byte for byte, and notifies; the target checks the bytes it holds against the same
pattern and answers with a notification of its own (over its own link to the initiator). Then
the initiator starts 256 MiB of WRITEs and asks the target to die: its VM powers off at once
(the kernel's sysrq, no goodbye on any socket), and every pending request of the initiator
must end when the link is found dead (NOT_CONNECTED, well within its deadline). Exit status 0
when all of it held (the target writes its status before it dies). Both take the cluster
secret from HIXL_SECRET (scripts/rxe_check.sh makes one).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
TARGET = "192.0.2.2:18600"
SIZE = 80 << 20
PAGE, PAGES = 16 << 10, 4096
BIG = 8 << 20
OPTS = {
    "hixl.backends": "rdma",
    "hixl.rdma.provider": "verbs",
    "hixl.rdma.device": "rxe0",
    "hixl.rdma.gid_index": "1",
}


def pattern() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the initiator writes: (source bytes, page order at the target, expected target)."""
    rng = np.random.default_rng(2026)
    src = rng.integers(0, 256, PAGES * PAGE + BIG, dtype=np.uint8)
    order = rng.permutation(PAGES)
    want = np.zeros(SIZE, np.uint8)
    for i, o in enumerate(order):
        want[o * PAGE : (o + 1) * PAGE] = src[i * PAGE : (i + 1) * PAGE]
    want[PAGES * PAGE : PAGES * PAGE + BIG] = src[PAGES * PAGE :]
    return src, order, want


def say(msg: str) -> None:
    print(f"[{os.environ.get('HIXL_VM_IP', '?')}] {msg}", flush=True)


def target() -> int:
    e = hixl.Hixl()
    e.initialize(TARGET, OPTS)
    buf = np.zeros(SIZE, np.uint8)
    e.register(buf, name="kv")
    say(f"target ready at {TARGET}, region 0x{buf.ctypes.data:x}")
    _, _, want = pattern()
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        try:
            got = e.wait_notifies(5000)
        except hixl.Timeout:
            continue
        for n in got:
            if n.name == "check":
                ok = np.array_equal(buf, want)
                say(f"bytes at the target {'match' if ok else 'DIFFER'}")
                # The initiator's own listen address is the message: answer through a link
                # of this engine towards it.
                e.connect(n.msg, timeout_ms=10_000)
                e.send_notify(n.msg, hixl.NotifyDesc("checked", "ok" if ok else "bad"))
                if not ok:
                    return 1
            elif n.name == "die":
                # The initiator starts its WRITEs once this notification is here (a notify
                # waits for the transfers before it): give them time to be in flight.
                time.sleep(float(n.msg or 0))
                say("powering off mid-transfer")
                with open(os.path.join(os.environ["HIXL_VM_OUT"], "rc"), "w") as f:
                    f.write("0\n")
                os.sync()
                with open("/proc/sysrq-trigger", "w") as f:
                    f.write("o")
                time.sleep(60)
    say("no 'die' came")
    return 1


def initiator() -> int:
    e = hixl.Hixl()
    e.initialize("192.0.2.1:18601", OPTS)  # listening: the target answers through it
    src, order, _ = pattern()
    back = np.zeros_like(src)
    e.register(src)
    e.register(back)
    until = time.monotonic() + 120
    while True:
        try:
            e.connect(TARGET, timeout_ms=5000)
            break
        except hixl.HixlError as err:
            if time.monotonic() > until:
                raise
            say(f"target not up yet ({err.status.name}); again")
            time.sleep(1)
    st = e.stats()[TARGET]
    assert st["backend"] == "rdma", st
    # The target listens before it registers: wait for its region to be in its table.
    while not any(r.name == "kv" for r in e.remote_regions(TARGET, refresh=True)):
        if time.monotonic() > until:
            say("the target's region never appeared")
            return 1
        time.sleep(0.5)
    raddr = e.remote_region(TARGET, "kv").addr
    rows = [(src.ctypes.data + i * PAGE, raddr + int(o) * PAGE, PAGE) for i, o in enumerate(order)]
    rows.append((src.ctypes.data + PAGES * PAGE, raddr + PAGES * PAGE, BIG))
    t0 = time.monotonic()
    e.transfer_sync(TARGET, W, rows, 120_000)
    moved = PAGES * PAGE + BIG
    say(f"wrote {moved >> 20} MiB in {time.monotonic() - t0:.2f} s over rdma")
    brows = [(back.ctypes.data + (r[0] - src.ctypes.data), r[1], r[2]) for r in rows]
    e.transfer_sync(TARGET, R, brows, 120_000)
    if not np.array_equal(back, src):
        say("READ brought back other bytes")
        return 1
    say("read back and compared: equal")
    e.send_notify(TARGET, hixl.NotifyDesc("check", e.local_engine), 30_000)
    got = e.wait_notifies(60_000, name="checked")
    if not got or got[0].msg != "ok":
        say(f"the target's check: {got}")
        return 1
    say("the target's own bytes match")
    # The target's host dies mid-transfer.
    timeout_ms = 30_000
    big = [(src.ctypes.data, raddr + (k % 8) * BIG, BIG) for k in range(32)]
    e.send_notify(TARGET, hixl.NotifyDesc("die", "3"), 10_000)  # in 3 s
    reqs = [e.transfer_async(TARGET, W, [b], timeout_ms=timeout_ms) for b in big]
    time.sleep(3)
    died = time.monotonic()
    ends = [r.wait(timeout_ms + 10_000) for r in reqs]
    took = time.monotonic() - died
    names = sorted({s.name for s in ends})
    say(f"after the target's VM powered off: {names} within {took:.1f} s")
    if any(s == hixl.TransferStatus.WAITING for s in ends) or took > timeout_ms / 1000 + 5:
        say("a request outlived its timeout")
        return 1
    if all(s == hixl.TransferStatus.COMPLETED for s in ends):
        say("every request finished before the target died: nothing was shown")
        return 1
    # They end when the link does (its heartbeats missed), well before their own deadline.
    errors = []
    for r, s in zip(reqs, ends, strict=True):
        if s != hixl.TransferStatus.COMPLETED:
            try:
                r.result()
            except hixl.HixlError as err:
                errors.append(err)
    say(f"{len(errors)} of {len(reqs)} failed, the first: {errors[0]}")
    if took > timeout_ms / 2000 or not all(isinstance(x, hixl.NotConnected) for x in errors):
        say("the link's death did not end them (NOT_CONNECTED, before half their deadline)")
        return 1
    e.finalize()
    say("all held")
    return 0


if __name__ == "__main__":
    sys.exit({"target": target, "initiator": initiator}[sys.argv[1]]())
