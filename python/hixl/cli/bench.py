"""Measure how fast hixl moves your kind of data between two engines on this machine or two.

By default this command starts the target process itself on localhost and sweeps block sizes
(4K..64M) for WRITE and READ. Across two hosts run ``--role target --listen IP:PORT`` on one and
``--role initiator --remote IP:PORT`` on the other.

Per row: bandwidth in decimal GB/s (all bytes / wall time of the timed requests), per-request
latency avg/p50/p99 (post to completion seen by the waiting thread), post time (the
transfer_async call itself) and CPU seconds per GB moved on each side (the target reports its
CPU time through a registered stats cell that the initiator reads one-sidedly).

--baseline measures each row three times, each beside its own transport's raw path in native
code, measured in turns in the same run with the same sizes: raw process_vm_writev/readv of
the same descriptors for same-host rows, raw TCP send/recv over as many connections as hixl
uses for tcp rows (memcpy for self). A second table gives hixl's ratio to it and the spread of
the three ratios; a verdict line per op and transport says where hixl is at or above, close
to or below its baseline, and gives no verdict where the repetitions disagree by over 10 %.

examples:
  hixl bench --quick
  hixl bench --op write --transport shm,tcp --block-sizes 4K-64M --baseline --json out.json
  hixl bench --batch-sizes 1,64 --scatter --check
  hixl bench --role target --listen 10.0.0.1:18500 --target-mem 1G
  hixl bench --role initiator --remote 10.0.0.1:18500 --transport tcp
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from .. import Hixl, HixlError, StridedDesc, TransferOp, TransferStatus, aligned_empty
from .._hixl import _raw_cma, _raw_memcpy, _raw_tcp_send, cuda_alloc, cuda_info
from . import _report
from ._bench_plan import OPS, Plan, add_arguments, make_plan, options_of, plan_meta
from ._machine import cpu_times, describe, host_hash, load_during
from ._report import BASELINE_OF, spread
from ._sizes import human
from ._target import CELL_BYTES, Cell, serve

NAME = "bench"
#: Repetitions of each row with --baseline (hixl and its baseline, measured in turns).
BASELINE_REPS = 3

HELP = "measure bandwidth, latency and CPU cost (sweeps, checks, baselines, JSON/CSV/plot)"
CORRUPT_ENV = "HIXL_BENCH_CORRUPT"
__all__ = ["HELP", "NAME", "add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    p: argparse.ArgumentParser = args.parser
    _check_mem(args, p)
    if args.role == "target":
        if args.remote:
            p.error("--remote is for --role initiator")
        return serve(
            args.listen or "127.0.0.1:0",
            args.target_mem or (256 << 20),
            options_of(args, p),
            args.until_stdin_closes,
            mem=args.mem[1],
        )
    if args.role == "initiator" and not args.remote:
        p.error("--role initiator needs --remote IP:PORT")
    if args.role == "local" and (args.remote or args.listen):
        p.error("--remote/--listen need --role initiator/target")
    if args.json == "-" and args.csv == "-":
        p.error("--json and --csv cannot both go to stdout")
    plan = make_plan(args, p)
    if args.plot:
        _report.require_matplotlib(p)
    _check_options(plan, p)
    target = None
    remote = args.remote
    if args.role == "local":
        target, remote = _start_target(plan, args.mem[1])
    before = cpu_times()
    try:
        rows = Sweep(plan, remote, args.mem[0]).run()
    finally:
        if target is not None:
            _stop_target(target)
    meta = {
        "machine": describe(),
        "argv": sys.argv[1:],
        "plan": plan_meta(plan),
        "load": load_during(before),
    }
    _report.emit(rows, meta, json_path=args.json, csv_path=args.csv, plot_path=args.plot)
    failed = [r for r in rows if r.get("check") not in (None, "ok")]
    for r in failed:
        print(f"hixl bench: check FAILED: {r['check']}", file=sys.stderr)
    return 1 if failed else 0


def _check_mem(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """--mem cuda:N needs CUDA on the side that has it (this process, for the sides it runs):
    Unsupported, with the reason, before anything starts."""
    here = {"target": [args.mem[1]], "initiator": [args.mem[0]]}.get(args.role, list(args.mem))
    if any(m != "host" for m in here):
        info = cuda_info()
        if not info["available"]:
            p.error(f"--mem {','.join(args.mem)}: Unsupported: CUDA not found: {info['reason']}")
        if args.check:
            p.error("--check compares bytes on the host: use it with --mem host")


def _check_options(plan: Plan, p: argparse.ArgumentParser) -> None:
    """Refuses bad --option values here, once, before any target process starts."""
    probe = Hixl()
    try:
        probe.initialize("127.0.0.1", dict(plan.options))
    except HixlError as exc:
        p.error(f"--option: {exc}")
    finally:
        probe.finalize()


def _start_target(plan: Plan, mem: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "hixl.cli",
        "bench",
        "--role",
        "target",
        "--listen",
        "127.0.0.1:0",
        "--target-mem",
        str(plan.remote_bytes),
        "--until-stdin-closes",
        "--mem",
        mem,
    ]
    for k, v in plan.options.items():
        cmd += ["--option", f"{k}={v}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "READY":
        proc.kill()
        raise SystemExit(f"hixl bench: the target process did not start (said {line!r})")
    return proc, line[1]


def _stop_target(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


def _local_ip_towards(remote: str) -> str:
    """The local address this host uses to reach `remote` (no packet is sent)."""
    host, _, port = remote.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), int(port)))
        return str(s.getsockname()[0])


class Sweep:
    """One initiator process: an engine per transport, local slots, the rows."""

    def __init__(self, plan: Plan, remote: str, mem: str = "host") -> None:
        self.plan = plan
        self.remote = remote
        self.rng = np.random.default_rng(plan.seed)
        # One slot per (thread, in-flight request), then a scratch slot for checks, then a
        # small area to read the target's stats cell into.
        self.local = aligned_empty(
            plan.slot_bytes * (plan.slots + 1) + CELL_BYTES, np.uint8, alignment=2 << 20
        )
        self.local[:] = 3
        self.lbase = self.local.ctypes.data
        self.cbase = self.lbase  # the cell is read into host memory whatever --mem says
        # --mem cuda:N: the slots are device memory (the scratch and cell areas stay above).
        self.dev = None
        if mem != "host":
            self.dev = cuda_alloc(plan.slot_bytes * plan.slots, int(mem[5:]), fill=3)
            self.lbase = self.dev.addr
        self.scratch_off = plan.slot_bytes * plan.slots
        self.cell_off = self.scratch_off + plan.slot_bytes
        self.corrupt = os.environ.get(CORRUPT_ENV, "") not in ("", "0")

    # -- descriptors ---------------------------------------------------------------------

    def descs(self, block: int, batch: int, slot: int, local_off: int, perm: np.ndarray) -> Any:
        """The request of `slot` at this shape, with local bytes at `local_off`."""
        lb = self.lbase + local_off
        rb = self.rbase + slot * self.plan.remote_slot_bytes
        if self.plan.strided:
            return (lb, rb, StridedDesc(batch, block, block, 2 * block))
        i = np.arange(batch, dtype=np.uint64)
        b = np.uint64(block)
        return np.stack([lb + i * b, rb + perm * b, np.full(batch, b)], axis=1).astype(np.uint64)

    def submit(self, e: Hixl, op: TransferOp, d: Any) -> Any:
        if self.plan.strided:
            lb, rb, sd = d
            f = e.put_strided_async if op == TransferOp.WRITE else e.get_strided_async
            return f(self.remote, lb, rb, sd, timeout_ms=self.plan.timeout_ms)
        return e.transfer_async(self.remote, op, d, timeout_ms=self.plan.timeout_ms)

    def finish(self, req: Any) -> None:
        if req.wait(self.plan.timeout_ms + 1000) != TransferStatus.COMPLETED:
            req.result()  # raises the request's own error
            raise HixlError(f"request {req.id} did not complete within its timeout")

    def cell(self, e: Hixl) -> Cell:
        e.get(self.remote, self.cbase + self.cell_off, self.cell_addr, 64, self.plan.timeout_ms)
        return Cell.decode(self.local[self.cell_off : self.cell_off + 64].view(np.uint64))

    # -- the sweep -----------------------------------------------------------------------

    def connect(self, transport: str) -> tuple[Hixl, str]:
        e = Hixl()
        local_ip = _local_ip_towards(self.remote)
        e.initialize(local_ip, {**self.plan.options, "hixl.backends": transport})
        e.register(self.local)
        if self.dev is not None:
            e.register(self.dev)
        e.connect(self.remote, timeout_ms=self.plan.timeout_ms)
        mems = e.remote_mems(self.remote)
        cells = [m for m in mems if m.len == CELL_BYTES]
        datas = [m for m in mems if m.len != CELL_BYTES]
        if not cells or not datas:
            raise SystemExit(f"hixl bench: {self.remote} is not a hixl bench target")
        self.cell_addr = cells[0].addr
        data = max(datas, key=lambda m: m.len)
        if data.len < self.plan.remote_bytes:
            raise SystemExit(
                f"hixl bench: the target registered {human(data.len)}, this sweep needs "
                f"{human(self.plan.remote_bytes)} (start it with --target-mem "
                f"{self.plan.remote_bytes})"
            )
        self.rbase = data.addr
        return e, str(e.stats()[self.remote]["backend"])

    def run(self) -> list[dict[str, Any]]:
        plan = self.plan
        rows: list[dict[str, Any]] = []
        todo = len(plan.transports) * len(plan.ops) * len(plan.shapes)
        bar = _report.progress(todo)
        seen: set[str] = set()
        try:
            for transport in plan.transports:
                e, backend = self.connect(transport)
                try:
                    if backend in seen:  # auto chose what another listed transport measures
                        bar.update(len(plan.ops) * len(plan.shapes))
                        continue
                    seen.add(backend)
                    target = self.cell(e)
                    for op in plan.ops:
                        for block, batch in plan.shapes:
                            rows.append(self.row(e, backend, target, op, block, batch))
                            bar.update(1)
                finally:
                    e.finalize()
        finally:
            bar.close()
        return rows

    def row(
        self, e: Hixl, backend: str, target: Cell, op_name: str, block: int, batch: int
    ) -> dict[str, Any]:
        plan, op = self.plan, OPS[op_name]
        req_bytes = block * batch
        perm = (self.rng.permutation(batch) if plan.scatter else np.arange(batch)).astype(np.uint64)
        slot_descs = [
            self.descs(block, batch, k, k * plan.slot_bytes, perm) for k in range(plan.slots)
        ]
        n = plan.iters_for(req_bytes)
        warm = plan.warmup if plan.warmup is not None else max(4, plan.slots)
        if plan.check:
            self.prepare_check(e, op, block, batch, perm, req_bytes)
        self.drive(e, op, slot_descs, warm, record=None)
        lat: list[float] = []
        post: list[float] = []
        cell0, cpu0, t0 = self.cell(e), time.process_time(), time.perf_counter()
        self.drive(e, op, slot_descs, n, record=(lat, post))
        wall, cpu1 = time.perf_counter() - t0, time.process_time()
        cell1 = self.cell(e)
        gb = req_bytes * n / 1e9
        lat_us = sorted(x * 1e6 for x in lat)
        row: dict[str, Any] = {
            "op": op_name,
            "strided": plan.strided,
            "transport": backend,
            "block": block,
            "batch": batch,
            "request_bytes": req_bytes,
            "requests": n,
            "seconds": wall,
            "gbps": gb / wall,
            "lat_avg_us": statistics.fmean(lat_us),
            "lat_p50_us": lat_us[len(lat_us) // 2],
            "lat_p99_us": lat_us[min(len(lat_us) - 1, int(len(lat_us) * 0.99))],
            "post_us": statistics.fmean(post) * 1e6,
            "cpu_initiator_s_per_gb": (cpu1 - cpu0) / gb,
            "cpu_target_s_per_gb": (cell1.cpu_s - cell0.cpu_s) / gb,
            "check": self.verify(e, op, block, batch, perm, req_bytes) if plan.check else None,
        }
        if plan.baseline:
            # Repetitions of hixl's rate, each beside a fresh measurement of the baseline, so
            # that a verdict can say whether their ratio holds.
            rates = [row["gbps"]]
            for _ in range(BASELINE_REPS - 1):
                t1 = time.perf_counter()
                self.drive(e, op, slot_descs, n, record=None)
                rates.append(gb / (time.perf_counter() - t1))
            row.update(self.baselines(target, backend, op, slot_descs[0], block, batch, rates))
        return row

    def drive(
        self,
        e: Hixl,
        op: TransferOp,
        slot_descs: list[Any],
        n: int,
        record: tuple[list[float], list[float]] | None,
    ) -> None:
        """Runs `n` requests over the threads, each keeping `depth` in flight."""
        plan = self.plan
        errors: list[BaseException] = []

        def worker(t: int, count: int) -> None:
            mine = slot_descs[t * plan.depth : (t + 1) * plan.depth]
            inflight: deque[tuple[Any, float]] = deque()
            issued = 0
            try:
                while issued < count or inflight:
                    while issued < count and len(inflight) < plan.depth:
                        t0 = time.perf_counter()
                        req = self.submit(e, op, mine[issued % plan.depth])
                        if record is not None:
                            record[1].append(time.perf_counter() - t0)
                        inflight.append((req, t0))
                        issued += 1
                    req, t0 = inflight.popleft()
                    self.finish(req)
                    if record is not None:
                        record[0].append(time.perf_counter() - t0)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                errors.append(exc)
                for req, _ in inflight:
                    req.wait(plan.timeout_ms + 1000)

        shares = [
            n // plan.threads + (1 if t < n % plan.threads else 0) for t in range(plan.threads)
        ]
        if plan.threads == 1:
            worker(0, shares[0])
        else:
            ths = [threading.Thread(target=worker, args=(t, c)) for t, c in enumerate(shares)]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
        if errors:
            raise errors[0]

    # -- --check -------------------------------------------------------------------------

    def _slot_view(self, k: int, req_bytes: int) -> np.ndarray:
        off = k * self.plan.slot_bytes
        return self.local[off : off + req_bytes]

    def prepare_check(
        self, e: Hixl, op: TransferOp, block: int, batch: int, perm: np.ndarray, req_bytes: int
    ) -> None:
        """WRITE rows: fresh random source in every slot. READ rows: fresh random bytes put
        into each slot's remote range (through a WRITE from scratch), local slots zeroed."""
        scratch = self.local[self.scratch_off : self.scratch_off + req_bytes]
        for k in range(self.plan.slots):
            if op == TransferOp.WRITE:
                self._slot_view(k, req_bytes)[:] = self.rng.integers(0, 256, req_bytes, np.uint8)
            else:
                scratch[:] = self.rng.integers(0, 256, req_bytes, np.uint8)
                self.finish(
                    self.submit(
                        e, TransferOp.WRITE, self.descs(block, batch, k, self.scratch_off, perm)
                    )
                )
                self._slot_view(k, req_bytes)[:] = scratch  # the expectation, kept locally
        self.expected = [self._slot_view(k, req_bytes).copy() for k in range(self.plan.slots)]
        if op == TransferOp.READ:
            for k in range(self.plan.slots):
                self._slot_view(k, req_bytes)[:] = 0

    def verify(
        self, e: Hixl, op: TransferOp, block: int, batch: int, perm: np.ndarray, req_bytes: int
    ) -> str:
        """'ok', or where the first wrong byte is. WRITE rows read each slot's remote range
        back into scratch; READ rows compare the local slots themselves."""
        scratch = self.local[self.scratch_off : self.scratch_off + req_bytes]
        for k in range(self.plan.slots):
            if op == TransferOp.WRITE:
                scratch[:] = 0
                self.finish(
                    self.submit(
                        e, TransferOp.READ, self.descs(block, batch, k, self.scratch_off, perm)
                    )
                )
                got = scratch
            else:
                got = self._slot_view(k, req_bytes)
            if self.corrupt:  # test hook: proves the checker catches a wrong byte
                got[req_bytes // 2] ^= 0xFF
            bad = np.flatnonzero(got != self.expected[k])
            if bad.size:
                i = int(bad[0])
                name = "write" if op == TransferOp.WRITE else "read"
                return (
                    f"{name} block={human(block)} batch={batch} slot {k}: byte {i} is "
                    f"0x{int(got[i]):02x}, expected 0x{int(self.expected[k][i]):02x} "
                    f"({bad.size} bytes differ)"
                )
        return "ok"

    # -- --baseline ----------------------------------------------------------------------

    def baselines(
        self,
        target: Cell,
        backend: str,
        op: TransferOp,
        d: Any,
        block: int,
        batch: int,
        rates: list[float],
    ) -> dict[str, Any]:
        """The row's own baseline (memcpy for self, raw cross-memory attach for same-host
        backends, a raw socket for tcp), measured once per repetition of hixl's `rates`."""
        req = block * batch
        iters = max(3, min(1000, (256 << 20) // req))
        base = BASELINE_OF.get(backend)
        if base == "cma" and target.host_hash != host_hash():
            base = None
        if base is None:
            return {"baseline": None}

        def rate(times: list[float]) -> float:
            return req / statistics.median(times) / 1e9

        def once() -> float:
            if base == "memcpy":
                return rate(_raw_memcpy(block, batch, iters))
            if base == "cma":
                return rate(_raw_cma(target.pid, op == TransferOp.WRITE, cma_descs, iters))
            return rate(_raw_tcp_send(f"{host}:{target.sink_port}", req, iters, streams))

        cma_descs = d
        if base == "cma" and self.plan.strided:
            lb, rb, _ = d
            i = np.arange(batch, dtype=np.uint64)
            cma_descs = np.stack(
                [
                    lb + i * np.uint64(block),
                    rb + i * np.uint64(2 * block),
                    np.full(batch, block, np.uint64),
                ],
                axis=1,
            ).astype(np.uint64)
        host = self.remote.rpartition(":")[0]
        # Like hixl, use every stream only for requests it splits (hixl.split_bytes).
        streams = int(self.plan.options.get("hixl.tcp.streams", "2"))
        if req < int(self.plan.options.get("hixl.split_bytes", str(1 << 20))):
            streams = 1
        try:
            raws = [once() for _ in rates]
        except HixlError as exc:
            return {"baseline": base, "baseline_note": str(exc)}
        ratios = [h / r for h, r in zip(rates, raws, strict=True)]
        return {
            "baseline": base,
            "raw_gbps": statistics.median(raws),
            "x_raw": statistics.median(ratios),
            "x_raw_reps": ratios,
            "x_raw_spread": f"{spread(ratios):.0%}",
        }
