"""A prompt (cluster id argv[1], default 0) that registers one cache (bytes of seed
900 + 10 * cluster id + tensor index), prints "READY ip:port cache_id" and holds it until its
stdin closes. TCP only, so that a frozen holder (SIGSTOP) answers nothing (the same-host
backend would read its memory anyway)."""

from __future__ import annotations

import sys

from _lldd_sync import fill

from hixl.llm_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

cluster_id = int(sys.argv[1]) if len(sys.argv) > 1 else 0
datadist = LLMDataDist(LLMRole.PROMPT, cluster_id)
llm_config = LLMConfig()
llm_config.listen_ip_info = "127.0.0.1:0"
llm_config.enable_cache_manager = True
llm_config.hixl_options = {"hixl.backends": "tcp"}
datadist.init(llm_config.generate_options())
cache_manager = datadist.cache_manager
cache = cache_manager.allocate_cache(CacheDesc(2, [1, 4096], DataType.DT_UINT8, Placement.HOST))
for i, t in enumerate(cache_manager.get_cache_tensors(cache)):
    fill(t, 900 + 10 * cluster_id + i)
print(f"READY {datadist.local_address} {cache.cache_id}", flush=True)
sys.stdin.read()
datadist.finalize()
