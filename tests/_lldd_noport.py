"""One cluster of a rank-table link whose table names no ports (as Ascend writes v1.2 tables):
``python _lldd_noport.py prompt|decoder BASE [PORT_OF_DECODER] [bind]`` (bind: each
process gives its device_ip and device id at init, llm.hixlDeviceIp, so that init listens at
its derived address at once). The prompt allocates a
cache and fills it; both link with the same table (prompt rank 0 at 127.0.0.2, device 0;
decoder rank 1 at 127.0.0.3, device 1); the decoder pulls the cache; each compares its
cache with what the prompt filled it with and prints SAME True or False. Each prints its
listen address after the link.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from _lldd_sync import check, fill

from hixl.llm_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
    RegisterMemStatus,
)

PROMPT, DECODER = 0, 1


def table(decoder_port: str) -> str:
    dec = {"device_id": "1", "device_ip": "127.0.0.3", "rank_id": "1"}
    if decoder_port:
        dec["device_port"] = decoder_port  # device_port keeps working beside derived ports
    return json.dumps(
        {
            "version": "1.2",
            "server_count": "1",
            "status": "completed",
            "server_list": [
                {
                    "server_id": "node-0",
                    "host_ip": "127.0.0.1",
                    "device": [
                        {"device_id": "0", "device_ip": "127.0.0.2", "rank_id": "0"},
                        dec,
                    ],
                }
            ],
        }
    )


def main() -> None:
    role, base = sys.argv[1], sys.argv[2]
    decoder_port = sys.argv[3] if len(sys.argv) > 3 else ""
    bind = sys.argv[4:] == ["bind"]
    cid = PROMPT if role == "prompt" else DECODER
    datadist = LLMDataDist(LLMRole.PROMPT if cid == PROMPT else LLMRole.DECODER, cid)
    cfg = LLMConfig()
    cfg.hixl_options = {"llm.hixlDevicePortBase": base}
    if bind:
        cfg.device_id = cid  # the table's device_id of this rank
        cfg.hixl_options["llm.hixlDeviceIp"] = f"127.0.0.{2 + cid}"
    datadist.init(cfg.generate_options())
    if bind:
        print("INIT", datadist.local_address, flush=True)
    desc = CacheDesc(2, [1, 4, 256], DataType.DT_FLOAT16, Placement.HOST)
    mgr = datadist.kv_cache_manager
    if cid == PROMPT:
        cache = mgr.allocate_cache(desc, [CacheKey(PROMPT, 1)])
        for i, t in enumerate(mgr.get_cache_tensors(cache)):
            fill(t, 700 + i)
    comm = datadist.link("noport", {PROMPT: 0, DECODER: 1}, table(decoder_port))
    deadline = time.monotonic() + 30
    while datadist.query_register_mem_status(comm) == RegisterMemStatus.PREPARING:
        check(time.monotonic() < deadline, "query_register_mem_status stays PREPARING")
        time.sleep(0.05)
    check(datadist.query_register_mem_status(comm) == RegisterMemStatus.OK, "link OK")
    print("ADDR", datadist.local_address, flush=True)
    if cid == DECODER:
        cache = mgr.allocate_cache(desc)
        mgr.pull_cache(CacheKey(PROMPT, 1), cache)
    same = []
    for i, t in enumerate(mgr.get_cache_tensors(cache)):
        want = np.empty_like(t)
        fill(want, 700 + i)
        same.append(bool(np.array_equal(t.view(np.uint8), want.view(np.uint8))))
    print("SAME", all(same), same, flush=True)
    sys.stdin.readline()  # stay up until the test has both answers
    datadist.unlink(comm)
    datadist.finalize()


if __name__ == "__main__":
    main()
