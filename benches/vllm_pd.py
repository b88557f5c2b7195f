"""Decode TTFT and KV transfer time of vLLM's prefill/decode disaggregation on hixl: hixl's own
HixlConnector against vLLM's stock NixlConnector on hixl.nixl (hixl's NIXL face, put on the
path as ``nixl`` by its shim), both with real vLLM engines (CPU build) on one host.

    HIXL_VLLM_PYTHON=.venv-vllm/bin/python python benches/vllm_pd.py [--runs 10] [--json]

An 8-layer random Llama (hidden 256, 8 KV heads of 32) is made with transformers; each
connector gets a prefill (kv_producer) and a decode (kv_consumer) engine. For each prompt
length (300, 2000, 8000 tokens) and run: the prefill request (max_tokens=1,
do_remote_decode) runs on the prefill engine, then its kv_transfer_params go to the decode
request (max_tokens=1, a fresh prompt each run so that no prefix cache hits). Reported:
the median of the decode's TTFT (submit to first token: the KV transfer and one step) and,
for HixlConnector, of the read time its log line gives. Tokens are checked against the
prefill's (they must agree)."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
VLLM_PY = os.environ.get("HIXL_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
LENGTHS = (300, 2000, 8000)
MODEL = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(7)
cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=8448)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
"""
READ = re.compile(r"read (\d+) blocks from \S+ \(\d+ found locally\) in ([\d.]+) ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(TESTS))
    import test_vllm_connector as t  # the tests' engine driver

    t.VLLM_PY = VLLM_PY
    d = Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    subprocess.run([VLLM_PY, "-c", MODEL, str(d / "model")], check=True, timeout=600)
    shim = subprocess.run(
        [VLLM_PY, "-m", "hixl.nixl.shim"],
        capture_output=True,
        text=True,
        check=True,
        env=t._env(),
    ).stdout.strip()
    rows = []
    for name in ("HixlConnector", "NixlConnector"):
        engines = [
            t.Engine(
                role,
                d / "model",
                d / f"{name}-{role}.log",
                {},
                connector=name,
                extra_path=shim if name == "NixlConnector" else None,
                max_model_len=8448,
            )
            for role in ("prefill", "decode")
        ]
        pre, dec = engines
        try:
            for e in engines:
                assert e.line(1800).startswith("READY"), e.tail()
            for n in LENGTHS:
                ttft, reads = [], []
                for run in range(args.runs + 1):  # the first is a warm-up
                    prompt = t._prompt(n, 1000 * n + run + random.randrange(1 << 20))
                    (p,) = pre.generate(
                        {"ids": prompt, "max_tokens": 1, "params": {"do_remote_decode": True}},
                        timeout=1800,
                    )
                    before = dec.log.read_text(errors="replace")
                    t0 = time.perf_counter()
                    (o,) = dec.generate(
                        {"ids": prompt, "max_tokens": 1, "params": p["kv_transfer_params"]},
                        timeout=1800,
                    )
                    took = time.perf_counter() - t0
                    assert o["tokens"] == p["tokens"], (o, p)
                    if run:
                        ttft.append(o.get("ttft_s") or took)
                        m = READ.findall(dec.log.read_text(errors="replace")[len(before) :])
                        if m:
                            reads.append(float(m[-1][1]) / 1000)
                rows.append(
                    {
                        "connector": name,
                        "prompt": n,
                        "decode_ttft_ms": statistics.median(ttft) * 1000,
                        "kv_read_ms": statistics.median(reads) * 1000 if reads else None,
                        "runs": args.runs,
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for e in engines:
                e.close()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'connector':<15}{'prompt':>8}{'decode TTFT ms':>16}{'KV read ms':>12}")
        for r in rows:
            kvr = "-" if r["kv_read_ms"] is None else f"{r['kv_read_ms']:.1f}"
            print(f"{r['connector']:<15}{r['prompt']:>8}{r['decode_ttft_ms']:>16.1f}{kvr:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
