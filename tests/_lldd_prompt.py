"""The prompt (prefill) side of LLM-DataDist's sample flows, written the way its users write
them; ported to hixl by the import line and the device lines (marked "device line": NPU
tensors -> numpy host arrays, Placement.DEVICE -> Placement.HOST, device IPs -> 127.0.0.1).
torch.distributed's barrier is replaced by _lldd_sync's (the test relays it).

    python _lldd_prompt.py --flow cache|blocks|layerwise|ranktable --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time

import numpy as np
from _lldd_sync import barrier, check, dump, expect_code, fill, hear, say

from hixl.llm_datadist import (  # was: from llm_datadist import ...
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
logging.basicConfig(format="%(asctime)s prompt %(message)s", level=logging.INFO)


def init_llm_datadist(cache_manager: bool = True, remote_cache: bool = False) -> LLMDataDist:
    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.listen_ip_info = "127.0.0.1:0"  # device line: host address, any free port
    if cache_manager:
        llm_config.enable_cache_manager = True
    if remote_cache:
        llm_config.enable_remote_cache_accessible = True
    llm_config.enable_switch_role = True
    datadist.init(llm_config.generate_options())
    return datadist


def run_cache(datadist: LLMDataDist, out: str) -> None:
    cache_manager = datadist.cache_manager
    # Two requests in one batch: each batch index is named by a CacheKey.
    cache_desc = CacheDesc(
        num_tensors=4, shape=[2, 16, 64], data_type=DataType.DT_FLOAT16, placement=Placement.HOST
    )  # device line: HOST
    cache_keys = [CacheKey(PROMPT_CLUSTER_ID, req_id=10), CacheKey(PROMPT_CLUSTER_ID, req_id=11)]
    cache = cache_manager.allocate_cache(cache_desc, cache_keys)
    for i, t in enumerate(cache_manager.get_cache_tensors(cache)):  # device line: host views
        fill(t, 100 + i)
    # Memory the program already owns (torch.empty(...).npu() on Ascend; device line).
    own = [np.zeros((1, 16, 64), np.float16) for _ in range(4)]
    for i, a in enumerate(own):
        fill(a, 200 + i)
    reg_desc = CacheDesc(4, [1, 16, 64], DataType.DT_FLOAT16, Placement.HOST)
    reg = cache_manager.register_cache(
        reg_desc, [int(a.ctypes.data) for a in own], [CacheKey(PROMPT_CLUSTER_ID, req_id=12)]
    )
    say({"addr": datadist.local_address, "reg_id": reg.cache_id})
    barrier("linked")
    barrier("pulled")
    # req 12 was never pulled: the prompt withdraws it.
    cache_manager.remove_cache_key(CacheKey(PROMPT_CLUSTER_ID, req_id=12))
    barrier("removed")
    for i, t in enumerate(cache_manager.get_cache_tensors(cache)):
        dump(out, f"prompt_cache_{i}", t)
    cache_manager.deallocate_cache(cache)
    cache_manager.unregister_cache(reg.cache_id)
    barrier("done")


def run_blocks(datadist: LLMDataDist, out: str) -> None:
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=2, shape=[8, 256], data_type=DataType.DT_FLOAT, placement=Placement.HOST
    )
    kv = [np.zeros((8, 256), np.float32) for _ in range(2)]  # device line: torch...npu()
    for i, t in enumerate(kv):
        fill(t, 300 + i)
    addrs = [int(t.ctypes.data) for t in kv]  # device line: t.data_ptr()
    cache = cache_manager.register_blocks_cache(
        cache_desc, addrs, BlocksCacheKey(PROMPT_CLUSTER_ID, 0)
    )
    logging.info("register_blocks_cache success")
    # A plain (batch) cache the decoder pushes into by id and batch index.
    plain = cache_manager.allocate_cache(CacheDesc(2, [2, 256], DataType.DT_FLOAT, Placement.HOST))
    say({"addr": datadist.local_address, "plain_id": plain.cache_id})
    barrier("linked")
    barrier("pulled")
    barrier("pushed")  # the decoder wrote into blocks 4, 6 and 7 and into plain entry 1
    for i, t in enumerate(kv):
        dump(out, f"prompt_blocks_{i}", t)
    for i, t in enumerate(cache_manager.get_cache_tensors(plain)):
        dump(out, f"prompt_plain_{i}", t)
    barrier("unlinked")
    cache_manager.unregister_cache(cache.cache_id)
    barrier("done")


class LayerSynchronizerImpl(LayerSynchronizer):
    """Returns once the model has computed the layer (here: set by the compute loop)."""

    def __init__(self, num_layers: int) -> None:
        self.events = [threading.Event() for _ in range(num_layers)]
        self.asked: list[int] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        t = None if timeout_in_millis is None else timeout_in_millis / 1000
        return self.events[layer_index].wait(t)


class NeverReady(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return False


def run_layerwise(datadist: LLMDataDist, out: str) -> None:
    cache_manager = datadist.cache_manager
    num_layers = 2
    cache_desc = CacheDesc(2 * num_layers, [4, 128], DataType.DT_FLOAT16, Placement.HOST)
    kv = [np.zeros((4, 128), np.float16) for _ in range(2 * num_layers)]  # device line
    cache = cache_manager.register_blocks_cache(
        cache_desc, [int(t.ctypes.data) for t in kv], BlocksCacheKey(PROMPT_CLUSTER_ID, 0)
    )
    peer = hear()  # the decoder's address and the addresses of its second destination
    ip, port = peer["addr"].rsplit(":", 1)
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info("127.0.0.1", 26000)  # ignored on hixl
    cluster.append_remote_ip_info(ip, int(port))
    ret, rets = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS and rets == [ret], f"link_clusters: {ret} {rets}")

    syncer = LayerSynchronizerImpl(num_layers)
    configs: list[TransferConfig | TransferWithCacheKeyConfig] = [
        TransferWithCacheKeyConfig(
            BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, num_layers), range(0, num_layers)
        ),
        TransferConfig(DECODER_CLUSTER_ID, peer["dst_addrs"]),
    ]
    task = cache_manager.transfer_cache_async(cache, syncer, configs)
    for layer in range(num_layers):  # the model computes layer by layer
        time.sleep(0.05)
        for i in (2 * layer, 2 * layer + 1):
            fill(kv[i], 400 + i)
        syncer.events[layer].set()
    ret = task.synchronize(10_000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"transfer_cache_async: {ret}")
    check(task.get_results() == [ret, ret], f"per config: {task.get_results()}")
    check(syncer.asked == [0, 1], f"synchronize_layer calls: {syncer.asked}")
    # Only blocks 1 and 3 of layer 1 to the keyed destination's blocks 0 and 2.
    for i in (2, 3):
        fill(kv[i], 500 + i)
    syncer2 = LayerSynchronizerImpl(num_layers)
    for e in syncer2.events:
        e.set()
    part = TransferWithCacheKeyConfig(
        BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(1, 2), range(1, 2)
    )
    task = cache_manager.transfer_cache_async(cache, syncer2, [part], [1, 3], [0, 2])
    check(task.synchronize(10_000) == LLMStatusCode.LLM_SUCCESS, "partial layerwise transfer")
    # A layer that never gets computed fails the task (it does not hang).
    task = cache_manager.transfer_cache_async(cache, NeverReady(), configs)
    res = task.get_results(10_000)
    check(res == [LLMStatusCode.LLM_TIMEOUT] * 2, f"never-ready layer: {res}")
    barrier("sent")
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters: {ret}")
    cache_manager.unregister_cache(cache.cache_id)
    barrier("done")


def run_ranktable(datadist: LLMDataDist, out: str) -> None:
    kv_cache_manager = datadist.kv_cache_manager  # the API without enable_cache_manager
    cache_desc = CacheDesc(2, [1, 8, 32], DataType.DT_FLOAT16, Placement.HOST)
    kv_cache = kv_cache_manager.allocate_cache(cache_desc, [CacheKey(PROMPT_CLUSTER_ID, 1)])
    for i, t in enumerate(kv_cache_manager.get_cache_tensors(kv_cache)):
        fill(t, 600 + i)
    say({"addr": datadist.local_address})
    peer = hear()
    rank_table = {
        "server_count": "2",
        "status": "completed",
        "version": "1.2",
        "server_list": [
            {
                "server_id": "1",
                "host_ip": "127.0.0.1",
                "device": [
                    {
                        "device_id": "0",
                        "device_ip": "127.0.0.1",  # device line: where each process listens
                        "device_port": int(datadist.local_address.rsplit(":", 1)[1]),
                        "rank_id": "0",
                    }
                ],
            },
            {
                "server_id": "2",
                "host_ip": "127.0.0.1",
                "device": [
                    {
                        "device_id": "0",
                        "device_ip": "127.0.0.1",
                        "device_port": int(peer["addr"].rsplit(":", 1)[1]),
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
    while datadist.query_register_mem_status(comm_id) == RegisterMemStatus.PREPARING:
        check(time.monotonic() < deadline, "query_register_mem_status stays PREPARING")
        time.sleep(0.05)
    check(datadist.query_register_mem_status(comm_id) == RegisterMemStatus.OK, "link OK")
    datadist.check_link_status(DECODER_CLUSTER_ID)
    barrier("linked")
    barrier("pulled")
    expect_code(LLMStatusCode.LLM_EXIST_LINK, datadist.switch_role, LLMRole.DECODER)
    datadist.unlink(comm_id)
    expect_code(LLMStatusCode.LLM_NOT_YET_LINK, datadist.check_link_status, DECODER_CLUSTER_ID)
    barrier("unlinked")
    # Roles swap (switch_role_sample): this process becomes a decoder (its engine restarts on
    # a free port, giving up its address), the decoder becomes the prompt at that address.
    old_addr = datadist.local_address
    datadist.switch_role(LLMRole.DECODER)
    check(datadist.role == LLMRole.DECODER, "switched to DECODER")
    check(datadist.local_address != old_addr, "the old listen address is given up")
    say({"addr": datadist.local_address})
    barrier("switched")  # the other one checks that two decoders do not link
    peer = hear()  # it is the prompt now, at old_addr
    ip, port = old_addr.rsplit(":", 1)
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_remote_ip_info(ip, int(port))
    ret, rets = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link to the new prompt: {ret} {rets}")
    for name, key in (
        ("new_key", CacheKey(DECODER_CLUSTER_ID, req_id=5)),
        ("reregistered", CacheKeyByIdAndIndex(DECODER_CLUSTER_ID, peer["kv_id"], 0)),
    ):
        dst = kv_cache_manager.allocate_cache(cache_desc)
        kv_cache_manager.pull_cache(key, dst)
        for i, t in enumerate(kv_cache_manager.get_cache_tensors(dst)):
            dump(out, f"prompt_{name}_{i}", t)
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters: {ret}")
    kv_cache_manager.deallocate_cache(kv_cache)
    barrier("done")


def run_switch(datadist: LLMDataDist, out: str) -> None:
    """switch_role_sample: the decoder pulls blocks, both switch roles, the new decoder (this
    process) links to the new prompt, which pushes blocks back over that link."""
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(2, [4, 512], DataType.DT_FLOAT16, Placement.HOST)
    kv = [np.zeros((4, 512), np.float16) for _ in range(2)]  # device line
    for i, t in enumerate(kv):
        fill(t, 1100 + i)
    cache = cache_manager.register_blocks_cache(
        cache_desc, [int(t.ctypes.data) for t in kv], BlocksCacheKey(PROMPT_CLUSTER_ID, 0)
    )
    old_addr = datadist.local_address
    say({"addr": old_addr})
    barrier("decoder unlinked")  # it linked, pulled blocks 0 and 1, and unlinked
    datadist.switch_role(LLMRole.DECODER)  # gives up old_addr
    barrier("prompt switched")
    barrier("decoder switched")  # the other process is the prompt now, at old_addr
    ip, port = old_addr.rsplit(":", 1)
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_remote_ip_info(ip, int(port))
    ret, rets = datadist.link_clusters([cluster], 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link to the new prompt: {ret} {rets}")
    barrier("prompt linked")
    barrier("pushed")  # the new prompt pushed its blocks 0 and 2 into blocks 2 and 3 here
    for i, t in enumerate(kv):
        dump(out, f"prompt_switch_{i}", t)
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters: {ret}")
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
    print("PROMPT DONE", flush=True)


if __name__ == "__main__":
    main()
