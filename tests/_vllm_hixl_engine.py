"""A real vLLM engine with hixl's own KV connector (hixl.vllm.HixlConnector), in a process of
its own, driven by lines on stdin (the connector tests' peer):

    python _vllm_hixl_engine.py ROLE MODEL_DIR [EXTRA_JSON [CONNECTOR [MAX_MODEL_LEN]]]

ROLE is ``prefill`` (kv_producer) or ``decode`` (kv_consumer); EXTRA_JSON is the
connector's kv_connector_extra_config; CONNECTOR is ``HixlConnector`` (the default, loaded
from hixl.vllm) or one of vLLM's own (``NixlConnector``: benches/vllm_pd.py). The first
line is ``READY <pid> <nixl>``, where <nixl> says whether a ``nixl`` package is importable
here ("no-nixl" or "nixl"). Then one JSON line answers each ``generate {"requests": [...]}``
(each request ``{"ids", "max_tokens", "params"}``; all submitted at once, then stepped
until each ends) with ``{"outputs": [{"tokens", "finish_reason", "kv_transfer_params",
"ttft_s"}]}`` (ttft_s: from submitting the requests to the request's first token);
``exit`` ends it. Everything vLLM prints goes to stderr."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

KV_CACHE_BYTES = 256 << 20
BLOCK_SIZE = 32


def main() -> None:
    role, model = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    connector = sys.argv[4] if len(sys.argv) > 4 else "HixlConnector"
    max_len = int(sys.argv[5]) if len(sys.argv) > 5 else 2048
    fd = os.dup(1)
    os.dup2(2, 1)
    answers = os.fdopen(fd, "w", buffering=1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path="hixl.vllm" if connector == "HixlConnector" else None,
        kv_role="kv_producer" if role == "prefill" else "kv_consumer",
        kv_connector_extra_config=extra,
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        block_size=BLOCK_SIZE,
        max_model_len=max_len,
        **({"max_num_batched_tokens": max_len} if max_len > 2048 else {}),
        kv_transfer_config=kv,
        seed=0,
    )
    nixl = "nixl" if importlib.util.find_spec("nixl") is not None else "no-nixl"
    print("READY", os.getpid(), nixl, file=answers)
    engine = llm.llm_engine
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd != "generate":
            break
        try:
            ids, done, first = [], {}, {}
            start = time.perf_counter()
            for i, r in enumerate(json.loads(arg)["requests"]):
                extra_args = {"kv_transfer_params": r["params"]} if r.get("params") else None
                sp = SamplingParams(
                    temperature=0,
                    ignore_eos=True,
                    max_tokens=r["max_tokens"],
                    extra_args=extra_args,
                )
                rid = f"r{time.monotonic_ns()}-{i}"
                engine.add_request(rid, {"prompt_token_ids": r["ids"]}, sp)
                ids.append(rid)
            while len(done) < len(ids):
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                        first[out.request_id] = time.perf_counter() - start
                    if out.finished:
                        done[out.request_id] = out
            reply: dict = {
                "outputs": [
                    {
                        "tokens": list(done[r].outputs[0].token_ids),
                        "finish_reason": done[r].outputs[0].finish_reason,
                        "kv_transfer_params": done[r].kv_transfer_params,
                        "ttft_s": first.get(r),
                    }
                    for r in ids
                ]
            }
        except Exception as e:  # the test reads it; the engine stays up
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=answers)
    answers.close()
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
