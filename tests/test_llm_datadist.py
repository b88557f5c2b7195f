"""hixl.llm_datadist: LLM-DataDist's API. Ports of its sample flows run as a prompt and a
decoder process over real sockets (tests/_lldd_prompt.py, tests/_lldd_decoder.py); the test
relays what they tell each other, releases their barriers, and compares the bytes they end
with, byte for byte, against what the source tensors were filled with."""

from __future__ import annotations

import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _lldd_sync import pattern
from conftest import proc_state
from test_kv import collect, send_from_own_engine

import hixl
import hixl.llm_datadist as ld

HERE = Path(__file__).parent
TIMEOUT_S = 120


class Flow:
    """Runs the prompt and decoder scripts of one flow to the end (or kills them)."""

    def __init__(self, flow: str, out: Path, cmds: dict[str, list[str]] | None = None) -> None:
        self.out = out
        self.lines: dict[str, list[str]] = {"prompt": [], "decoder": []}
        self.q: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.procs = {}
        for side in ("prompt", "decoder"):
            cmd = (cmds or {}).get(side) or [str(HERE / f"_lldd_{side}.py"), "--flow", flow]
            p = subprocess.Popen(
                [sys.executable, *cmd, "--out", str(out)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=HERE,
            )
            self.procs[side] = p
            threading.Thread(target=self._read, args=(side, p), daemon=True).start()

    def _read(self, side: str, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            self.q.put((side, line.rstrip("\n")))
        self.q.put((side, None))

    def _send(self, side: str, text: str) -> None:
        p = self.procs[side]
        assert p.stdin is not None
        try:
            p.stdin.write(text + "\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def run(self) -> dict[str, int]:
        deadline = time.monotonic() + TIMEOUT_S
        waiting: dict[str, str] = {}
        ended: set[str] = set()
        try:
            while len(ended) < 2:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"flow still running after {TIMEOUT_S} s: {self.lines}")
                try:
                    side, line = self.q.get(timeout=left)
                except queue.Empty:
                    continue
                other = "decoder" if side == "prompt" else "prompt"
                if line is None:
                    ended.add(side)
                    if self.procs[side].wait(10) != 0:
                        self.procs[other].kill()  # it would wait at a barrier forever
                        break
                    continue
                self.lines[side].append(line)
                if line.startswith("SAY "):
                    self._send(other, line[4:])
                elif line.startswith("BARRIER "):
                    waiting[side] = line[8:]
                    if waiting.get(other) == waiting[side]:
                        for s in ("prompt", "decoder"):
                            self._send(s, f"GO {waiting[side]}")
                        waiting.clear()
            return {s: p.wait(10) for s, p in self.procs.items()}
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)

    def check(self) -> None:
        rc = self.run()
        assert rc == {"prompt": 0, "decoder": 0}, f"exit codes {rc}: {self.lines}"
        for side in ("prompt", "decoder"):
            assert any(x == f"{side.upper()} DONE" for x in self.lines[side]), self.lines[side]
            assert not any("CHECK FAILED" in x for x in self.lines[side]), self.lines[side]

    def bytes(self, name: str) -> np.ndarray:
        return np.load(self.out / f"{name}.npy")


def test_pull_cache_by_key_and_id(tmp_path: Path) -> None:
    f = Flow("cache", tmp_path)
    f.check()
    assert sum("CHECK ok" in x for x in f.lines["decoder"]) >= 10
    entry, dentry = 16 * 64 * 2, 32 * 64 * 2
    for i in range(4):
        src = pattern(2 * entry, 100 + i)
        assert np.array_equal(f.bytes(f"prompt_cache_{i}"), src)
        want = np.zeros(2 * dentry, np.uint8)
        want[dentry : dentry + entry] = src[:entry]  # key 10 (batch 0) into batch index 1
        if i >= 2:  # key 11 (batch 1), layer 1 only (tensors 2 and 3), into batch index 0
            want[:entry] = src[entry:]
        assert np.array_equal(f.bytes(f"decoder_cache_{i}"), want), i
        reg = pattern(entry, 200 + i)
        blocks = np.zeros(8 * 512, np.uint8)
        for j, b in enumerate([5, 1, 6, 2]):
            blocks[b * 512 : (b + 1) * 512] = reg[j * 512 : (j + 1) * 512]
        assert np.array_equal(f.bytes(f"decoder_blocks_{i}"), blocks), i


def test_pull_push_swap_copy_blocks(tmp_path: Path) -> None:
    f = Flow("blocks", tmp_path)
    f.check()
    bb = 256 * 4
    for i in range(2):
        src = pattern(8 * bb, 300 + i).reshape(8, bb)
        dec = np.zeros((8, bb), np.uint8)
        dec[0], dec[2], dec[3], dec[6], dec[7] = src[5], src[0], src[1], src[1], src[1]
        assert np.array_equal(f.bytes(f"decoder_blocks_{i}").reshape(8, bb), dec), i
        cpu = np.zeros((8, bb), np.uint8)
        cpu[0], cpu[1], cpu[7] = src[0], src[1], src[5]
        assert np.array_equal(f.bytes(f"decoder_cpu_{i}").reshape(8, bb), cpu), i
        plain = pattern(2 * bb, 700 + i).reshape(2, bb)  # the decoder's plain cache
        prompt = src.copy()
        prompt[6], prompt[7] = src[0], src[1]  # pushed back by the decoder
        prompt[4] = plain[0]  # its plain cache's entry 0, pushed as a block
        assert np.array_equal(f.bytes(f"prompt_blocks_{i}").reshape(8, bb), prompt), i
        want = np.zeros((2, bb), np.uint8)
        want[1] = plain[1]  # push_cache: entry 1 into entry 1
        assert np.array_equal(f.bytes(f"prompt_plain_{i}").reshape(2, bb), want), i


def test_transfer_cache_async_layerwise(tmp_path: Path) -> None:
    f = Flow("layerwise", tmp_path)
    f.check()
    for i in range(4):
        first = pattern(1024, 400 + i).reshape(4, 256)
        assert np.array_equal(f.bytes(f"decoder_addr_{i}").reshape(4, 256), first), i
        keyed = first.copy()
        if i >= 2:  # layer 1 again: its blocks 1 and 3 into blocks 0 and 2
            again = pattern(1024, 500 + i).reshape(4, 256)
            keyed[0], keyed[2] = again[1], again[3]
        assert np.array_equal(f.bytes(f"decoder_keyed_{i}").reshape(4, 256), keyed), i


def test_rank_table_link_kv_cache_manager_switch_role(tmp_path: Path) -> None:
    f = Flow("ranktable", tmp_path)
    f.check()
    for i in range(2):
        assert np.array_equal(f.bytes(f"decoder_cache_{i}"), pattern(512, 600 + i)), i
        # After the roles swapped: a cache allocated by the new prompt, and one registered
        # before its switch_role (registered again with the new engine).
        assert np.array_equal(f.bytes(f"prompt_new_key_{i}"), pattern(512, 800 + i)), i
        assert np.array_equal(f.bytes(f"prompt_reregistered_{i}"), pattern(512, 600 + i)), i


def free_ports(n: int) -> list[int]:
    """Ports nothing listened on a moment ago (the OS picks them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def test_pull_cache_sample_ported(tmp_path: Path) -> None:
    """LLM-DataDist's pull_cache sample, changed only in the import and device lines."""
    ports = ",".join(map(str, free_ports(2)))
    script = str(HERE / "_lldd_sample_pull_cache.py")
    cmds = {
        "prompt": [script, "--cluster_id", "1", "--ports", ports],
        "decoder": [script, "--cluster_id", "2", "--ports", ports],
    }
    f = Flow("", tmp_path, cmds)
    f.check()
    n = 2 * 4096 * 2
    for i in range(4):
        src = pattern(n, 1000 + i)
        assert np.array_equal(f.bytes(f"prompt_{i}"), src), i
        half = n // 2  # key 0 (batch 0) into batch 1, key 1 (batch 1) into batch 0
        assert np.array_equal(f.bytes(f"decoder_{i}"), np.concatenate([src[half:], src[:half]]))


def test_switch_role_sample_push_over_the_peers_link(tmp_path: Path) -> None:
    f = Flow("switch", tmp_path)
    f.check()
    blk = 512 * 2
    for i in range(2):
        src = pattern(4 * blk, 1100 + i).reshape(4, blk)
        dec = np.zeros((4, blk), np.uint8)
        dec[0], dec[2] = src[0], src[1]  # pulled before the switch
        assert np.array_equal(f.bytes(f"decoder_switch_{i}").reshape(4, blk), dec), i
        want = src.copy()
        want[2], want[3] = src[0], src[1]  # pushed back after the switch
        assert np.array_equal(f.bytes(f"prompt_switch_{i}").reshape(4, blk), want), i


SHIM_PROGRAM = """
import llm_datadist
from llm_datadist import LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, Placement
print(llm_datadist.__name__, LLMDataDist.__module__)
"""


def test_unchanged_import_needs_the_opt_in_shim(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plain = subprocess.run(
        [sys.executable, "-c", SHIM_PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )
    assert plain.returncode != 0 and "No module named 'llm_datadist'" in plain.stderr
    shim = subprocess.run(
        [sys.executable, "-m", "hixl.llm_datadist"], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    assert shim == ld.SHIM_PATH
    out = subprocess.run(
        [sys.executable, "-c", SHIM_PROGRAM],
        env={**env, "PYTHONPATH": shim},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hixl.llm_datadist", "hixl.llm_datadist._datadist"]


def _holder(cluster_id: int = 0) -> tuple[subprocess.Popen, str, int]:
    """A prompt process holding one cache: (process, its address, the cache id)."""
    p = subprocess.Popen(
        [sys.executable, str(HERE / "_lldd_holder.py"), str(cluster_id)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE,
    )
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 60)
    if not ready:
        p.kill()
        raise AssertionError("the holder did not start within 60 s")
    tag, addr, cache_id = p.stdout.readline().split()
    assert tag == "READY"
    return p, addr, int(cache_id)


def test_link_clusters_reports_each_cluster() -> None:
    """One decoder, three clusters at once (LLM-DataDist's xPyD): two prompts that are up and
    an address where nothing listens. Each gets its own status; the two linked ones serve."""
    holders = [_holder(5), _holder(6)]
    dead = free_ports(1)[0]
    d = ld.LLMDataDist(ld.LLMRole.DECODER, 1)
    try:
        cfg = ld.LLMConfig()
        cfg.enable_cache_manager = True
        d.init(cfg.generate_options())
        infos = []
        for cid, addr in ((5, holders[0][1]), (7, f"127.0.0.1:{dead}"), (6, holders[1][1])):
            info = ld.LLMClusterInfo()
            info.remote_cluster_id = cid
            ip, port = addr.rsplit(":", 1)
            info.append_remote_ip_info(ip, int(port))
            infos.append(info)
        t0 = time.monotonic()
        ret, rets = d.link_clusters(infos, 1000)
        assert time.monotonic() - t0 < 10
        s = ld.LLMStatusCode
        assert (ret, rets) == (s.LLM_LINK_FAILED, [s.LLM_SUCCESS, s.LLM_LINK_FAILED, s.LLM_SUCCESS])
        assert set(d.link_errors) == {7}
        ret, rets = d.link_clusters(infos[:1], 1000)
        assert (ret, rets) == (s.LLM_LINK_FAILED, [s.LLM_ALREADY_LINK])
        cm = d.cache_manager
        desc = ld.CacheDesc(2, [2, 4096], ld.DataType.DT_UINT8, ld.Placement.HOST)
        local = cm.allocate_cache(desc)
        for b, (cid, (_, _, cache_id)) in enumerate(zip((5, 6), holders, strict=True)):
            cm.pull_cache(ld.CacheKeyByIdAndIndex(cid, cache_id, 0), local, batch_index=b)
        for i, t in enumerate(cm.get_cache_tensors(local)):
            for b, cid in enumerate((5, 6)):
                assert t[b].tobytes() == pattern(4096, 900 + 10 * cid + i).tobytes(), (i, b)
        ret, rets = d.unlink_clusters(infos, 1000)
        assert (ret, rets) == (
            s.LLM_UNLINK_FAILED,
            [s.LLM_SUCCESS, s.LLM_NOT_YET_LINK, s.LLM_SUCCESS],
        )
    finally:
        d.finalize()
        for p, _, _ in holders:
            p.kill()
            p.wait(10)


def _decoder(addr: str, heartbeat_ms: str) -> tuple[ld.LLMDataDist, ld.LLMClusterInfo]:
    d = ld.LLMDataDist(ld.LLMRole.DECODER, 1)
    cfg = ld.LLMConfig()
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 1000
    cfg.hixl_options = {"hixl.backends": "tcp", "hixl.heartbeat_ms": heartbeat_ms}
    d.init(cfg.generate_options())
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = 0
    ip, port = addr.rsplit(":", 1)
    info.append_remote_ip_info(ip, int(port))
    assert d.link_clusters([info], 5000)[0] == ld.LLMStatusCode.LLM_SUCCESS
    return d, info


def test_pull_from_a_frozen_prompt_fails_in_time() -> None:
    holder, addr, cache_id = _holder()
    try:
        key = ld.CacheKeyByIdAndIndex(0, int(cache_id), 0)
        desc = ld.CacheDesc(2, [1, 4096], ld.DataType.DT_UINT8, ld.Placement.HOST)
        # Without heartbeats the read times out (5 s); with them (0.5 s) the link is declared
        # dead after 1.5-2 s of silence, well before. Either way the pull ends, with the code
        # of what happened.
        for heartbeat_ms, want in (
            ("0", ld.LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT),
            ("500", ld.LLMStatusCode.LLM_NOT_YET_LINK),
        ):
            d, info = _decoder(addr, heartbeat_ms)
            try:
                cm = d.cache_manager
                local = cm.allocate_cache(desc)
                cm.pull_cache(key, local)
                for i, t in enumerate(cm.get_cache_tensors(local)):
                    assert t.tobytes() == pattern(4096, 900 + i).tobytes()
                    t[:] = 0
                os.kill(holder.pid, signal.SIGSTOP)
                try:
                    # The signal lands asynchronously: pull only once the holder is stopped.
                    deadline = time.monotonic() + 5
                    while proc_state(holder.pid) != "T":
                        assert time.monotonic() < deadline, "the holder did not stop"
                        time.sleep(0.001)
                    t0 = time.monotonic()
                    assert code(cm.pull_cache, key, local) == want, heartbeat_ms
                    assert time.monotonic() - t0 < 15
                finally:
                    os.kill(holder.pid, signal.SIGCONT)
                d.unlink_clusters([info], force=True)
            finally:
                d.finalize()
    finally:
        holder.kill()
        holder.wait(10)


# -- in one process: parameters, options and codes ---------------------------------------


@pytest.fixture
def dd() -> Any:
    d = ld.LLMDataDist(ld.LLMRole.PROMPT, 3)
    cfg = ld.LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.enable_cache_manager = True
    d.init(cfg.generate_options())
    yield d
    d.finalize()


def code(fn: Any, *args: Any, **kwargs: Any) -> ld.LLMStatusCode:
    with pytest.raises(ld.LLMException) as ei:
        fn(*args, **kwargs)
    return ei.value.status_code


def test_config_options_and_status_codes() -> None:
    cfg = ld.LLMConfig()
    cfg.device_id = 1
    cfg.listen_ip_info = "10.0.0.1:26000"
    cfg.sync_kv_timeout = 2000
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = False
    cfg.mem_pool_cfg = '{"memory_size": 1024}'
    cfg.enable_switch_role = True
    cfg.local_comm_res = ""
    cfg.hixl_options = {"hixl.backends": "tcp"}
    o = cfg.generate_options()
    assert o["ge.exec.deviceId"] == "1" and o["llm.listenIpInfo"] == "10.0.0.1:26000"
    assert o["llm.SyncKvCacheWaitTime"] == "2000" and o["llm.EnableCacheManager"] == "1"
    assert o["llm.EnableRemoteCacheAccessible"] == "0" and o["llm.EnableSwitchRole"] == "1"
    assert o["llm.MemPoolConfig"] == '{"memory_size": 1024}' and o["llm.LocalCommRes"] == ""
    assert o["hixl.backends"] == "tcp"
    assert ld.LlmConfig is ld.LLMConfig
    assert ld.LLMStatusCode.LLM_NOT_YET_LINK.value == 0x5010B007
    assert ld.LLMStatusCode.LLM_SEQ_LEN_OVER_LIMIT is ld.LLMStatusCode.LLM_SEQ_LENOVERLIMIT
    assert ld.Status(ld.LLMStatusCode.LLM_SUCCESS).is_ok()
    e = ld.LLMException("x", status_code=ld.LLMStatusCode.LLM_TIMEOUT)
    assert isinstance(e, RuntimeError) and e.status_code == ld.LLMStatusCode.LLM_TIMEOUT
    # The two LayerSynchronizers are different classes with different roles.
    assert ld.LayerSynchronizer is not hixl.kv.LayerTracker
    with pytest.raises(TypeError):
        ld.LayerSynchronizer()  # type: ignore[abstract]
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = 2
    info.append_remote_ip_info("127.0.0.1", 26000)
    info.append_local_ip_info(0x7F000001, 0)
    assert info.remote_ip_info_list == [("127.0.0.1", 26000)]
    assert info.local_ip_info_list == [("127.0.0.1", 0)]
    assert code(info.append_remote_ip_info, "not-an-ip", 1) == ld.LLMStatusCode.LLM_PARAM_INVALID


def test_keys_and_descs_check_their_arguments() -> None:
    k = ld.CacheKey(prompt_cluster_id=1, req_id=2)
    assert (k.cluster_id, k.req_id, k.model_id) == (1, 2, 0)
    assert ld.CacheKey(1, 2, 3).model_id == 3
    assert ld.BlocksCacheKey(prompt_cluster_id=4, model_id=1).cluster_id == 4
    assert code(ld.CacheKey, req_id=1) == ld.LLMStatusCode.LLM_PARAM_INVALID
    assert code(ld.CacheKey, 1, 2, bad=3) == ld.LLMStatusCode.LLM_PARAM_INVALID
    assert code(ld.CacheKeyByIdAndIndex, -1, 0) == ld.LLMStatusCode.LLM_PARAM_INVALID
    d = ld.CacheDesc(2, [4, 8], ld.DataType.DT_BF16, ld.Placement.HOST)
    assert d.size == 64 and d.batch_size == 4 and d.placement == ld.Placement.HOST
    assert code(ld.CacheDesc, 0, [4], ld.DataType.DT_FLOAT) == ld.LLMStatusCode.LLM_PARAM_INVALID
    assert code(ld.CacheDesc, 1, [4, 0], ld.DataType.DT_FLOAT) == ld.LLMStatusCode.LLM_PARAM_INVALID
    assert code(ld.TransferWithCacheKeyConfig, k) == ld.LLMStatusCode.LLM_PARAM_INVALID
    cfg = ld.TransferConfig(1, [0x1000, 0x2000], range(0, 1))
    assert cfg.dst_addrs == [0x1000, 0x2000]
    assert code(ld.TransferConfig, 1, [0]) == ld.LLMStatusCode.LLM_PARAM_INVALID


def test_cache_manager_in_one_process(dd: ld.LLMDataDist) -> None:
    cm = dd.cache_manager
    assert code(lambda: dd.kv_cache_manager) == ld.LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    dev = ld.CacheDesc(2, [4, 8], ld.DataType.DT_FLOAT16)  # Placement.DEVICE by default
    with pytest.raises(ld.LLMException, match="Placement.DEVICE") as ei:
        cm.allocate_cache(dev)
    assert ei.value.status_code == ld.LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    desc = ld.CacheDesc(2, [4, 8], ld.DataType.DT_FLOAT16, ld.Placement.HOST)
    a = cm.allocate_cache(desc, [ld.CacheKey(3, req_id=1)])
    b = cm.allocate_cache(desc)
    assert a.cache_id != b.cache_id and len(a.tensor_addrs) == 2
    assert code(cm.allocate_cache, desc, [ld.CacheKey(3, req_id=1)]) == (
        ld.LLMStatusCode.LLM_PARAM_INVALID
    )  # a key names one cache
    ta, tb = cm.get_cache_tensors(a), cm.get_cache_tensors(b)
    assert ta[0].shape == (4, 8) and ta[0].dtype == np.float16
    for t in ta:
        t[:] = np.arange(32, dtype=np.float16).reshape(4, 8)
    # create_tensors (Ascend: create_npu_tensors) views the same memory, in any dtype form.
    for dt in (ld.DataType.DT_FLOAT16, "float16", np.float16):
        v = ld.create_tensors([4, 8], dt, a.tensor_addrs)
        assert v[1].dtype == np.float16 and np.shares_memory(v[1], ta[1])
    assert ld.create_tensors([4, 8], ld.DataType.DT_BF16, a.tensor_addrs)[0].dtype == np.uint16
    assert code(ld.create_tensors, [4], "no-such-type", a.tensor_addrs) == (
        ld.LLMStatusCode.LLM_PARAM_INVALID
    )
    cm.copy_cache(b, a, dst_batch_index=3, src_batch_index=1, offset=4, size=8)
    assert np.array_equal(tb[1][3, 2:6], ta[1][1, 2:6]) and not tb[1][3, :2].any()
    assert code(cm.copy_cache, b, a, 0, 4) == ld.LLMStatusCode.LLM_PARAM_INVALID
    # Pushes need enable_remote_cache_accessible; pulls from an unlinked cluster fail.
    key = ld.CacheKeyByIdAndIndex(9, 1, 0)
    assert code(cm.push_cache, key, a) == ld.LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert code(cm.pull_cache, key, b) == ld.LLMStatusCode.LLM_NOT_YET_LINK
    assert code(cm.remap_registered_memory, []) == ld.LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    # Linking a cluster that is not there: a status per cluster, within the timeout.
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = 9
    info.append_remote_ip_info("127.0.0.1", 1)
    t0 = time.monotonic()
    ret, rets = dd.link_clusters([info], 500)
    assert time.monotonic() - t0 < 5
    assert (ret, rets) == (ld.LLMStatusCode.LLM_LINK_FAILED, [ld.LLMStatusCode.LLM_LINK_FAILED])
    assert 9 in dd.link_errors
    many = [info] * 17
    assert dd.link_clusters(many, 500)[0] == ld.LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
    # deallocate_cache waits for the cache's keys; removing the last key releases it.
    cm.deallocate_cache(a)
    assert a._valid
    cm.remove_cache_key(ld.CacheKey(3, req_id=1))
    assert not a._valid
    cm.deallocate_cache(b)
    assert not b._valid
    with pytest.raises(ld.LLMException):
        cm.get_cache_tensors(b)


def test_switch_role_to_a_busy_address_keeps_the_instance(dd: ld.LLMDataDist) -> None:
    cm = dd.cache_manager
    desc = ld.CacheDesc(1, [2, 64], ld.DataType.DT_UINT8, ld.Placement.HOST)
    a = cm.allocate_cache(desc)
    cm.get_cache_tensors(a)[0][:] = 7
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ld.LLMException, match=str(port)):
            dd.switch_role(ld.LLMRole.DECODER, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    assert dd.role == ld.LLMRole.PROMPT
    b = cm.allocate_cache(desc)  # still usable, its caches still there
    cm.copy_cache(b, a, dst_batch_index=1, src_batch_index=0)  # entry 0 of a into entry 1
    assert (cm.get_cache_tensors(b)[0][1] == 7).all() and not cm.get_cache_tensors(b)[0][0].any()
    dd.switch_role(ld.LLMRole.DECODER)
    assert dd.role == ld.LLMRole.DECODER


def test_one_instance_per_process_and_finalize(dd: ld.LLMDataDist) -> None:
    other = ld.LLMDataDist(ld.LLMRole.DECODER, 4)
    assert code(other.init, {}) == ld.LLMStatusCode.LLM_FAILED
    cm = dd.cache_manager
    dd.finalize()
    desc = ld.CacheDesc(1, [4], ld.DataType.DT_UINT8, ld.Placement.HOST)
    assert code(cm.allocate_cache, desc) == ld.LLMStatusCode.LLM_ENGINE_FINALIZED
    assert not cm.is_initialized()
    dd.finalize()  # idempotent


def test_the_applications_notifications_stay_for_it(dd: ld.LLMDataDist) -> None:
    """The node's thread takes only its own names (hello, bye, release) from the engine:
    the application's notifications, sent by another engine around a hello, all reach the
    application's wait_notifies on `dd.engine`, in order, and the hello is still applied."""
    app = [(f"app.{i % 3}", f"msg {i}") for i in range(30)]
    hello = ("hixl.lldd.hello", '{"cluster": 9, "address": "127.0.0.1:1"}')
    pairs = [p for n in (*app[:15], hello, *app[15:]) for p in n]
    sender = send_from_own_engine(dd.local_address, *pairs)
    got = collect(dd.engine, len(app))
    assert [(n.name, n.msg) for n in got] == app
    assert {n.peer for n in got} == {sender}
    node = dd._node
    assert node is not None
    deadline = time.monotonic() + 5
    while node.routes.get(9) != sender:
        assert time.monotonic() < deadline, f"the hello was not applied: {node.routes}"
        time.sleep(0.01)
    assert dd.engine.get_notifies() == []


def test_pull_blocks_reports_mismatched_block_lists_before_the_link(dd: ld.LLMDataDist) -> None:
    """Issue 35, item 15: mismatched src/dst block lists are a PARAM_INVALID naming the
    lengths, even while the cluster is not linked (the link error used to hide it)."""
    cm = dd.cache_manager
    desc = ld.CacheDesc(4, [2, 64], ld.DataType.DT_UINT8, ld.Placement.HOST)
    blocks = cm.allocate_blocks_cache(desc)
    key = ld.BlocksCacheKey(9, 0)
    with pytest.raises(ld.LLMException, match="2 source blocks but 1 destination") as ei:
        cm.pull_blocks(key, blocks, src_blocks=[0, 1], dst_blocks=[2])
    assert ei.value.status_code == ld.LLMStatusCode.LLM_PARAM_INVALID
    assert code(cm.pull_blocks, key, blocks, [0], [2]) == ld.LLMStatusCode.LLM_NOT_YET_LINK
    cm.deallocate_blocks_cache(blocks)
