"""`hixl demo`: two processes, a layerwise KV push, tokens compared with one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DEMO = [
    sys.executable,
    "-m",
    "hixl.cli",
    "demo",
    "--layers",
    "4",
    "--prompt-len",
    "96",
    "--tokens",
    "8",
    "--json",
]


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DEMO, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_demo_tokens_match_one_process(transport: str, head_dim: int) -> None:
    r = demo("--transport", transport, "--head-dim", str(head_dim))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["identical"] and d["tokens"] == d["reference"] and len(d["tokens"]) == 8
    assert d["transport"] == transport
    assert d["head_row_stride"] == (128 if head_dim == 64 else 256)
    # 4 layers x K/V x 6 blocks of 16 tokens x 8 heads x padded row
    assert d["kv_bytes"] == d["kv_bytes_received"] == 4 * 2 * 6 * 16 * 8 * d["head_row_stride"]
    t = d["timeline"]
    assert [row["layer"] for row in t] == [0, 1, 2, 3]
    for row in t:
        # a layer is used only after it arrived, and arrives only after it was computed
        assert row["computed_ms"] <= row["submitted_ms"] <= row["acked_ms"]
        assert row["submitted_ms"] <= row["arrived_ms"] <= row["used_ms"]
    # Decode started on layer 0 before prefill had computed the last layer.
    assert t[0]["used_ms"] < t[-1]["computed_ms"]


def test_demo_catches_a_wrong_kv_layer() -> None:
    r = demo("--transport", "tcp", env={"HIXL_DEMO_CORRUPT": "1"})
    assert r.returncode == 1
    assert "MISMATCH at generated token" in r.stderr
    assert json.loads(r.stdout)["first_mismatch"] is not None
