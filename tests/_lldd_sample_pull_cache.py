"""LLM-DataDist's pull_cache sample (examples/python/pull_cache_sample.py of cann/hixl),
ported: two clusters (1: prompt, 2: decoder) link through a rank table, the prompt allocates
a 2-request cache under two CacheKeys, the decoder pulls each request into its own cache by
key. Changed from the sample: the import, the device lines (marked), smaller tensors, its
sleeps (waiting for the other side) became barriers, and each side dumps what it ends with
into --out for the test to compare.

    python _lldd_sample_pull_cache.py --cluster_id 1|2 --ports P1,P2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from _lldd_sync import barrier, dump, fill

from hixl.llm_datadist import (  # was: from llm_datadist import ...
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
    RegisterMemStatus,
    create_npu_tensors,  # was: torchair.llm_datadist.create_npu_tensors
)

HOST_IP = "127.0.0.1"  # device line: PROMPT_HOST_IP / DECODER_HOST_IP and the device IPs
logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)


def init_llm_datadist(role: LLMRole, cluster_id: int, device_id: int, port: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.listen_ip_info = f"{HOST_IP}:{port}"  # device line: where the rank table says
    llm_config.enable_cache_manager = True
    llm_config.mem_pool_cfg = '{"memory_size": 1073741824}'
    datadist.init(llm_config.generate_options())
    return datadist


def link(datadist: LLMDataDist, device_id: int, ports: list[int]) -> int:
    rank_table = {
        "server_count": "2",
        "status": "completed",
        "version": "1.2",
        "server_list": [
            {
                "device": [
                    {
                        "device_id": str(device_id),
                        "device_ip": HOST_IP,
                        "device_port": ports[0],  # device line: hixl needs the port too
                        "rank_id": "0",
                    }
                ],
                "host_ip": HOST_IP,
                "server_id": "1",
            },
            {
                "device": [
                    {
                        "device_id": str(device_id),
                        "device_ip": HOST_IP,
                        "device_port": ports[1],
                        "rank_id": "1",
                    }
                ],
                "host_ip": HOST_IP,
                "server_id": "2",
            },
        ],
    }
    # clusters 1 and 2 are ranks 0 and 1
    comm_id = datadist.link("link", {1: 0, 2: 1}, json.dumps(rank_table))
    deadline = time.monotonic() + 30
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            logging.info("query_register_mem_status ok")
            break
        if ret == RegisterMemStatus.FAILED or time.monotonic() > deadline:
            raise RuntimeError(f"link failed: {ret}")
        time.sleep(0.05)
    return comm_id


def run_decoder_sample(datadist: LLMDataDist, device_id: int, ports: list[int], out: str) -> None:
    comm_id = link(datadist, device_id, ports)
    cache_manager = datadist.cache_manager
    # 4 tensors, 2 requests of 4096 fp16 each
    cache_desc = CacheDesc(
        num_tensors=4, shape=[2, 4096], data_type=DataType.DT_FLOAT16, placement=Placement.HOST
    )  # device line: Placement.HOST
    cache = cache_manager.allocate_cache(cache_desc)
    barrier("prompt prepared")  # was: time.sleep(5)
    cache_key_0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache_manager.pull_cache(cache_key_0, cache, batch_index=1)
    cache_manager.pull_cache(cache_key_1, cache, batch_index=0)
    tensors = create_npu_tensors(cache.cache_desc.shape, "float16", cache.tensor_addrs)
    logging.info(f"after pull, tensor={tensors[0]}")
    for i, t in enumerate(tensors):
        dump(out, f"decoder_{i}", t)
    barrier("pulled")  # was: the prompt's time.sleep(30)
    cache_manager.deallocate_cache(cache)
    datadist.unlink(comm_id)
    datadist.finalize()


def run_prompt_sample(datadist: LLMDataDist, device_id: int, ports: list[int], out: str) -> None:
    comm_id = link(datadist, device_id, ports)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=4, shape=[2, 4096], data_type=DataType.DT_FLOAT16, placement=Placement.HOST
    )
    cache_key_0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache = cache_manager.allocate_cache(cache_desc, [cache_key_0, cache_key_1])
    tensors = create_npu_tensors(cache.cache_desc.shape, "float16", cache.tensor_addrs)
    for i, t in enumerate(tensors):  # was: tensors[0].fill_(1)
        fill(t, 1000 + i)
        dump(out, f"prompt_{i}", t)
    barrier("prompt prepared")
    barrier("pulled")  # was: time.sleep(30)
    # A no-op once the decoder pulled by these keys; releases them otherwise.
    cache_manager.remove_cache_key(cache_key_0)
    cache_manager.remove_cache_key(cache_key_1)
    cache_manager.deallocate_cache(cache)
    datadist.unlink(comm_id)
    datadist.finalize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--device_id", type=int, default=0, help="device id")
    parser.add_argument("--cluster_id", type=int, default=1, help="cluster id")
    parser.add_argument("--ports", required=True, help="listen ports of clusters 1 and 2")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.cluster_id not in [1, 2]:
        raise RuntimeError("Not supported cluster id")
    ports = [int(p) for p in args.ports.split(",")]
    role = LLMRole.PROMPT if args.cluster_id == 1 else LLMRole.DECODER
    datadist = init_llm_datadist(role, args.cluster_id, args.device_id, ports[args.cluster_id - 1])
    if role == LLMRole.PROMPT:
        run_prompt_sample(datadist, args.device_id, ports, args.out)
        print("PROMPT DONE", flush=True)
    else:
        run_decoder_sample(datadist, args.device_id, ports, args.out)
        print("DECODER DONE", flush=True)
