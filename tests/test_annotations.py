"""The public annotations and stubs accept what the calls accept at run time: a user's code
that passes int and bool option values (as the docs show), numpy integers for addresses and
lengths, descriptor rows as lists, and several notification names as any sequence type-checks
under mypy, and LLMDataDist.init reads bool option values as the engine does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import hixl
import hixl.llm_datadist as ld

#: Calls each of which works at run time (tests elsewhere run them, or the docs show them).
SNIPPET = """
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

import hixl
import hixl.aio
import hixl.kv
import hixl.llm_datadist as ld
from hixl.nixl import nixl_agent, nixl_agent_config


def options(e: hixl.Hixl) -> None:
    e.initialize("127.0.0.1:0", {"hixl.tcp.streams": 4, "hixl.strict_alignment": False})
    streams: dict[str, int] = {"hixl.tcp.streams": 4}
    e.initialize("127.0.0.1:0", streams)
    hixl.kv.init(0, options={"hixl.tcp.streams": 4, "hixl.strict_alignment": False})
    hixl.kv.init(0, options=streams)
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 0)
    dd.init({"llm.SyncKvCacheWaitTime": 5000, "llm.EnableCacheManager": True})
    dd.init(streams)
    dd.switch_role(ld.LLMRole.DECODER, {"llm.listenIpInfo": "127.0.0.1:0"})
    nixl_agent("a", nixl_agent_config(hixl_options={"hixl.tcp.streams": 4}))
    agent = nixl_agent("b", nixl_agent_config(hixl_options=streams))
    agent.create_backend("UCX", {"num_threads": 4})


def addresses(e: hixl.Hixl, remote: str, src: npt.NDArray[np.uint8]) -> None:
    base, n = np.uint64(src.ctypes.data), np.int64(8)
    e.put(remote, base, base, n)
    e.get(remote, base, base, n)
    e.put_async(remote, base, base, n).wait()
    e.put_strided(remote, base, base, hixl.StridedDesc(np.int64(2), n, 16))
    e.transfer_sync(remote, "write", [[src.ctypes.data, src.ctypes.data, 8]])
    e.transfer_sync(remote, hixl.TransferOp.WRITE, [(base, base, n)])
    e.register_mem(hixl.MemDesc(base, n))
    hixl.TransferOpDesc(base, base, n)


async def notifications(e: hixl.Hixl, names: Sequence[str]) -> None:
    e.wait_notifies(0, names)
    e.wait_notifies(0, ("a", "b"))
    await hixl.aio.wait_notifies(e, 100, names)
    await hixl.aio.put(e, "peer", np.uint64(1), np.uint64(2), np.int64(8))
"""


def test_runtime_accepted_forms_type_check(tmp_path: Path) -> None:
    src = tmp_path / "user_code.py"
    src.write_text(textwrap.dedent(SNIPPET))
    env = {**os.environ, "MYPYPATH": ""}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(src)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_llm_datadist_reads_bool_and_int_options_as_the_engine_does() -> None:
    dd = ld.LLMDataDist(ld.LLMRole.PROMPT, 0)
    dd.init(
        {
            "llm.listenIpInfo": "127.0.0.1:0",
            "llm.SyncKvCacheWaitTime": 5000,
            "llm.EnableCacheManager": True,
            "hixl.strict_alignment": False,
            "hixl.tcp.streams": 2,
        }
    )
    try:
        assert dd.cache_manager is not None  # llm.EnableCacheManager=True took
        assert dd._options["hixl.strict_alignment"] == "0"
    finally:
        dd.finalize()
    assert isinstance(hixl.Hixl(), hixl.Hixl)
