"""A Mooncake program in SGLang's disaggregation pattern, written only against Mooncake's API.

``python _mc_sglang.py decode``: registers paged K and V pools per layer and an aux buffer,
prints one JSON line (session and addresses), then on ``CHECK <json>`` compares the pages and
the aux buffer a prefill wrote with what they must hold and prints ``OK`` or ``BAD ...``.
``python _mc_sglang.py prefill <decode json>``: writes scattered pages with
``batch_transfer_sync_write``, then the aux buffer, exercises the async and read calls and an
out-of-bounds write, and prints one JSON line for the decode's check.

It imports ``mooncake.engine`` and nothing else outside the standard library, so it runs
against the real ``mooncake-transfer-engine`` package and, unchanged, against hixl's shim
(tests/test_mooncake.py runs it both ways).
"""

from __future__ import annotations

import ctypes
import json
import random
import struct
import sys
import time

from mooncake.engine import TransferEngine, TransferOpcode

LAYERS = 2
PAGES = 48
PAGE = 16 * 1024
AUX = 4096
MOVED = 24  # pages per layer and pool a prefill sends
PROTOCOL = "tcp"


def pattern(layer: int, kv: int, page: int, n: int = PAGE) -> bytes:
    """What page ``page`` of pool ``kv`` (0 K, 1 V) of ``layer`` holds on the prefill side."""
    head = struct.pack("<IIII", 0xC0FFEE, layer, kv, page)
    return (head * (n // len(head) + 1))[:n]


def aux_pattern() -> bytes:
    """What the prefill's aux buffer holds."""
    return bytes((i * 7 + 3) % 251 for i in range(AUX))


def buffer(n: int) -> tuple[ctypes.Array[ctypes.c_char], int]:
    """``n`` zero bytes and their address."""
    buf = ctypes.create_string_buffer(n)
    return buf, ctypes.addressof(buf)


def start(host: str) -> TransferEngine:
    """An engine initialized the way SGLang initializes one (P2P handshake)."""
    te = TransferEngine()
    rc = te.initialize(host, "P2PHANDSHAKE", PROTOCOL, "")
    if rc != 0:
        sys.exit(f"initialize returned {rc}")
    return te


def pools(te: TransferEngine) -> tuple[list[object], list[int], list[int], object, int]:
    """Registers LAYERS K and V pools (as SGLang does, one region each) and an aux buffer."""
    keep: list[object] = []
    k, v = [], []
    for _ in range(LAYERS):
        for lst in (k, v):
            buf, addr = buffer(PAGES * PAGE)
            keep.append(buf)
            lst.append(addr)
    rc = te.batch_register_memory(k + v, [PAGES * PAGE] * (2 * LAYERS))
    aux, aux_addr = buffer(AUX)
    rc2 = te.register_memory(aux_addr, AUX)
    if rc or rc2:
        sys.exit(f"registration returned {rc}, {rc2}")
    return keep, k, v, aux, aux_addr


def decode(host: str) -> None:
    te = start(host)
    _keep, k, v, _aux, aux_addr = pools(te)
    session = f"{host}:{te.get_rpc_port()}"
    print(json.dumps({"session": session, "k": k, "v": v, "aux": aux_addr}), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "QUIT":
            return
        if cmd != "CHECK":
            continue
        want = json.loads(arg)
        bad = []
        for layer in range(LAYERS):
            for kv, base in enumerate((k[layer], v[layer])):
                for src, dst in zip(want["src"], want["dst"], strict=True):
                    got = ctypes.string_at(base + dst * PAGE, PAGE)
                    if got != pattern(layer, kv, src):
                        bad.append((layer, kv, dst))
        for src, dst in zip(want["async_src"], want["async_dst"], strict=True):
            if ctypes.string_at(k[0] + dst * PAGE, PAGE) != pattern(0, 0, src):
                bad.append(("async", dst))
        if ctypes.string_at(aux_addr, AUX) != aux_pattern():
            bad.append("aux")
        print("OK" if not bad else f"BAD {bad[:8]}", flush=True)


def prefill(host: str, peer: dict) -> None:
    te = start(host)
    _keep, k, v, aux, aux_addr = pools(te)
    for layer in range(LAYERS):
        for kv, base in enumerate((k[layer], v[layer])):
            for page in range(PAGES):
                ctypes.memmove(base + page * PAGE, pattern(layer, kv, page), PAGE)
    ctypes.memmove(aux_addr, aux_pattern(), AUX)
    session = peer["session"]
    rng = random.Random(38)
    src = rng.sample(range(PAGES), MOVED)
    dst = rng.sample(range(PAGES), MOVED)
    result: dict[str, object] = {"src": src, "dst": dst}

    # SGLang: one batch of scattered pages for every layer's K and V, then the aux buffer.
    bufs, peers, lens = [], [], []
    for layer in range(LAYERS):
        for mine, theirs in ((k[layer], peer["k"][layer]), (v[layer], peer["v"][layer])):
            for s, d in zip(src, dst, strict=True):
                bufs.append(mine + s * PAGE)
                peers.append(theirs + d * PAGE)
                lens.append(PAGE)
    result["batch"] = te.batch_transfer_sync_write(session, bufs, peers, lens)
    result["aux"] = te.transfer_sync_write(session, aux_addr, peer["aux"], AUX)

    # Reads: pull two written pages back into a scratch page and compare.
    scratch, scratch_addr = buffer(2 * PAGE)
    te.register_memory(scratch_addr, 2 * PAGE)
    rc = te.batch_transfer_sync_read(
        session,
        [scratch_addr, scratch_addr + PAGE],
        [peer["k"][0] + dst[0] * PAGE, peer["v"][1] + dst[1] * PAGE],
        [PAGE, PAGE],
    )
    same = ctypes.string_at(scratch_addr, PAGE) == pattern(0, 0, src[0]) and ctypes.string_at(
        scratch_addr + PAGE, PAGE
    ) == pattern(1, 1, src[1])
    result["read"] = [rc, same]
    result["read_one"] = te.transfer_sync_read(session, scratch_addr, peer["aux"], 16)
    result["read_one_same"] = ctypes.string_at(scratch_addr, 16) == aux_pattern()[:16]

    # Async: pages to places the sync batch did not touch, then a status wait.
    free = [p for p in range(PAGES) if p not in dst]
    a_src, a_dst = src[:4], free[:4]
    bid = te.batch_transfer_async_write(
        session,
        [k[0] + s * PAGE for s in a_src],
        [peer["k"][0] + d * PAGE for d in a_dst],
        [PAGE] * len(a_src),
    )
    result["async_id_positive"] = bid > 0
    result["async"] = te.get_batch_transfer_status([bid])
    result["async_src"], result["async_dst"] = a_src, a_dst
    bid2 = te.batch_transfer_async(
        session, [scratch_addr], [peer["k"][0] + a_dst[0] * PAGE], [PAGE], TransferOpcode.Read
    )
    result["async_read"] = te.get_batch_transfer_status([bid2])
    result["async_read_same"] = ctypes.string_at(scratch_addr, PAGE) == pattern(0, 0, a_src[0])
    sid = te.transfer_submit_write(
        session, k[0] + a_src[0] * PAGE, peer["k"][0] + a_dst[0] * PAGE, PAGE
    )
    deadline = time.monotonic() + 10
    state = 0
    while state == 0 and time.monotonic() < deadline:
        state = te.transfer_check_status(sid)
    result["submit"] = state

    # Out of bounds: past the end of the peer's aux buffer. A negative code, and the session
    # stays usable.
    result["oob"] = te.transfer_sync_write(session, aux_addr, peer["aux"] + AUX - 10, AUX)
    result["oob_async"] = te.get_batch_transfer_status(
        [te.batch_transfer_async_write(session, [aux_addr], [peer["aux"] + AUX - 1], [AUX])]
    )
    result["after_oob"] = te.transfer_sync_write(session, aux_addr, peer["aux"], AUX)
    result["probe"] = te.send_probe(session)
    result["opcode"] = [int(TransferOpcode.Read), int(TransferOpcode.Write)]
    print(json.dumps(result), flush=True)
    del aux, scratch


if __name__ == "__main__":
    role, host = sys.argv[1], sys.argv[2]
    if role == "decode":
        decode(host)
    else:
        prefill(host, json.loads(sys.argv[3]))
