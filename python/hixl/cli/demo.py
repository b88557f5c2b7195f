"""Prefill/decode disaggregation with a layerwise KV-cache transfer, proven end to end.

Starts two processes running the same tiny numpy transformer (seeded weights). The prefill
process (rank 0, role "prompt") computes the prompt's KV cache layer by layer and pushes each
layer the moment it is computed (hixl.kv.transfer_cache_async, mode "push"). The decode process
(rank 1, role "decoder") follows the arrivals (hixl.kv.receive_cache_async) and runs its first
step's layer k as soon as KV layer k is there, then generates the new tokens.

Prints a per-layer timeline (ms since prefill started: computed and submitted at prefill, acked
when prefill saw its write complete, arrived when decode saw the layer, used by decode), the
bytes and bandwidth, and compares the generated tokens with a single-process run of the same
model: identical -> exit 0; different -> exit 1 naming the first mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Self

from ._bench_plan import transports
from ._sizes import human

NAME = "demo"
CORRUPT_ENV = "HIXL_DEMO_CORRUPT"
HELP = "PD-disaggregation demo: layerwise KV-cache transfer between two processes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        choices=transports(),
        default="auto",
        help="hixl.backends of the push (default auto)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the KV cache lives (default cpu; cuda: torch CUDA tensors on cuda:0, moved "
        "GPU to GPU; the model itself computes in numpy)",
    )
    p.add_argument("--layers", type=_int_in(1, 64), default=6, help="model layers (default 6)")
    p.add_argument("--heads", type=_int_in(1, 64), default=8, help="attention heads (default 8)")
    p.add_argument(
        "--head-dim",
        type=_int_in(8, 512),
        default=64,
        help="head dim (default 64; 96 exercises padded head rows)",
    )
    p.add_argument(
        "--prompt-len", type=_int_in(2, 8192), default=256, help="prompt tokens (default 256)"
    )
    p.add_argument(
        "--tokens", type=_int_in(1, 1024), default=16, help="tokens to generate (default 16)"
    )
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default 0)")
    p.add_argument(
        "--timeout-ms",
        type=_int_in(100, 600_000),
        default=30_000,
        help="longest wait for any layer or process (default 30000)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--worker", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)


def _int_in(lo: int, hi: int) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = lo - 1
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer in {lo}..{hi}")
        return v

    return parse


def _model(a: argparse.Namespace) -> Any:
    from ._tinylm import TinyLM

    return TinyLM(a.layers, a.heads, a.head_dim, a.seed)


def _worker(a: argparse.Namespace) -> int:
    # Spawned with SIGINT held back (`_Workers.start`); a worker is killed by its parent, but
    # one run by hand should still stop on Ctrl-C.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import hixl

    model = _model(a)
    prompt = model.prompt(a.prompt_len, a.seed)
    opts = {"hixl.backends": a.transport}
    cfg = hixl.kv.CacheTransferConfig(max_concurrent=4, timeout_ms=a.timeout_ms)
    lay = model.layout(a.prompt_len - 1)
    cache_arr = lay.array()
    # --device cuda: the registered cache is a torch CUDA tensor; the numpy model works on
    # cache_arr, and each layer crosses between the two at the layer's boundary.
    dev = _device_cache(cache_arr) if a.device == "cuda" else None
    kv: Any = cache_arr if dev is None else dev
    mem = "host" if dev is None else "device"
    out: dict[str, Any] = {}
    if a.worker == "decode":
        me = hixl.kv.init(cluster_id=1, role="decoder", listen="127.0.0.1:0", options=opts)
        cache = hixl.kv.allocate_cache(kv, mem_type=mem, name="kv", layout=lay)
        syncer = hixl.kv.LayerTracker(model.L)
        task = hixl.kv.receive_cache_async(0, cache, syncer, cfg)
        print(f"READY {me.address}", flush=True)
        used: dict[int, float] = {}

        corrupt = os.environ.get(CORRUPT_ENV, "") not in ("", "0")

        def layer_wait(k: int) -> None:
            syncer.wait_layer(k, timeout_ms=a.timeout_ms)
            if dev is not None:
                cache_arr[k] = dev[k].cpu().numpy()
            used[k] = time.monotonic()
            if corrupt and k == 0:  # test hook: proves a wrong KV layer is caught
                cache_arr[0] = 0

        out["tokens"] = model.decode(prompt, cache_arr, a.tokens, layer_wait)
        res = task.wait(a.timeout_ms)
        out.update(
            arrived=syncer.times["arrived"], used=used, bytes=res.bytes, decode_end=time.monotonic()
        )
    else:
        hixl.kv.init(
            cluster_id=0, role="prompt", listen="127.0.0.1:0", options=opts, peers={1: a.peer}
        )
        cache = hixl.kv.allocate_cache(kv, mem_type=mem, name="kv", layout=lay)
        syncer = hixl.kv.LayerTracker(model.L)
        start = time.monotonic()
        task = hixl.kv.transfer_cache_async(1, cache, syncer, mode="push", transfer_config=cfg)

        def layer_ready(k: int) -> None:
            if dev is not None:
                torch = _torch()
                dev[k].copy_(torch.from_numpy(cache_arr[k]))
                torch.cuda.synchronize()  # hixl's copies do not wait for torch's stream
            syncer.layer_ready(k)

        model.prefill(prompt, cache_arr, layer_ready)
        computed_end = time.monotonic()
        res = task.wait(a.timeout_ms)
        from ..kv._context import context

        ctx = context()
        out.update(
            start=start,
            computed=syncer.times["ready"],
            sent=task.layer_times["sent"],
            submitted=task.layer_times["submitted"],
            computed_end=computed_end,
            bytes=res.bytes,
            backend=ctx.engine.stats()[a.peer]["backend"],
        )
    hixl.kv.finalize()
    print(json.dumps(out), flush=True)
    return 0


def _torch() -> Any:
    return importlib.import_module("torch")  # optional dependency (--device cuda)


def _device_cache(like: Any) -> Any:
    """A zeroed torch CUDA tensor of `like`'s shape and dtype on cuda:0."""
    torch = _torch()
    return torch.zeros(like.shape, dtype=torch.from_numpy(like[:0]).dtype, device="cuda:0")


def _cuda_missing() -> str | None:
    """Why `--device cuda` cannot run here (naming the missing piece), or None."""
    from .._hixl import cuda_info

    info = cuda_info()
    if not info["available"]:
        return f"CUDA not found: {info['reason']}"
    try:
        torch = _torch()
    except ImportError:
        return "torch is not installed (the KV cache on the GPU is a torch CUDA tensor)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU-only build of torch?)"
    return None


def _spawn(a: argparse.Namespace, role: str, peer: str | None = None) -> subprocess.Popen[str]:
    """Start one worker. Call it through `_Workers.start`, which records the process before a
    Ctrl-C can end this one."""
    cmd = [
        sys.executable,
        "-m",
        "hixl.cli",
        "demo",
        "--worker",
        role,
        "--transport",
        a.transport,
        "--layers",
        str(a.layers),
        "--heads",
        str(a.heads),
        "--head-dim",
        str(a.head_dim),
        "--prompt-len",
        str(a.prompt_len),
        "--tokens",
        str(a.tokens),
        "--seed",
        str(a.seed),
        "--timeout-ms",
        str(a.timeout_ms),
        "--device",
        a.device,
    ]
    if peer:
        cmd += ["--peer", peer]
    # One BLAS thread per worker: two processes on a small machine must not fight over cores.
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = {**env, **os.environ}
    # A session of its own: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches
    # only this process, which then ends the workers quietly (`_Workers`); a worker interrupted
    # mid-import would print a traceback.
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


class _Workers:
    """The worker processes started so far; all still running are killed when the block is
    left by an exception (Ctrl-C included), so none outlives an interrupted demo."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> Self:
        return self

    def start(
        self, a: argparse.Namespace, role: str, peer: str | None = None
    ) -> subprocess.Popen[str]:
        """Spawn a worker and record it with SIGINT held back: a Ctrl-C that lands between the
        fork and the append would otherwise leave a worker nobody kills, which then writes
        READY into a closed pipe (a BrokenPipeError traceback on the terminal). The worker
        inherits the held-back signal and lets it through again first thing (`_worker`)."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            p = _spawn(a, role, peer)
            self.procs.append(p)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return p

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            return
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _result(proc: subprocess.Popen[str], who: str, timeout_s: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SystemExit(
            f"hixl demo: the {who} process did not finish in {timeout_s:.0f} s"
        ) from None
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"hixl demo: the {who} process failed (exit {proc.returncode})")
    return dict(json.loads(lines[-1]))


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        why = _cuda_missing()
        if why is not None:
            args.parser.error(f"--device cuda: Unsupported: {why}")
    if args.worker:
        return _worker(args)
    model = _model(args)
    layout = model.layout(args.prompt_len - 1)
    with _Workers() as workers:
        decode = workers.start(args, "decode")
        assert decode.stdout is not None
        ready = decode.stdout.readline().split()
        if len(ready) != 2 or ready[0] != "READY":
            raise SystemExit("hixl demo: the decode process did not start")
        prefill = workers.start(args, "prefill", ready[1])
        limit = args.timeout_ms / 1000 + 30
        pre = _result(prefill, "prefill", limit)
        dec = _result(decode, "decode", limit)
    reference = model.reference(model.prompt(args.prompt_len, args.seed), args.tokens)
    return _report(args, layout, pre, dec, reference)


def _report(
    a: argparse.Namespace,
    layout: Any,
    pre: dict[str, Any],
    dec: dict[str, Any],
    reference: list[int],
) -> int:
    t0 = pre["start"]

    def ms(d: dict[str, float], k: int) -> float:
        return (d[str(k)] - t0) * 1e3

    rows = [
        {
            "layer": k,
            "computed_ms": ms(pre["computed"], k),
            "submitted_ms": ms(pre["submitted"], k),
            "acked_ms": ms(pre["sent"], k),
            "arrived_ms": ms(dec["arrived"], k),
            "used_ms": ms(dec["used"], k),
        }
        for k in range(a.layers)
    ]
    # Bandwidth while a layer is moving: from its submission to its arrival at the decoder.
    moving = [dec["arrived"][str(k)] - pre["submitted"][str(k)] for k in range(a.layers)]
    moved_s = max(sum(moving), 1e-9)
    tokens = dec["tokens"]
    mismatch = next(
        (i for i, (x, y) in enumerate(zip(tokens, reference, strict=True)) if x != y), None
    )
    doc = {
        "transport": pre["backend"],
        "device": a.device,
        "layers": a.layers,
        "heads": a.heads,
        "head_dim": a.head_dim,
        "head_row_stride": layout.head_stride,
        "prompt_len": a.prompt_len,
        "tokens_generated": a.tokens,
        "kv_bytes": pre["bytes"],
        "kv_bytes_received": dec["bytes"],
        "layer_transfer_ms": [x * 1e3 for x in moving],
        "gbps": pre["bytes"] / moved_s / 1e9,
        "decode_first_layer_before_prefill_end_ms": (pre["computed_end"] - dec["used"]["0"]) * 1e3,
        "timeline": rows,
        "tokens": tokens,
        "reference": reference,
        "identical": mismatch is None,
        "first_mismatch": mismatch,
    }
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        print(
            f"hixl demo: {a.layers} layers, {a.heads} heads x {a.head_dim} (head row stride "
            f"{layout.head_stride} B), prompt {a.prompt_len} tokens, {a.tokens} new tokens, "
            f"transport {pre['backend']}, KV cache on {'cuda:0' if a.device == 'cuda' else 'cpu'}"
        )
        print("ms since prefill started; prefill: computed, submitted, acked (saw its write")
        print("complete); decode: arrived (saw the layer), used (ran the layer on it)")
        print("layer  computed  submitted    acked  arrived     used")
        for r in rows:
            print(
                f"{r['layer']:5}  {r['computed_ms']:8.2f}  {r['submitted_ms']:9.2f} "
                f"{r['acked_ms']:8.2f} {r['arrived_ms']:8.2f} {r['used_ms']:8.2f}"
            )
        lead = doc["decode_first_layer_before_prefill_end_ms"]
        print(
            f"KV cache: {human(pre['bytes'])} bytes in {a.layers} layers, each moved in "
            f"{moved_s * 1e3 / a.layers:.2f} ms on average from submission to arrival "
            f"({doc['gbps']:.2f} GB/s while moving); decode used layer 0 {abs(lead):.2f} ms "
            f"{'before' if lead > 0 else 'after'} prefill finished computing"
        )
        print(f"tokens, disaggregated: {tokens}")
        print(f"tokens, one process:   {reference}")
    if pre["bytes"] != dec["bytes"]:
        print(
            f"hixl demo: MISMATCH: prefill sent {pre['bytes']} bytes, "
            f"decode counted {dec['bytes']}",
            file=sys.stderr,
        )
        return 1
    if mismatch is not None:
        print(
            f"hixl demo: MISMATCH at generated token {mismatch}: {tokens[mismatch]} vs "
            f"{reference[mismatch]} in the single-process run",
            file=sys.stderr,
        )
        return 1
    if not a.json:
        print("identical: yes")
    return 0
