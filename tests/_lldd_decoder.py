"""The decoder side of LLM-DataDist's sample flows (see _lldd_prompt.py): links to the
prompt, pulls caches and blocks by key, swaps and copies blocks, pushes blocks back,
receives a layerwise transfer, and checks the error codes of bad keys and unlinked clusters.

    python _lldd_decoder.py --flow cache|blocks|layerwise|ranktable --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np
from _lldd_sync import barrier, check, dump, expect_code, fill, hear, say

from hixl.llm_datadist import (  # was: from llm_datadist import ...
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)

PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
logging.basicConfig(format="%(asctime)s decoder %(message)s", level=logging.INFO)


def init_llm_datadist(cache_manager: bool = True, remote_cache: bool = False) -> LLMDataDist:
    datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER_ID)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.listen_ip_info = "127.0.0.1:0"  # device line
    if cache_manager:
        llm_config.enable_cache_manager = True
    if remote_cache:
        llm_config.enable_remote_cache_accessible = True
    llm_config.sync_kv_timeout = 5000
    llm_config.enable_switch_role = True
    datadist.init(llm_config.generate_options())
    return datadist


def prompt_cluster(addr: str) -> LLMClusterInfo:
    ip, port = addr.rsplit(":", 1)
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info("127.0.0.1", 26000)  # ignored on hixl
    cluster.append_remote_ip_info(ip, int(port))  # device line: the prompt's listen address
    return cluster


def link(datadist: LLMDataDist, cluster: LLMClusterInfo) -> None:
    ret, rets = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS and rets == [ret], f"link_clusters: {ret} {rets}")
    ret, rets = datadist.link_clusters([cluster], 5000)
    check(rets == [LLMStatusCode.LLM_ALREADY_LINK], f"second link_clusters: {ret} {rets}")


def run_cache(datadist: LLMDataDist, out: str) -> None:
    cache_manager = datadist.cache_manager
    peer = hear()
    cluster = prompt_cluster(peer["addr"])
    link(datadist, cluster)
    barrier("linked")
    # Room for 32 tokens per request; the prompt's caches hold 16.
    cache_desc = CacheDesc(4, [2, 32, 64], DataType.DT_FLOAT16, Placement.HOST)
    cache = cache_manager.allocate_cache(cache_desc)
    cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER_ID, req_id=10), cache, batch_index=1)
    cache_manager.pull_cache(
        CacheKey(PROMPT_CLUSTER_ID, req_id=11),
        cache,
        batch_index=0,
        src_layer_range=range(1, 2),
        dst_layer_range=range(1, 2),
    )
    # A key is used up by the pull that used it.
    expect_code(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        cache_manager.pull_cache,
        CacheKey(PROMPT_CLUSTER_ID, req_id=10),
        cache,
    )
    expect_code(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        cache_manager.pull_cache,
        CacheKey(PROMPT_CLUSTER_ID, req_id=99),
        cache,
    )
    expect_code(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        cache_manager.pull_cache,
        CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, 12345, 0),
        cache,
    )
    expect_code(
        LLMStatusCode.LLM_NOT_YET_LINK,
        cache_manager.pull_cache,
        CacheKey(7, req_id=10),
        cache,
    )
    expect_code(
        LLMStatusCode.LLM_PARAM_INVALID,
        cache_manager.pull_cache,
        CacheKey(PROMPT_CLUSTER_ID, req_id=12),
        cache,
        batch_index=2,
    )
    # The registered cache by id, cut into 4-token blocks of a paged cache (blocks 5 1 6 2).
    blocks_desc = CacheDesc(4, [8, 4 * 64], DataType.DT_FLOAT16, Placement.HOST)
    blocks = cache_manager.allocate_blocks_cache(blocks_desc)
    cache_manager.pull_blocks(
        CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, peer["reg_id"], 0), blocks, dst_blocks=[5, 1, 6, 2]
    )
    datadist.check_link_status(PROMPT_CLUSTER_ID)
    expect_code(LLMStatusCode.LLM_NOT_YET_LINK, datadist.check_link_status, 7)
    barrier("pulled")
    barrier("removed")
    expect_code(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        cache_manager.pull_cache,
        CacheKey(PROMPT_CLUSTER_ID, req_id=12),
        cache,
    )
    ret, rets = datadist.unlink_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters: {ret} {rets}")
    ret, rets = datadist.unlink_clusters([cluster], 5000)
    check(rets == [LLMStatusCode.LLM_NOT_YET_LINK], f"second unlink_clusters: {ret} {rets}")
    expect_code(
        LLMStatusCode.LLM_NOT_YET_LINK,
        cache_manager.pull_cache,
        CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, peer["reg_id"], 0),
        cache,
    )
    for i, t in enumerate(cache_manager.get_cache_tensors(cache)):
        dump(out, f"decoder_cache_{i}", t)
    for i, t in enumerate(cache_manager.get_cache_tensors(blocks)):
        dump(out, f"decoder_blocks_{i}", t)
    cache_manager.deallocate_cache(cache)
    cache_manager.deallocate_blocks_cache(blocks)
    barrier("done")


def run_blocks(datadist: LLMDataDist, out: str) -> None:
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(2, [8, 256], DataType.DT_FLOAT, Placement.HOST)
    kv = [np.zeros((8, 256), np.float32) for _ in range(2)]  # device line
    cache = cache_manager.register_blocks_cache(
        cache_desc, [int(t.ctypes.data) for t in kv], BlocksCacheKey(DECODER_CLUSTER_ID, 0)
    )
    peer = hear()
    cluster = prompt_cluster(peer["addr"])
    link(datadist, cluster)
    barrier("linked")
    cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1, 5], dst_blocks=[2, 3, 0]
    )
    expect_code(
        LLMStatusCode.LLM_PARAM_INVALID,
        cache_manager.pull_blocks,
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
        cache,
        src_blocks=[9],
        dst_blocks=[1],
    )
    expect_code(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        cache_manager.pull_blocks,
        BlocksCacheKey(PROMPT_CLUSTER_ID, 5),
        cache,
        src_blocks=[0],
        dst_blocks=[1],
    )
    # Swap out to host blocks and back in (device <-> host on Ascend; host <-> host here).
    cpu = [np.zeros((8, 256), np.float32) for _ in range(2)]
    cpu_cache = Cache.create_cpu_cache(cache_desc, [int(t.ctypes.data) for t in cpu])
    cache_manager.swap_blocks(cache, cpu_cache, {2: 0, 3: 1, 0: 7})
    pulled = [t.copy() for t in kv]
    for t in kv:
        t[2] = 0
    cache_manager.swap_blocks(cpu_cache, cache, {0: 2})
    same = [a.tobytes() == b.tobytes() for a, b in zip(kv, pulled, strict=True)]
    check(all(same), "swap out and in")
    cache_manager.copy_blocks(cache, {3: [6, 7]})
    barrier("pulled")
    cache_manager.push_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[2, 3], dst_blocks=[6, 7]
    )
    # A plain cache: its batch entry 1 into the prompt's plain cache (entry 1), and its
    # entry 0 cut into the prompt's block 4.
    plain = cache_manager.allocate_cache(CacheDesc(2, [2, 256], DataType.DT_FLOAT, Placement.HOST))
    for i, t in enumerate(cache_manager.get_cache_tensors(plain)):
        fill(t, 700 + i)
    cache_manager.push_cache(
        CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, peer["plain_id"], 1), plain, src_batch_index=1
    )
    cache_manager.push_blocks(BlocksCacheKey(PROMPT_CLUSTER_ID, 0), plain, dst_blocks=[4])
    expect_code(
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        cache_manager.push_cache,
        CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, 999, 0),
        plain,
    )
    barrier("pushed")
    for i, t in enumerate(kv):
        dump(out, f"decoder_blocks_{i}", t)
    for i, t in enumerate(cpu):
        dump(out, f"decoder_cpu_{i}", t)
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters: {ret}")
    barrier("unlinked")
    cache_manager.unregister_cache(cache.cache_id)
    barrier("done")


def run_layerwise(datadist: LLMDataDist, out: str) -> None:
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(4, [4, 128], DataType.DT_FLOAT16, Placement.HOST)
    kv = [np.zeros((4, 128), np.float16) for _ in range(4)]  # device line
    cache = cache_manager.register_blocks_cache(
        cache_desc, [int(t.ctypes.data) for t in kv], BlocksCacheKey(DECODER_CLUSTER_ID, 0)
    )
    # A second destination that the prompt addresses by raw tensor address (TransferConfig).
    second = [np.zeros((4, 128), np.float16) for _ in range(4)]
    cache_manager.register_blocks_cache(cache_desc, [int(t.ctypes.data) for t in second])
    say({"addr": datadist.local_address, "dst_addrs": [int(t.ctypes.data) for t in second]})
    barrier("sent")
    for i, t in enumerate(kv):
        dump(out, f"decoder_keyed_{i}", t)
    for i, t in enumerate(second):
        dump(out, f"decoder_addr_{i}", t)
    ret, _ = datadist.unlink_clusters([prompt_cluster("127.0.0.1:1")], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters(force=True): {ret}")
    cache_manager.unregister_cache(cache.cache_id)
    barrier("done")


def run_ranktable(datadist: LLMDataDist, out: str) -> None:
    kv_cache_manager = datadist.kv_cache_manager
    peer = hear()
    say({"addr": datadist.local_address})
    rank_table = {
        "server_count": "2",
        "status": "completed",
        "version": "1.2",
        "server_list": [
            {
                "server_id": "1",
                "device": [
                    {
                        "device_id": "0",
                        "device_ip": "127.0.0.1",
                        "device_port": int(peer["addr"].rsplit(":", 1)[1]),
                        "rank_id": "0",
                    }
                ],
            },
            {
                "server_id": "2",
                "device": [
                    {
                        "device_id": "0",
                        "device_ip": "127.0.0.1",
                        "device_port": int(datadist.local_address.rsplit(":", 1)[1]),
                        "rank_id": "1",
                    }
                ],
            },
        ],
    }
    comm_id = datadist.link(
        "link", {PROMPT_CLUSTER_ID: 0, DECODER_CLUSTER_ID: 1}, json.dumps(rank_table)
    )
    deadline = time.monotonic() + 20
    while True:
        st = datadist.query_register_mem_status(comm_id)
        if st == RegisterMemStatus.OK:
            break
        check(st != RegisterMemStatus.FAILED, "query_register_mem_status: FAILED")
        check(time.monotonic() < deadline, "query_register_mem_status stays PREPARING")
        time.sleep(0.05)
    barrier("linked")
    cache_desc = CacheDesc(2, [1, 8, 32], DataType.DT_FLOAT16, Placement.HOST)
    kv_cache = kv_cache_manager.allocate_cache(cache_desc)
    kv_cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER_ID, 1), kv_cache)
    check(len(kv_cache.per_device_tensor_addrs[0]) == 2, "KvCache.per_device_tensor_addrs")
    for i, t in enumerate(kv_cache_manager.get_cache_tensors(kv_cache)):
        dump(out, f"decoder_cache_{i}", t)
    barrier("pulled")
    barrier("unlinked")
    datadist.unlink(comm_id)
    addr = hear()["addr"]
    barrier("switched")
    # The prompt is a decoder now: two decoders may not link.
    ret, rets = datadist.link_clusters([prompt_cluster(addr)], 5000)
    check(
        ret == LLMStatusCode.LLM_LINK_FAILED and rets == [LLMStatusCode.LLM_LINK_FAILED],
        f"decoder to decoder link_clusters: {ret} {rets}",
    )
    # This process takes the prompt's role and its old address; its caches stay registered.
    llm_config = LLMConfig()
    llm_config.listen_ip_info = peer["addr"]
    datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    check(datadist.local_address == peer["addr"], "listening at the old prompt's address")
    new = kv_cache_manager.allocate_cache(cache_desc, [CacheKey(DECODER_CLUSTER_ID, req_id=5)])
    for i, t in enumerate(kv_cache_manager.get_cache_tensors(new)):
        fill(t, 800 + i)
    say({"kv_id": kv_cache.cache_id})
    barrier("done")  # the other one pulled both caches
    kv_cache_manager.deallocate_cache(kv_cache)
    kv_cache_manager.deallocate_cache(new)


def run_switch(datadist: LLMDataDist, out: str) -> None:
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(2, [4, 512], DataType.DT_FLOAT16, Placement.HOST)
    kv = [np.zeros((4, 512), np.float16) for _ in range(2)]  # device line
    cache = cache_manager.register_blocks_cache(
        cache_desc, [int(t.ctypes.data) for t in kv], BlocksCacheKey(DECODER_CLUSTER_ID, 0)
    )
    prompt_addr = hear()["addr"]
    cluster = prompt_cluster(prompt_addr)
    link(datadist, cluster)
    cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2]
    )
    ret, _ = datadist.unlink_clusters([cluster], 5000)  # not forced: both ends go
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters: {ret}")
    barrier("decoder unlinked")
    barrier("prompt switched")  # its old address is free now
    options = {"llm.listenIpInfo": prompt_addr}
    datadist.switch_role(LLMRole.PROMPT, options)
    barrier("decoder switched")
    barrier("prompt linked")  # the old prompt, now a decoder, linked to this process
    # Pushed over the link the other side made (this side never called link_clusters).
    cache_manager.push_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0), cache, src_blocks=[0, 2], dst_blocks=[2, 3]
    )
    barrier("pushed")
    for i, t in enumerate(kv):
        dump(out, f"decoder_switch_{i}", t)
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters(force=True): {ret}")
    cache_manager.unregister_cache(cache.cache_id)
    barrier("done")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flow", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    datadist = init_llm_datadist(
        cache_manager=args.flow != "ranktable",
        remote_cache=args.flow in ("blocks", "layerwise", "switch"),
    )
    try:
        {
            "cache": run_cache,
            "blocks": run_blocks,
            "layerwise": run_layerwise,
            "ranktable": run_ranktable,
            "switch": run_switch,
        }[args.flow](datadist, args.out)
    finally:
        datadist.finalize()
    print("DECODER DONE", flush=True)


if __name__ == "__main__":
    main()
