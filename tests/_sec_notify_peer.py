"""The processes of tests/test_security_notify.py.

python _sec_notify_peer.py notify ADDR NAME MSG [NAME MSG ...]
    An engine of its own (listening on 127.0.0.1, so its id is an "ip:port" like any
    rank's): connects to ADDR, sends each notification ("{self}" in MSG becomes its own
    engine id), prints "SENT <its engine id>" and exits.
python _sec_notify_peer.py flood ADDR NAME SIZE COUNT SECONDS
    An engine of its own that sends COUNT notifications NAME of SIZE bytes each to ADDR
    (each refused one, ResourceExhausted, is sent again after 10 ms, for at most SECONDS in
    all); prints "STARTED <its engine id>" once connected, then "FLOOD <sent> <refusals>".
python _sec_notify_peer.py lldd-prompt DECODER_ADDR
    LLM-DataDist cluster 0 (prompt): a cache whose entry 0 is CacheKey(0, req_id=7),
    tensor i filled with pattern seed 50 + i; links to cluster 1 at DECODER_ADDR (which
    sends it the hello), prints "READY <its address>" and reads lines on stdin: "pull REQ"
    pulls cluster 1's CacheKey(1, req_id=REQ) (which releases it) and prints "PULLED" and the
    hex of each tensor's entry 0; any other line ends it.
"""

from __future__ import annotations

import sys
import time

from _lldd_sync import fill

import hixl
import hixl.llm_datadist as ld

#: The prompt's cache: 2 tensors of 4 x 64 float16, one batch entry per CacheKey.
DESC = (2, [4, 64])
REQ_ID = 7


def notify(addr: str, pairs: list[str]) -> None:
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
        e.connect(addr, timeout_ms=10_000)
        me = e.local_engine
        for name, msg in zip(pairs[::2], pairs[1::2], strict=True):
            e.send_notify(addr, hixl.NotifyDesc(name, msg.replace("{self}", me)), timeout_ms=10_000)
        print(f"SENT {me}", flush=True)


def flood(addr: str, name: str, size: int, count: int, seconds: float) -> None:
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
        e.connect(addr, timeout_ms=10_000)
        print(f"STARTED {e.local_engine}", flush=True)
        sent = refused = 0
        deadline = time.monotonic() + seconds
        while sent < count and time.monotonic() < deadline:
            text = f"9:kv:{sent}:".ljust(size - len(name), "x")
            try:
                e.send_notify(addr, hixl.NotifyDesc(name, text), timeout_ms=10_000)
                sent += 1
            except hixl.ResourceExhausted:
                refused += 1
                time.sleep(0.01)
        print(f"FLOOD {sent} {refused}", flush=True)


def lldd_prompt(decoder: str) -> None:
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 0)
    cfg = ld.LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.enable_cache_manager = True
    dd.init(cfg.generate_options())
    try:
        cm = dd.cache_manager
        desc = ld.CacheDesc(DESC[0], DESC[1], ld.DataType.DT_FLOAT16, ld.Placement.HOST)
        cache = cm.allocate_cache(desc, [ld.CacheKey(0, req_id=REQ_ID)])
        for i, t in enumerate(cm.get_cache_tensors(cache)):
            fill(t, 50 + i)
        info = ld.LLMClusterInfo()
        info.remote_cluster_id = 1
        ip, port = decoder.rsplit(":", 1)
        info.append_remote_ip_info(ip, int(port))
        ret, rets = dd.link_clusters([info], 10_000)
        assert ret == ld.LLMStatusCode.LLM_SUCCESS, (ret, rets, dd.link_errors)
        print(f"READY {dd.local_address}", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] != ["pull"]:
                break
            local = cm.allocate_cache(desc)
            cm.pull_cache(ld.CacheKey(1, req_id=int(cmd[1])), local)
            got = [t[0].tobytes().hex() for t in cm.get_cache_tensors(local)]
            print("PULLED " + " ".join(got), flush=True)
    finally:
        dd.finalize()


if __name__ == "__main__":
    if sys.argv[1] == "notify":
        notify(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "flood":
        a = sys.argv[2:]
        flood(a[0], a[1], int(a[2]), int(a[3]), float(a[4]))
    else:
        lldd_prompt(sys.argv[2])
