"""The real vLLM (0.32.0, CPU build) moving KV caches over hixl: vLLM's stock NixlConnector,
unchanged, with ``import nixl`` given to hixl by the shim (docs/VLLM.md).

Given ``HIXL_VLLM_PYTHON`` (a python with vLLM, from ``scripts/install_vllm.sh``), each engine
is a ``vllm.LLM`` in a process of its own (``tests/_vllm_engine.py``) serving a tiny random
Llama (``tests/_tiny_llama.py``): a prefill engine (``kv_producer``), a decode engine
(``kv_consumer``) and a colocated one (no connector) whose greedy tokens are the reference.
A request goes to the prefill engine with ``do_remote_decode`` and one token; what it answers
in ``kv_transfer_params`` goes unchanged to the decode engine, as vLLM's toy proxy does.

vLLM's first handshake may be retried once (its metadata query has a fixed 5 s timeout that a
loaded 2-core machine can miss); that is logged, and any other failure fails the test."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from _hixl_link import hixl_dir
from _lineproc import HERE, LineProc

from hixl.nixl import shim

VLLM_PY = os.environ.get("HIXL_VLLM_PYTHON") or str(HERE.parent / ".venv-vllm" / "bin" / "python")
NEW_TOKENS = 8
#: Seconds an engine may take to start (imports, model load, warm-up) on a loaded machine.
START_S = 600
#: Seconds a generate command may take; vLLM's own timeouts are far shorter.
GEN_S = 180


def _vllm_missing() -> str:
    if not Path(VLLM_PY).exists():
        return f"no vLLM interpreter at {VLLM_PY} (HIXL_VLLM_PYTHON; scripts/install_vllm.sh)"
    try:
        r = subprocess.run(
            [VLLM_PY, "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"HIXL_VLLM_PYTHON={VLLM_PY} does not run: {e}"
    if r.stdout.strip() != "True":
        return f"vLLM is not importable by HIXL_VLLM_PYTHON={VLLM_PY}"
    return ""


_MISSING = _vllm_missing()
#: The engines start in the first test's setup: up to START_S, beyond pytest's usual 300 s.
pytestmark = [pytest.mark.skipif(bool(_MISSING), reason=_MISSING), pytest.mark.timeout(1200)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine(LineProc):
    """A ``_vllm_engine.py`` helper: one vLLM engine and its processes (one group)."""

    def __init__(
        self, role: str, model: Path, logdir: Path, connector: str = "", kv_cpus: str = ""
    ) -> None:
        self.role = role
        self.port = _free_port()
        self.log = logdir / f"{role}-{connector or 'none'}-{self.port}.log"
        path = [shim.PATH, str(hixl_dir(logdir))]
        if kv_cpus:  # tests/_vllm_site/sitecustomize.py pins vLLM's worker there instead
            path.append(str(HERE / "_vllm_site"))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(path),
            "HIXL_TEST_VLLM_KV_CPUS": kv_cpus,
            "HIXL_NIXL_SHIM": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
        }
        args: list[object] = [HERE / "_vllm_engine.py", role, model]
        if connector:
            args.append(connector)
        with open(self.log, "w") as err:
            super().__init__(args, python=VLLM_PY, env=env, stderr=err, wait=False, session=True)

    def started(self) -> Engine:
        try:
            self.await_ready(START_S)
        except BaseException:
            pytest.fail(f"{self.role} engine did not start:\n{self.tail()}")
        return self

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def generate(self, requests: list[dict], timeout: float = GEN_S) -> list[dict]:
        """Runs ``requests`` together; returns one output per request."""
        line = self.cmd("generate", json.dumps({"requests": requests}), timeout=timeout)
        assert line, f"{self.role} engine exited:\n{self.tail()}"
        reply = json.loads(line)
        assert "error" not in reply, f"{reply['error']}\n{self.tail()}"
        return reply["outputs"]

    def close(self, wait_s: float = 30) -> None:
        super().close(wait_s)


def _prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vllm")
    r = subprocess.run(
        [VLLM_PY, HERE / "_tiny_llama.py", d / "model"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def engines(work: Path):
    """The colocated reference, and a prefill and a decode engine with vLLM's pull-mode
    NixlConnector; all three start side by side."""
    started = [
        Engine("colocated", work / "model", work),
        Engine("prefill", work / "model", work, "NixlConnector"),
        Engine("decode", work / "model", work, "NixlConnector"),
    ]
    try:
        colo, pre, dec = (e.started() for e in started)
        yield _Pair(colo, pre, dec)
    finally:
        for e in started:
            e.close()


class _Pair:
    """The engines and the prefill→decode round trip, with the one allowed retry."""

    def __init__(self, colo: Engine, pre: Engine, dec: Engine) -> None:
        self.colo, self.pre, self.dec = colo, pre, dec
        self.handshaken = False

    def reference(self, prompts: list[list[int]]) -> list[list[int]]:
        outs = self.colo.generate([{"ids": p, "max_tokens": NEW_TOKENS} for p in prompts])
        return [o["tokens"] for o in outs]

    def prefill(self, prompts: list[list[int]], pre: Engine | None = None) -> list[dict]:
        outs = (pre or self.pre).generate(
            [{"ids": p, "max_tokens": 1, "params": {"do_remote_decode": True}} for p in prompts]
        )
        for o in outs:
            assert o["finish_reason"] == "length", o
            assert o["kv_transfer_params"]["do_remote_prefill"] is True, o
        return outs

    def decode(self, ids: list[list[int]], params: list[dict]) -> list[dict]:
        reqs = [
            {"ids": p, "max_tokens": NEW_TOKENS, "params": kp}
            for p, kp in zip(ids, params, strict=True)
        ]
        outs = self.dec.generate(reqs)
        if not self.handshaken and any(o["finish_reason"] == "error" for o in outs):
            log = self.dec.tail(20000)
            if "handshake" in log:
                warnings.warn(
                    "vLLM's first NIXL handshake failed and is retried once: "
                    + log[log.rfind("handshake") - 200 :][:600],
                    stacklevel=2,
                )
                outs = self.dec.generate(reqs)
        self.handshaken = True
        return outs

    def round_trip(self, prompts: list[list[int]]) -> list[dict]:
        """Prefill on one engine, decode on the other; checks each against the reference."""
        want = self.reference(prompts)
        pre = self.prefill(prompts)
        outs = self.decode(prompts, [o["kv_transfer_params"] for o in pre])
        for p, w, o, first in zip(prompts, want, outs, pre, strict=True):
            assert o["finish_reason"] == "length", (len(p), o, self.dec.tail())
            assert o["tokens"] == w, (len(p), o["tokens"], w)
            assert o["tokens"][0] == first["tokens"][0]
        return outs


@pytest.mark.parametrize("n", [40, 300, 700])
def test_decode_tokens_equal_colocated(engines: _Pair, n: int):
    # Less than one block, several blocks and a partial one, 22 blocks: the decode engine
    # pulls the prefill engine's blocks through hixl.nixl and generates exactly the
    # colocated engine's greedy tokens.
    prompt = _prompt(n, random.Random(n))
    pre = engines.prefill([prompt])[0]
    assert pre["kv_transfer_params"]["transfer_mode"] == "pull"
    assert pre["kv_transfer_params"]["remote_num_tokens"] == n
    out = engines.decode([prompt], [pre["kv_transfer_params"]])[0]
    assert out["finish_reason"] == "length", engines.dec.tail()
    assert out["tokens"] == engines.reference([prompt])[0]


def test_the_kv_cache_moved(engines: _Pair):
    # The decode engine gets prompt A's tokens with prompt B's prefill parameters; A and B
    # share only their last token. Had the decode engine computed A's cache itself it would
    # produce A's tokens; with B's blocks moved into its cache it produces B's, exactly.
    rng = random.Random(7)
    b = _prompt(300, rng)
    a = _prompt(299, rng) + [b[-1]]
    want_a, want_b = engines.reference([a, b])
    assert want_a != want_b  # the control can tell them apart
    pre_b = engines.prefill([b])[0]
    out = engines.decode([a], [pre_b["kv_transfer_params"]])[0]
    assert out["finish_reason"] == "length", engines.dec.tail()
    assert out["tokens"] == want_b
    assert out["tokens"] != want_a


def test_two_requests_in_flight(engines: _Pair):
    # Both prefills run in one batch, then both decodes load their blocks together.
    rng = random.Random(11)
    engines.round_trip([_prompt(330, rng), _prompt(520, rng)])


def test_prefill_engine_killed_before_decode(engines: _Pair, work: Path):
    # A prefill engine of its own answers, then dies (SIGKILL to it and its processes) before
    # the decode engine ever reached it. vLLM's policy (kv_load_failure_policy "fail", its
    # default) ends the request with finish_reason "error" when the handshake's 5 s timeout
    # passes; nothing hangs, and the decode engine serves the next request.
    doomed = Engine("prefill", work / "model", work, "NixlConnector").started()
    try:
        prompt = _prompt(300, random.Random(13))
        params = engines.prefill([prompt], pre=doomed)[0]["kv_transfer_params"]
        doomed.kill_group()
        assert doomed.p.poll() is not None
    finally:
        doomed.close()
    t0 = time.monotonic()
    out = engines.dec.generate([{"ids": prompt, "max_tokens": NEW_TOKENS, "params": params}])[0]
    took = time.monotonic() - t0
    assert out["finish_reason"] == "error", (out, engines.dec.tail())
    assert out["tokens"] == []
    print(
        f"decode request for a dead prefill engine ended ({out['finish_reason']}) in {took:.1f} s"
    )
    engines.round_trip([_prompt(100, random.Random(14))])


def test_pinned_as_vllm_pins_every_run_token_exact(engines: _Pair):
    # vLLM's NIXL worker pins its process (os.sched_setaffinity) to the last core of each
    # NUMA node; left so, ten round trips of 300-token prompts are all token-exact and none
    # failed.
    aff = json.loads(engines.dec.cmd("affinity", timeout=30))["cpus"]
    helper = aff.pop(str(engines.dec.p.pid))
    if len(helper) > 1:
        assert any(len(c) < len(helper) for c in aff.values()), aff  # the worker is pinned
    rng = random.Random(17)
    for _ in range(10):
        engines.round_trip([_prompt(300, rng)])


PUSH_FAILS = (
    "push mode does not finish on hixl yet: the decode engine's hixl link to the prefill "
    "engine times out ('handshake ... no answer within the timeout') while the prefill engine "
    "holds its blocks for the push, and the PUSH_REG notification fails with NOT_CONNECTED "
    "(seen with the engines' workers on separate cores, and on vLLM's shared core)"
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="push mode needs 2 CPUs here")
@pytest.mark.xfail(run=False, reason=PUSH_FAILS)
def test_push_mode(work: Path):
    """vLLM's push mode (``NixlPushConnector``: the prefill engine WRITEs into the decode
    engine's blocks once the decode engine registered them with a NIXL notification), with
    the same checks as pull mode: tokens equal colocated ones, the control, two in flight.

    Each engine's NIXL worker is pinned to a core of its own (as on two hosts) instead of
    where vLLM pins it: on one host vLLM pins both workers to the same last core, and in push
    mode the prefill engine steps without pause while it holds blocks for a push
    (``has_pending_push_work``), which starved the decode engine's handshake there (its
    ``add agent`` took 23.7 s, near the prefill's 30 s block lease). It does not pass yet
    (PUSH_FAILS); ``pytest --runxfail`` runs it."""
    last = max(os.sched_getaffinity(0))
    first = min(os.sched_getaffinity(0))
    started = [
        Engine("colocated", work / "model", work),
        Engine("prefill", work / "model", work, "NixlPushConnector", kv_cpus=str(first)),
        Engine("decode", work / "model", work, "NixlPushConnector", kv_cpus=str(last)),
    ]
    try:
        pair = _Pair(*(e.started() for e in started))
        rng = random.Random(19)
        for n in (40, 300, 700):
            prompt = _prompt(n, rng)
            pre = pair.prefill([prompt])[0]
            assert pre["kv_transfer_params"]["transfer_mode"] == "push"
            out = pair.decode([prompt], [pre["kv_transfer_params"]])[0]
            assert out["finish_reason"] == "length", pair.dec.tail()
            assert out["tokens"] == pair.reference([prompt])[0]
        b = _prompt(300, rng)
        a = _prompt(299, rng) + [b[-1]]
        want_a, want_b = pair.reference([a, b])
        assert want_a != want_b
        out = pair.decode([a], [pair.prefill([b])[0]["kv_transfer_params"]])[0]
        assert out["tokens"] == want_b  # B's blocks were pushed into A's request
        pair.round_trip([_prompt(330, rng), _prompt(520, rng)])
    finally:
        for e in started:
            e.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
