"""Decode TTFT of the real vLLM on hixl: vLLM's stock NixlConnector (pull mode) through
hixl's NIXL shim, pinned as vLLM pins its worker.

    python benches/vllm_ttft.py --vllm-python .venv-vllm/bin/python [--runs 20] [--tokens 300]

Starts a colocated engine (the reference), a prefill and a decode engine of a tiny random
Llama (tests/_tiny_llama.py, tests/_vllm_engine.py), makes one warm-up round trip (vLLM's
first handshake, reported apart), then ``--runs`` prefill→decode requests of ``--tokens``-token
prompts one after another. Reports whether every run was token-exact against the colocated
engine, the failed requests, and the decode TTFT (from submitting the decode request to its
first token, as the decode engine measures it): p50 and worst. Exits 1 when a run was not
token-exact or failed."""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
NEW_TOKENS = 8


class Engine:
    """One ``tests/_vllm_engine.py`` process (its own process group)."""

    def __init__(self, py: str, role: str, model: Path, log: Path, pythonpath: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "HIXL_NIXL_SHIM": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
        }
        args = [py, str(TESTS / "_vllm_engine.py"), role, str(model)]
        if role != "colocated":
            args.append("NixlConnector")
        self.role = role
        with open(log, "w") as err:
            self.p = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                start_new_session=True,
            )

    def line(self, timeout: float) -> str:
        assert self.p.stdout is not None
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.role} engine: no answer within {timeout} s")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.role} engine exited")
        return line

    def generate(self, requests: list[dict], timeout: float = 180) -> list[dict]:
        assert self.p.stdin is not None
        self.p.stdin.write("generate " + json.dumps({"requests": requests}) + "\n")
        self.p.stdin.flush()
        reply = json.loads(self.line(timeout))
        if "error" in reply:
            raise RuntimeError(f"{self.role} engine: {reply['error']}")
        return reply["outputs"]

    def close(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(30)


def _round_trip(pre: Engine, dec: Engine, prompt: list[int]) -> dict:
    p = pre.generate([{"ids": prompt, "max_tokens": 1, "params": {"do_remote_decode": True}}])
    params = p[0]["kv_transfer_params"]
    req = {"ids": prompt, "max_tokens": NEW_TOKENS, "params": params}
    return dec.generate([req])[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="a python with vLLM 0.32.0")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    import hixl
    from hixl.nixl import shim

    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        work = Path(tmp)
        (work / "path").mkdir()
        (work / "path" / "hixl").symlink_to(Path(hixl.__file__).resolve().parent)
        pythonpath = os.pathsep.join([shim.PATH, str(work / "path")])
        subprocess.run(
            [a.vllm_python, str(TESTS / "_tiny_llama.py"), str(work / "model")],
            check=True,
            capture_output=True,
            timeout=300,
        )
        engines = [
            Engine(a.vllm_python, r, work / "model", work / f"{r}.log", pythonpath)
            for r in ("colocated", "prefill", "decode")
        ]
        try:
            for e in engines:
                if not e.line(600).startswith("READY"):
                    raise RuntimeError(f"{e.role} engine did not start")
            colo, pre, dec = engines
            rng = random.Random(a.seed)
            aff = {}
            warm = _round_trip(pre, dec, [rng.randrange(3, 512) for _ in range(a.tokens)])
            exact, failed, ttft = [], 0, []
            for _ in range(a.runs):
                prompt = [rng.randrange(3, 512) for _ in range(a.tokens)]
                want = colo.generate([{"ids": prompt, "max_tokens": NEW_TOKENS}])[0]["tokens"]
                out = _round_trip(pre, dec, prompt)
                if out["finish_reason"] != "length":
                    failed += 1
                exact.append(out["tokens"] == want)
                if out["ttft_s"] is not None:
                    ttft.append(out["ttft_s"] * 1e3)
            assert dec.p.stdin is not None
            dec.p.stdin.write("affinity\n")
            dec.p.stdin.flush()
            aff = json.loads(dec.line(30))["cpus"]
        finally:
            for e in engines:
                e.close()
    report = {
        "runs": a.runs,
        "prompt_tokens": a.tokens,
        "token_exact": all(exact),
        "failed": failed,
        "decode_ttft_ms_p50": round(statistics.median(ttft), 1) if ttft else None,
        "decode_ttft_ms_worst": round(max(ttft), 1) if ttft else None,
        "decode_ttft_ms_all": [round(t, 1) for t in ttft],
        "warmup_ttft_ms_with_handshake": round((warm["ttft_s"] or 0) * 1e3, 1),
        "decode_engine_affinity": aff,
    }
    print(json.dumps(report, indent=1))
    return 0 if report["token_exact"] and not failed and len(exact) == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
