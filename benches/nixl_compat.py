"""hixl.nixl (NIXL's Python API on hixl) vs hixl's native API, and vs the real NIXL.

    python benches/nixl_compat.py                      # hixl native vs hixl.nixl
    python benches/nixl_compat.py --nixl-python /path/to/venv-with-nixl/bin/python

Two processes on this host: a target agent holding the remote buffer and the measuring
initiator. Rows (medians of --iters runs):
  prep      prep_xfer_dlist of 8192 descriptors (local and remote), from an Nx3 array and
            from a list of tuples
  make      make_prepped_xfer with 8192 indices (numpy int32)
  read      8192 x 16 KiB scattered READ: native = one transfer_async + wait on the same
            engine; nixl = make_prepped_xfer + transfer + check_xfer_state polling + release
  write     the same, WRITE
With --nixl-python, the same rows run with the real NIXL (its UCX backend) in that
interpreter's environment, and its columns are added.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

BLK = 16 * 1024


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def api(impl: str) -> Any:
    if impl == "hixl":
        from hixl import nixl

        return nixl
    from nixl import _api  # the real NIXL

    return _api


def serve(impl: str, span: int) -> None:
    m = api(impl)
    agent = m.nixl_agent("target", m.nixl_agent_config(backends=["UCX"]))
    buf = np.ones(span, np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, span, 0, "")], "DRAM"))
    print(f"READY {buf.ctypes.data} {agent.get_agent_metadata().hex()}", flush=True)
    sys.stdin.read()


def median_us(fn: Callable[[], object], iters: int) -> float:
    fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def measure(impl: str, nblk: int, iters: int) -> dict[str, float]:
    m = api(impl)
    span = nblk * BLK
    target = subprocess.Popen(
        [sys.executable, __file__, "--serve", impl, str(span)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert target.stdout is not None
        line = ""
        while not line.startswith("READY "):  # NIXL logs to stdout too
            line = target.stdout.readline()
            if not line:
                raise SystemExit(f"the target exited with {target.wait()}")
        _, raddr_s, md_hex = line.split()
        raddr = int(raddr_s)
        agent = m.nixl_agent("initiator", m.nixl_agent_config(backends=["UCX"]))
        buf = np.zeros(span, np.uint8)
        agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, span, 0, "")], "DRAM"))
        name = agent.add_remote_agent(bytes.fromhex(md_hex))
        rng = np.random.default_rng(0)
        lblk, rblk = rng.permutation(nblk), rng.permutation(nblk)
        local = np.zeros((nblk, 3), np.uint64)
        local[:, 0] = buf.ctypes.data + lblk.astype(np.uint64) * BLK
        local[:, 1] = BLK
        remote = local.copy()
        remote[:, 0] = raddr + rblk.astype(np.uint64) * BLK
        local_tuples = [(int(a), BLK, 0) for a in local[:, 0]]
        idx = np.arange(nblk, dtype=np.int32)
        r: dict[str, float] = {}

        if hasattr(agent, "make_connection"):
            agent.make_connection(name)
        r["prep_array_us"] = median_us(
            lambda: agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"), iters
        )
        r["prep_tuples_us"] = median_us(
            lambda: agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_tuples, "DRAM"), iters
        )
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        rh = agent.prep_xfer_dlist(name, remote, "DRAM")
        r["prep_remote_us"] = median_us(lambda: agent.prep_xfer_dlist(name, remote, "DRAM"), iters)

        def make() -> None:
            agent.release_xfer_handle(agent.make_prepped_xfer("READ", lh, idx, rh, idx))

        r["make_us"] = median_us(make, iters)

        for op in ("READ", "WRITE"):
            r.update(transfers(m, agent, name, op, lh, rh, idx, local, remote, impl, iters))
        return r
    finally:
        if target.stdin:
            target.stdin.close()
        target.wait(30)


POLL_S = 2e-4  # how often a program checks a transfer's state (--poll-us)


def transfers(
    m: Any,
    agent: Any,
    name: Any,
    op: str,
    lh: Any,
    rh: Any,
    idx: Any,
    local: Any,
    remote: Any,
    impl: str,
    iters: int,
) -> dict[str, float]:
    """Median ms of one transfer of all descriptors, each way of waiting for it."""

    def nixl_poll() -> None:  # what a NIXL program does
        h = agent.make_prepped_xfer(op, lh, idx, rh, idx)
        state = agent.transfer(h)
        while state == "PROC":
            time.sleep(POLL_S)
            state = agent.check_xfer_state(h)
        assert state == "DONE", state
        agent.release_xfer_handle(h)

    fns: dict[str, Callable[[], None]] = {"nixl_poll": nixl_poll}
    if impl == "hixl":
        import hixl

        eng = agent.engine
        addr = agent._remote(name).engine
        descs = np.ascontiguousarray(np.stack([local[:, 0], remote[:, 0], local[:, 1]], 1))
        hop = hixl.TransferOp.READ if op == "READ" else hixl.TransferOp.WRITE

        def native_wait() -> None:  # hixl's own API, blocking wait
            eng.transfer_async(addr, hop, descs).wait()

        def native_poll() -> None:  # hixl's own API, polled like the NIXL program
            req = eng.transfer_async(addr, hop, descs)
            while req.status() == hixl.TransferStatus.WAITING:
                time.sleep(POLL_S)

        fns.update(native_wait=native_wait, native_poll=native_poll)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(iters):  # interleaved, so that drift hits every variant alike
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {f"{op.lower()}_{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="2048 blocks, 3 runs")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per row (default 15)")
    ap.add_argument("--nixl-python", help="an interpreter with the real NIXL installed")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument(
        "--poll-us", type=float, default=200.0, help="check_xfer_state interval (default 200)"
    )
    a = ap.parse_args()
    global POLL_S
    POLL_S = a.poll_us / 1e6
    if a.serve:
        serve(a.serve[0], int(a.serve[1]))
        return
    nblk = 2048 if a.quick else 8192
    iters = a.iters or (3 if a.quick else 15)
    if a.measure:
        print(json.dumps(measure(a.measure, nblk, iters)), flush=True)
        return
    res = {"hixl": measure("hixl", nblk, iters)}
    if a.nixl_python:
        cmd = [a.nixl_python, __file__, "--measure", "nixl", "--iters", str(iters)]
        cmd += ["--poll-us", str(a.poll_us)]
        out = subprocess.run(
            cmd + (["--quick"] if a.quick else []), capture_output=True, text=True, timeout=900
        )
        if out.returncode != 0:
            log(out.stderr[-2000:])
            raise SystemExit("the real NIXL run failed")
        res["nixl"] = json.loads(out.stdout.strip().splitlines()[-1])
    h, n = res["hixl"], res.get("nixl", {})

    def col(d: dict[str, float], k: str) -> str:
        return f"{d[k]:.2f}" if k in d else "-"

    print(
        f"{nblk} x 16 KiB, scattered, same host; medians of {iters}; polls every {a.poll_us:g} us"
    )
    print("| row | hixl.nixl | real NIXL 1.5.1 (UCX) |")
    print("|---|---|---|")
    for row, k in (
        (f"prep_xfer_dlist local, {nblk} x 3 array (us)", "prep_array_us"),
        (f"prep_xfer_dlist local, list of {nblk} tuples (us)", "prep_tuples_us"),
        (f"prep_xfer_dlist remote, {nblk} x 3 array (us)", "prep_remote_us"),
        (f"make_prepped_xfer, {nblk} indices (us)", "make_us"),
    ):
        print(f"| {row} | {col(h, k)} | {col(n, k)} |")
    for op in ("read", "write"):
        print(
            f"| {op.upper()} make+transfer+poll+release (ms) | {col(h, f'{op}_nixl_poll_ms')} "
            f"| {col(n, f'{op}_nixl_poll_ms')} |"
        )
    print()
    print(
        "| op | native, wait (ms) | native, polled (ms) | hixl.nixl, polled (ms) "
        "| hixl.nixl / native polled | hixl.nixl / native wait |"
    )
    print("|---|---|---|---|---|---|")
    for op in ("read", "write"):
        w, p, c = (h[f"{op}_{k}_ms"] for k in ("native_wait", "native_poll", "nixl_poll"))
        print(f"| {op.upper()} | {w:.2f} | {p:.2f} | {c:.2f} | {c / p:.3f} | {c / w:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
