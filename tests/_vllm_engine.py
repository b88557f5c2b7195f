"""One real vLLM engine (``vllm.LLM``) in a process of its own, driven by lines on stdin:

    python _vllm_engine.py ROLE MODEL_DIR [CONNECTOR [EXTRA]]

ROLE is ``colocated`` (no KV connector: the reference), ``prefill`` (``kv_producer``) or
``decode`` (``kv_consumer``); CONNECTOR is the KV connector's name (default
``NixlConnector``, vLLM's pull mode; ``NixlPushConnector`` is its push mode) and EXTRA a
JSON object, the connector's ``kv_connector_extra_config``. The NIXL side
channel listens where ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and ``VLLM_NIXL_SIDE_CHANNEL_PORT``
say. ``import nixl`` is whatever the environment gives (hixl's shim in the tests).

Its first line is ``READY <pid>``. Then one JSON line answers each command:

* ``generate {"requests": [{"ids": [...], "max_tokens": N, "params": {...}}, ...]}`` runs
  the requests together (all submitted at once, then stepped until each ends) and answers
  ``{"outputs": [{"tokens", "finish_reason", "kv_transfer_params", "ttft_s"}, ...],
  "elapsed_s"}``; ``params`` (optional) is the request's ``kv_transfer_params``, and
  ``ttft_s`` is the time from submitting the requests to that request's first token.
* ``affinity`` answers ``{"cpus": [...]}``, the CPU affinity of the engine's processes.
* ``exit`` stops the engine and the process.

vLLM logs to stdout: everything but the answers goes to stderr (the file descriptor is
redirected before vLLM is imported, so its worker processes inherit it)."""

from __future__ import annotations

import json
import os
import sys
import time

#: What each engine may take for its KV cache (otherwise each takes a share of the RAM).
KV_CACHE_BYTES = 256 << 20
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
ROLES = ("colocated", "prefill", "decode")


def _answers() -> object:
    """A text stream on the original stdout; fd 1 becomes stderr for everything else."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def _engine(role: str, model: str, connector: str, extra: dict) -> object:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if role != "colocated":
        kv = KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_connector_extra_config=extra,
        )
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        kv_transfer_config=kv,
        seed=0,
    )


def _generate(llm: object, requests: list[dict]) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine  # type: ignore[attr-defined]
    start = time.perf_counter()
    ids = []
    for i, r in enumerate(requests):
        extra = {"kv_transfer_params": r["params"]} if r.get("params") else None
        sp = SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=r["max_tokens"], extra_args=extra
        )
        rid = f"r{time.monotonic_ns()}-{i}"
        engine.add_request(rid, {"prompt_token_ids": r["ids"]}, sp)
        ids.append(rid)
    first: dict[str, float] = {}
    done: dict[str, object] = {}
    while len(done) < len(ids):
        for out in engine.step():
            tokens = out.outputs[0].token_ids if out.outputs else []
            if tokens and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            if out.finished:
                done[out.request_id] = out
    outputs = []
    for rid in ids:
        out = done[rid]
        c = out.outputs[0]  # type: ignore[attr-defined]
        outputs.append(
            {
                "tokens": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "kv_transfer_params": out.kv_transfer_params,  # type: ignore[attr-defined]
                "ttft_s": first.get(rid),
            }
        )
    return {"outputs": outputs, "elapsed_s": time.perf_counter() - start}


def _affinity() -> dict:
    """The CPU affinity of this process and of all it started (vLLM's engine core, worker)."""
    pids, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo += [int(p) for p in f.read().split()]
        except OSError:
            pass
    cpus = {}
    for pid in pids:
        try:
            cpus[str(pid)] = sorted(os.sched_getaffinity(pid))
        except OSError:
            pass
    return {"cpus": cpus}


def main() -> None:
    if len(sys.argv) not in (3, 4, 5) or sys.argv[1] not in ROLES:
        sys.exit("usage: _vllm_engine.py colocated|prefill|decode MODEL_DIR [CONNECTOR [EXTRA]]")
    role, model = sys.argv[1], sys.argv[2]
    connector = sys.argv[3] if len(sys.argv) > 3 else "NixlConnector"
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    answers = _answers()
    llm = _engine(role, model, connector, extra)
    print("READY", os.getpid(), file=answers)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "exit" or not cmd:
            break
        try:
            if cmd == "generate":
                reply: dict = _generate(llm, json.loads(arg)["requests"])
            elif cmd == "affinity":
                reply = _affinity()
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as e:  # the test reads the error; the engine stays up
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=answers)
    answers.close()  # type: ignore[attr-defined]
    llm.llm_engine.engine_core.shutdown()  # type: ignore[attr-defined]
    os._exit(0)  # the engine is down; vLLM's atexit handlers may wait on dead peers


if __name__ == "__main__":
    main()
