"""hixl's own vLLM KV connector (hixl.vllm.HixlConnector) between two real vLLM engines: a
prefill (kv_producer) and a decode (kv_consumer) engine, each a process of its own
(_vllm_hixl_engine.py), on a tiny random Llama. The decode reads each request's blocks
from the prefill's pool through hixl.kv, with no ``nixl`` package importable.

vLLM runs from the interpreter in HIXL_VLLM_PYTHON (default: .venv-vllm/bin/python at the
repository root, as scripts/install_vllm.sh makes it); without vLLM there these tests are
skipped with the reason. The handshake checks that need no engine run everywhere."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _hixl_link import hixl_dir

from hixl.vllm._params import (
    Handshake,
    ParamsError,
    Remote,
    Settings,
    handshake,
    parse_remote,
    produced,
)

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).parent
VLLM_PY = os.environ.get("HIXL_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
START_S = 900  # two engines starting at once on a small CI machine
STEP_S = 300


def _vllm_missing() -> str | None:
    if not Path(VLLM_PY).exists():
        return f"no vLLM interpreter at {VLLM_PY} (HIXL_VLLM_PYTHON; scripts/install_vllm.sh)"
    r = subprocess.run(
        [VLLM_PY, "-c", "import vllm, torch, transformers"], capture_output=True, timeout=300
    )
    return None if r.returncode == 0 else f"vLLM is not importable by {VLLM_PY}"


def _env() -> dict[str, str]:
    """The engines' environment: this run's own hixl (the source tree's or the wheel's) on the
    path, and nothing else of this environment."""
    path = str(hixl_dir(Path(tempfile.gettempdir()) / f"hixl-vllm-{os.getpid()}"))
    env = dict(os.environ, PYTHONPATH=path, VLLM_LOGGING_LEVEL="INFO")
    env.pop("HIXL_SECRET", None)
    return env


class Engine:
    """One _vllm_hixl_engine.py process; its stderr (vLLM's and the connector's logs) goes
    to `log`."""

    def __init__(
        self,
        role: str,
        model: Path,
        log: Path,
        extra: dict[str, Any],
        connector: str = "HixlConnector",
        extra_path: str | None = None,
        max_model_len: int = 2048,
    ) -> None:
        self.log = log
        env = _env()
        if extra_path:  # hixl.nixl's shim, for vLLM's NixlConnector (benches/vllm_pd.py)
            env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env['PYTHONPATH']}"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "5601" if role == "prefill" else "5611"
        self.p = subprocess.Popen(
            [
                VLLM_PY,
                str(HERE / "_vllm_hixl_engine.py"),
                role,
                str(model),
                json.dumps(extra),
                connector,
                str(max_model_len),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            bufsize=1,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())
        self.lines.put("")

    def line(self, timeout: float) -> str:
        try:
            got = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no answer within {timeout} s; log tail:\n{self.tail()}")
        if not got:
            pytest.fail(f"the engine ended (rc {self.p.wait()}); log tail:\n{self.tail()}")
        return got

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def generate(self, *reqs: dict[str, Any], timeout: float = STEP_S) -> list[dict[str, Any]]:
        assert self.p.stdin is not None
        self.p.stdin.write("generate " + json.dumps({"requests": list(reqs)}) + "\n")
        self.p.stdin.flush()
        reply = json.loads(self.line(timeout))
        assert "error" not in reply, reply["error"]
        return list(reply["outputs"])

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                assert self.p.stdin is not None
                self.p.stdin.write("exit\n")
                self.p.stdin.flush()
                self.p.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    why = _vllm_missing()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("vllm-hixl")
    subprocess.run([VLLM_PY, HERE / "_tiny_llama.py", d / "model"], check=True, timeout=300)
    extra = {"load_timeout_s": 20, "lease_s": 600}
    pre = Engine("prefill", d / "model", d / "prefill.log", extra)
    dec = Engine("decode", d / "model", d / "decode.log", extra)
    try:
        for e in (pre, dec):
            words = e.line(START_S).split()
            assert words[0] == "READY", words
            e.nixl = words[2]  # type: ignore[attr-defined]
        yield pre, dec
    finally:
        dec.close()
        pre.close()


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from each process's parent in /proc)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        top = todo.pop()
        kids = [c for c, p in parent.items() if p == top]
        out += kids
        todo += kids
    return out


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def _reference(pre: Engine, *prompts: list[int], n: int = 8) -> list[list[int]]:
    """Colocated generation (the prefill engine, no kv_transfer_params: no handoff)."""
    outs = pre.generate(*({"ids": p, "max_tokens": n} for p in prompts))
    return [o["tokens"] for o in outs]


def _prefill(pre: Engine, *prompts: list[int]) -> list[dict[str, Any]]:
    outs = pre.generate(
        *({"ids": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts)
    )
    for o in outs:
        assert o["kv_transfer_params"]["do_remote_prefill"] is True, o
    return [o["kv_transfer_params"] for o in outs]


@pytest.mark.parametrize("n", [33, 64, 300])
def test_decode_is_token_exact(engines: Any, n: int) -> None:
    pre, dec = engines
    prompt = _prompt(n, n)
    (ref,) = _reference(pre, prompt)
    (params,) = _prefill(pre, prompt)
    (out,) = dec.generate({"ids": prompt, "max_tokens": 8, "params": params})
    assert out["finish_reason"] == "length", out
    assert out["tokens"] == ref
    assert dec.nixl == "no-nixl" and pre.nixl == "no-nixl"


def test_kv_moved_not_recomputed(engines: Any) -> None:
    """The decode's prompt differs from the prefill's in every token but the last: only
    the prefill's KV (read from its pool) makes it generate the prefill prompt's tokens;
    recomputing would give its own prompt's."""
    pre, dec = engines
    p1 = _prompt(96, 1)
    p2 = [t + 1 if t < 511 else 1 for t in p1[:-1]] + [p1[-1]]
    ref1, ref2 = _reference(pre, p1, p2)
    assert ref1 != ref2  # the control can tell the two apart
    (params,) = _prefill(pre, p1)
    (out,) = dec.generate({"ids": p2, "max_tokens": 8, "params": params})
    assert out["tokens"] == ref1


def test_two_requests_at_once(engines: Any) -> None:
    pre, dec = engines
    a, b = _prompt(70, 7), _prompt(150, 8)
    refs = _reference(pre, a, b)
    pa, pb = _prefill(pre, a, b)
    outs = dec.generate(
        {"ids": a, "max_tokens": 8, "params": pa}, {"ids": b, "max_tokens": 8, "params": pb}
    )
    assert [o["tokens"] for o in outs] == refs


def test_local_prefix_blocks_are_not_read_again(engines: Any) -> None:
    """A decode that already holds the prompt's first 2 blocks (its own prefix cache) reads
    only the other 4 from the prefill."""
    pre, dec = engines
    head = _prompt(64, 11)
    dec.generate({"ids": head + _prompt(10, 12), "max_tokens": 1})  # fills 2 blocks locally
    prompt = head + _prompt(100, 13)  # 164 tokens: 6 blocks, the last one partial
    (ref,) = _reference(pre, prompt)
    (params,) = _prefill(pre, prompt)
    before = dec.log.read_text(errors="replace")
    (out,) = dec.generate({"ids": prompt, "max_tokens": 8, "params": params})
    assert out["tokens"] == ref
    new = dec.log.read_text(errors="replace")[len(before) :]
    assert "read 4 blocks from" in new and "(2 found locally)" in new, new[-3000:]


def test_wrong_params_fail_the_request_naming_the_field(engines: Any) -> None:
    pre, dec = engines
    prompt = _prompt(80, 21)
    (params,) = _prefill(pre, prompt)
    bad = dict(params, hixl_ranks="x")
    (out,) = dec.generate({"ids": prompt, "max_tokens": 4, "params": bad}, timeout=120)
    assert out["finish_reason"] == "error", out  # vLLM's kv_load_failure_policy="fail"
    assert "hixl_ranks" in dec.tail(20000)
    # the real params still work, and the engine is still up
    (ref,) = _reference(pre, prompt)
    (out,) = dec.generate({"ids": prompt, "max_tokens": 8, "params": params})
    assert out["tokens"] == ref


def test_tp_mismatch_is_refused_naming_both_sizes(engines: Any) -> None:
    pre, dec = engines
    prompt = _prompt(40, 31)
    (params,) = _prefill(pre, prompt)
    bad = dict(
        params,
        tp_size=2,
        hixl_addresses=params["hixl_addresses"] * 2,
        hixl_ranks=params["hixl_ranks"] * 2,
    )
    (out,) = dec.generate({"ids": prompt, "max_tokens": 4, "params": bad}, timeout=120)
    assert out["finish_reason"] == "error", out
    assert "the prefill has tp_size=2, this decode tp_size=1" in dec.tail(20000)


def test_dead_prefill_does_not_hang_the_decode(engines: Any) -> None:
    """A prefill whose engine is gone (nothing listens at its address any more): the load
    fails within load_timeout_s (20 s here) and vLLM fails the request; the engine goes on."""
    pre, dec = engines
    prompt = _prompt(50, 41)
    (params,) = _prefill(pre, prompt)
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    t0 = time.monotonic()
    (out,) = dec.generate(
        {"ids": prompt, "max_tokens": 4, "params": dict(params, hixl_addresses=[dead])},
        timeout=120,
    )
    assert out["finish_reason"] == "error", out
    assert time.monotonic() - t0 < 100
    assert "could not load its KV cache" in dec.tail(20000)


def test_killed_prefill_engine_does_not_hang_the_decode(engines: Any) -> None:
    """Last (it ends the prefill engine): a prefill engine killed after its handoff, before
    the decode reads; the decode is linked to it from the earlier tests."""
    pre, dec = engines
    first, prompt = _prompt(45, 50), _prompt(60, 51)
    (ref,) = _reference(pre, first)
    (params,) = _prefill(pre, first)
    (out,) = dec.generate({"ids": first, "max_tokens": 8, "params": params})
    assert out["tokens"] == ref  # linked to it now
    (params,) = _prefill(pre, prompt)
    tree = _descendants(pre.p.pid)  # vLLM's engine core and the worker holding the pool
    for pid in [pre.p.pid, *tree]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pre.p.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)  # reaped by init once their parents are gone
    (out,) = dec.generate({"ids": prompt, "max_tokens": 4, "params": params}, timeout=120)
    assert out["finish_reason"] == "error", out


# -- the handshake, without engines ---------------------------------------------------


def _remote(tp: int) -> Remote:
    hs = [Handshake(i, f"h:{i}", 7 + i) for i in range(tp)]
    return parse_remote(produced("req", "eng", [3, 4], 50, tp, hs, 60))


def test_handshake_refuses_a_tp_mismatch_naming_both_sizes() -> None:
    with pytest.raises(ParamsError, match=r"prefill has tp_size=2, this decode tp_size=4"):
        handshake(_remote(2), 4, 0)
    assert handshake(_remote(2), 2, 1) == ("h:1", 8)


def test_params_errors_name_the_field() -> None:
    good = produced("req", "eng", [3, 4], 50, 1, [Handshake(0, "h:0", 7)], 60)
    for key, value in [
        ("remote_block_ids", [1, "x"]),
        ("hixl_addresses", ["h:0", "h:1"]),
        ("hixl_version", 99),
        ("hixl_expires", time.time() - 1),
        ("remote_num_tokens", None),
    ]:
        with pytest.raises(ParamsError, match=key):
            parse_remote(dict(good, **{key: value}))
    with pytest.raises(ParamsError, match="remote_request_id"):
        parse_remote({k: v for k, v in good.items() if k != "remote_request_id"})


def test_extra_config_is_checked() -> None:
    assert Settings.from_extra({}).lease_s == 120.0
    assert Settings.from_extra({"listen": "10.0.0.1:9000"}).listen_for(2) == "10.0.0.1:9002"
    with pytest.raises(ValueError, match="'lease'"):
        Settings.from_extra({"lease": 3})
    with pytest.raises(ValueError, match="load_timeout_s"):
        Settings.from_extra({"load_timeout_s": 0})
    with pytest.raises(ValueError, match="listen"):
        Settings.from_extra({"listen": "nohost"})
    assert Settings.from_extra({"secret": "ab" * 32}).options()["hixl.secret"] == "ab" * 32


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
