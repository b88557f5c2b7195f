"""The plan of a `hixl bench` run: its command-line options and what they decide (ops,
transports, shapes, slots, iterations) before the first byte moves."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from .. import TransferOp, backends
from ._sizes import human, parse_count_list, parse_size, parse_size_list

QUICK_BLOCKS = "4K,64K,1M,16M"
OPS = {"write": TransferOp.WRITE, "read": TransferOp.READ}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("roles")
    g.add_argument(
        "--role",
        choices=["local", "target", "initiator"],
        default="local",
        help="local (default): start a target here; target: serve; initiator: "
        "measure against --remote",
    )
    g.add_argument(
        "--listen",
        default=None,
        metavar="IP:PORT",
        help="target: address to listen on (default 127.0.0.1:0)",
    )
    g.add_argument("--remote", default=None, metavar="IP:PORT", help="initiator: the target")
    g.add_argument(
        "--target-mem",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="target: bytes to register (default 256M; local role: what the sweep needs)",
    )
    g.add_argument("--until-stdin-closes", action="store_true", help=argparse.SUPPRESS)
    g = p.add_argument_group("what to move")
    g.add_argument(
        "--op",
        default="write,read",
        type=_op_list,
        metavar="OPS",
        help="write, read or both as 'write,read' (default)",
    )
    g.add_argument(
        "--transport",
        default=None,
        type=_transport_list,
        metavar="LIST",
        help=f"{'|'.join(transports())}, comma-separated for one line each (default auto; "
        f"--quick: auto,{transports()[-1]})",
    )
    g.add_argument(
        "--mem",
        default="host",
        type=_mem_pair,
        metavar="MEM[,TARGET_MEM]",
        help="memory of the initiator's and the target's buffers: host (default), cuda or "
        "cuda:N; one value for both sides, or two (e.g. cuda:0,host). CUDA memory needs a GPU "
        "on that side and moves over cuda_ipc (same host)",
    )
    g.add_argument(
        "--block-sizes",
        type=parse_size_list,
        default=None,
        metavar="SIZES",
        help="bytes per descriptor: a range of powers of two '4K-64M' (default) or a list '4K,1M'",
    )
    g.add_argument(
        "--batch-sizes",
        type=parse_count_list,
        default=None,
        metavar="COUNTS",
        help="descriptors per request, e.g. '1,16,256' or '1-256' (default 1)",
    )
    g.add_argument(
        "--max-request",
        type=parse_size,
        default=parse_size("256M"),
        metavar="SIZE",
        help="skip rows whose block x batch exceeds this (default 256M)",
    )
    g.add_argument(
        "--scatter",
        action="store_true",
        help="remote blocks in a permuted order, so nothing can be merged",
    )
    g.add_argument(
        "--strided",
        action="store_true",
        help="each request is one strided descriptor (count=batch, size=block, "
        "remote stride 2 x block)",
    )
    g = p.add_argument_group("how")
    g.add_argument(
        "--streams", type=_positive, default=None, help="hixl.tcp.streams (TCP connections)"
    )
    g.add_argument(
        "--threads",
        type=_positive,
        default=1,
        help="initiator threads submitting requests (default 1)",
    )
    g.add_argument(
        "--pipeline-depth",
        type=_positive,
        default=1,
        help="requests in flight per thread (default 1)",
    )
    g.add_argument(
        "--iterations",
        type=_positive,
        default=None,
        help="timed requests per row (default: about 1 GiB, 16..20000 requests)",
    )
    g.add_argument(
        "--warmup",
        type=_non_negative,
        default=None,
        help="untimed requests per row (default: one per slot, at least 4)",
    )
    g.add_argument(
        "--timeout-ms",
        type=_positive,
        default=60_000,
        help="each request's deadline and the connect timeout (default 60000)",
    )
    g.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any engine option for both sides, e.g. hixl.shm.threads=4 (repeatable)",
    )
    g.add_argument(
        "--check",
        action="store_true",
        help="verify the bytes after each row (fresh random data per row)",
    )
    g.add_argument(
        "--baseline",
        action="store_true",
        help="also measure memcpy, raw process_vm_writev and raw sockets; print ratios",
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help=f"a representative subset in under 30 s ({QUICK_BLOCKS}, write+read, auto+tcp)",
    )
    g.add_argument("--seed", type=int, default=1, help="seed for data and permutations")
    g = p.add_argument_group("output")
    g.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write JSON (to stdout when no PATH: the table is then left out)",
    )
    g.add_argument(
        "--csv",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write CSV (to stdout when no PATH)",
    )
    g.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw bandwidth vs block size (needs matplotlib: pip install 'hixl[plot]')",
    )


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return v


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return v


def _op_list(text: str) -> list[str]:
    ops = [o.strip().lower() for o in text.split(",")]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r}: ops are read and write")
    return list(dict.fromkeys(ops))


def transports() -> list[str]:
    """The transports the CLI offers: auto, then the backends the engine's table marks `cli`,
    in the order of auto."""
    return ["auto", *(b["name"] for b in backends() if b["cli"])]


def _transport_list(text: str) -> list[str]:
    ts = [t.strip().lower() for t in text.split(",")]
    known = transports()
    bad = [t for t in ts if t not in known]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{bad[0]!r}: transports are {', '.join(known[:-1])} and {known[-1]}"
        )
    return list(dict.fromkeys(ts))


def parse_mem(text: str) -> str:
    """'host', or 'cuda:N' for 'cuda' / 'cuda:N' (N a device ordinal, 0..127)."""
    t = text.strip().lower()
    if t == "host":
        return t
    if t == "cuda":
        return "cuda:0"
    n = t.removeprefix("cuda:")
    if n != t and n.isdigit() and int(n) <= 127:
        return f"cuda:{int(n)}"
    raise argparse.ArgumentTypeError(f"{text!r}: memory is host, cuda or cuda:N (0 <= N <= 127)")


def _mem_pair(text: str) -> tuple[str, str]:
    parts = [parse_mem(x) for x in text.split(",")]
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at most two memories (initiator,target)")
    return (parts[0], parts[-1])


def options_of(args: argparse.Namespace, p: argparse.ArgumentParser) -> dict[str, str]:
    out: dict[str, str] = {}
    for kv in args.option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            p.error(f"argument --option: {kv!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    if args.streams:
        out["hixl.tcp.streams"] = str(args.streams)
    return out


@dataclass
class Plan:
    """Everything a sweep needs decided before the first byte moves."""

    ops: list[str]
    transports: list[str]
    blocks: list[int]
    batches: list[int]
    threads: int
    depth: int
    scatter: bool
    strided: bool
    check: bool
    baseline: bool
    iterations: int | None
    warmup: int | None
    timeout_ms: int
    quick: bool
    seed: int
    options: dict[str, str]
    shapes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def slots(self) -> int:
        return self.threads * self.depth

    @property
    def slot_bytes(self) -> int:
        """Local bytes of one in-flight request at the largest shape."""
        return max(b * n for b, n in self.shapes)

    @property
    def remote_slot_bytes(self) -> int:
        return self.slot_bytes * (2 if self.strided else 1)

    @property
    def remote_bytes(self) -> int:
        return self.slots * self.remote_slot_bytes

    def iters_for(self, req_bytes: int) -> int:
        if self.iterations:
            return self.iterations
        budget, lo, hi = ((128 << 20), 8, 2000) if self.quick else ((1 << 30), 16, 20000)
        n = -(-budget // req_bytes)
        return max(lo, self.slots, min(hi, n))


def make_plan(args: argparse.Namespace, p: argparse.ArgumentParser) -> Plan:
    blocks = args.block_sizes or parse_size_list(QUICK_BLOCKS if args.quick else "4K-64M")
    batches = args.batch_sizes or [1]
    if args.strided and any(b % 64 for b in blocks):
        p.error("--strided needs block sizes that are multiples of 64 bytes")
    shapes = [(b, n) for n in batches for b in blocks if b * n <= args.max_request]
    if not shapes:
        p.error(f"no block x batch fits --max-request {human(args.max_request)}")
    # --quick adds the table's last CLI backend (tcp: any host, the slowest) beside auto.
    chosen = args.transport or (["auto", transports()[-1]] if args.quick else ["auto"])
    return Plan(
        ops=args.op,
        transports=chosen,
        blocks=blocks,
        batches=batches,
        threads=args.threads,
        depth=args.pipeline_depth,
        scatter=args.scatter,
        strided=args.strided,
        check=args.check,
        baseline=args.baseline,
        iterations=args.iterations,
        warmup=args.warmup,
        timeout_ms=args.timeout_ms,
        quick=args.quick,
        seed=args.seed,
        options=options_of(args, p),
        shapes=shapes,
    )


def plan_meta(plan: Plan) -> dict[str, Any]:
    keys = (
        "ops",
        "transports",
        "blocks",
        "batches",
        "threads",
        "depth",
        "scatter",
        "strided",
        "check",
        "baseline",
        "quick",
        "options",
    )
    return {k: getattr(plan, k) for k in keys}
