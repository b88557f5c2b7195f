"""The ``hixl`` command end to end: real processes, real transfers, parsed output."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hixl import Hixl
from hixl.cli._machine import steal_share
from hixl.cli._report import COLUMNS, MAX_WIDTH, busy_note, table, verdicts, withheld
from hixl.cli._sizes import size_label, size_ticks

HIXL = shutil.which("hixl", path=str(Path(sys.executable).parent)) or shutil.which("hixl")


def cmd(*args: str) -> list[str]:
    """The installed console script when there is one, else ``python -m hixl.cli``."""
    return [HIXL, *args] if HIXL else [sys.executable, "-m", "hixl.cli", *args]


def hixl(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_console_script_is_installed() -> None:
    assert HIXL is not None, "pip install should put a 'hixl' script next to the interpreter"


@pytest.mark.parametrize("sub", [[], ["bench"], ["info"], ["demo"], ["stats"], ["secret"]])
def test_every_subcommand_has_help(sub: list[str]) -> None:
    r = hixl(*sub, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: hixl" in r.stdout


def test_quick_json_has_every_column() -> None:
    r = hixl("bench", "--quick", "--json", "--check", "--baseline", timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # nothing but JSON on stdout
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["hixl_version"]
    rows = doc["rows"]
    ops = {(row["op"], row["transport"]) for row in rows}
    assert ops == {("write", "shm"), ("read", "shm"), ("write", "tcp"), ("read", "tcp")}
    for row in rows:
        for key, _, _ in COLUMNS:
            assert key in row, f"column {key} missing from {row}"
        assert row["check"] == "ok"
        assert row["gbps"] > 0 and row["requests"] >= 8
        assert 0 < row["lat_p50_us"] <= row["lat_p99_us"]
        # One baseline per row, its own transport's, measured once per repetition.
        assert row["baseline"] == {"shm": "cma", "tcp": "tcp"}[row["transport"]], row
        assert row["raw_gbps"] > 0 and len(row["x_raw_reps"]) == 3, row
        assert row["x_raw"] == pytest.approx(sorted(row["x_raw_reps"])[1]), row
        assert not any(k in row for k in ("memcpy_gbps", "cma_gbps", "socket_gbps")), row
        assert row["cpu_initiator_s_per_gb"] >= 0 and row["cpu_target_s_per_gb"] >= 0


@pytest.mark.parametrize(
    "mode", [[], ["--scatter", "--batch-sizes", "1,8"], ["--strided", "--batch-sizes", "4"]]
)
def test_check_passes_on_clean_runs(mode: list[str]) -> None:
    r = hixl(
        "bench",
        "--block-sizes",
        "4K,256K",
        "--transport",
        "shm,tcp",
        "--iterations",
        "6",
        "--pipeline-depth",
        "2",
        "--threads",
        "2",
        "--check",
        "--csv",
        *mode,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]]
    assert rows and all(row["check"] == "ok" for row in rows)


def test_check_catches_corruption() -> None:
    r = hixl(
        "bench",
        "--block-sizes",
        "64K",
        "--transport",
        "tcp",
        "--iterations",
        "4",
        "--check",
        "--json",
        env={"HIXL_BENCH_CORRUPT": "1"},
    )
    assert r.returncode == 1
    rows = json.loads(r.stdout)["rows"]
    assert len(rows) == 2
    for row in rows:
        assert "byte 32768 is" in row["check"] and "expected" in row["check"]
    assert r.stderr.count("check FAILED") == 2


def test_target_and_initiator_roles(free_port: int) -> None:
    addr = f"127.0.0.1:{free_port}"
    target = subprocess.Popen(
        cmd("bench", "--role", "target", "--listen", addr, "--target-mem", "8M"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert target.stdout is not None
        assert target.stdout.readline().split() == ["READY", addr]
        r = hixl(
            "bench",
            "--role",
            "initiator",
            "--remote",
            addr,
            "--block-sizes",
            "4K,1M",
            "--iterations",
            "8",
            "--check",
            "--json",
            "--transport",
            "tcp",
        )
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)["rows"]
        assert [(row["op"], row["block"]) for row in rows] == [
            ("write", 4096),
            ("write", 1 << 20),
            ("read", 4096),
            ("read", 1 << 20),
        ]
        assert all(row["check"] == "ok" and row["transport"] == "tcp" for row in rows)
        # The sweep needs more than the target holds: a clear error, not a crash.
        r = hixl(
            "bench",
            "--role",
            "initiator",
            "--remote",
            addr,
            "--block-sizes",
            "16M",
            "--iterations",
            "2",
        )
        assert r.returncode != 0 and "--target-mem" in r.stderr
    finally:
        target.send_signal(signal.SIGTERM)
        target.wait(20)
    assert target.returncode == 0


def test_a_reader_that_went_away_ends_hixl_quietly_with_141() -> None:
    """`hixl info | head -1`, or a demo parent interrupted before its worker said READY: the
    write into a closed pipe ends hixl as SIGPIPE would (141), without a traceback."""
    r_end, w_end = os.pipe()
    os.close(r_end)  # the reader is gone before hixl writes a byte
    try:
        p = subprocess.run(cmd("info"), stdout=w_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w_end)
    assert p.returncode == 141, p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr


def test_a_hixl_error_is_one_line_and_exit_1(free_port: int) -> None:
    r = hixl(
        "bench",
        "--role",
        "initiator",
        "--remote",
        f"127.0.0.1:{free_port}",
        "--block-sizes",
        "4K",
        "--iterations",
        "2",
        "--timeout-ms",
        "500",
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hixl bench: TIMEOUT"), r.stderr


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bw.png"
    r = hixl("bench", "--block-sizes", "4K,64K", "--iterations", "4", "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_marks_strided_rows_thin_p99_and_gives_a_verdict_per_group() -> None:
    r = hixl(
        "bench",
        "--transport",
        "shm,tcp",
        "--block-sizes",
        "4K,64K",
        "--batch-sizes",
        "4",
        "--strided",
        "--iterations",
        "20",
        "--baseline",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    main, second = r.stdout.split("\n\n", 1)
    rows = [line for line in main.splitlines() if line.split()[1:2] == ["strided"]]
    assert len(rows) == 8, r.stdout  # 2 ops x 2 backends x 2 sizes, each named strided
    assert all("~" in line for line in rows), "20 samples: p99 is marked as the slowest one"
    assert any(line.startswith("~ p99: fewer than 100 requests") for line in lines)
    assert all(len(line) <= MAX_WIDTH for line in lines), max(lines, key=len)
    verdicts = [line for line in lines if line.startswith("verdict ")]
    assert len(verdicts) == 4, r.stdout
    based = [line.split() for line in second.splitlines() if line.split()[1:2] == ["strided"]]
    assert len(based) == 8, second
    for w in based:
        # The baseline table: each row beside its own transport's raw path only.
        assert w[6] == {"shm": "cma", "tcp": "tcp"}[w[2]], w
    for v in verdicts:
        # Named baselines are the row's own: cma for same-host rows, tcp for tcp rows.
        named = set(re.findall(r"raw (\w+)", v))
        assert named <= {"cma" if " shm:" in v else "tcp"}, v


def _rows(ratios: dict[int, list[float]]) -> list[dict]:
    return [
        {"op": "write", "transport": "tcp", "baseline": "tcp", "block": b, "x_raw_reps": r}
        for b, r in ratios.items()
    ]


def test_verdicts_are_true_of_stable_ratios_and_withheld_from_unstable_ones() -> None:
    stable = _rows({4096: [0.5, 0.52, 0.51], 65536: [0.9, 0.92, 0.91], 1 << 20: [3.5, 3.4, 3.6]})
    (v,) = verdicts(stable)
    assert v.startswith("verdict write tcp: "), v
    # 3.5x raw TCP is above it, not "near the limit"; 0.9x is close; 0.5x below.
    assert "at or above raw tcp at 1M" in v and "within 20% of raw tcp at 64K" in v, v
    assert "below 0.8x raw tcp at 4K" in v and "limit" not in v, v
    # Repetitions that disagree by more than 10 % get no verdict, with their spread named.
    shaky = _rows({4096: [0.5, 0.9, 0.7], 65536: [1.0, 1.01, 0.99]})
    (v,) = verdicts(shaky)
    assert "no verdict at 4K (its repetitions spread 57%-57%)" in v, v
    assert "at or above raw tcp at 64K" in v and "4K," not in v, v
    assert verdicts(shaky) == verdicts(shaky), "the same ratios give the same words"


def test_the_tables_say_what_reqs_x_raw_and_spread_mean() -> None:
    """The legend once explained us and cpu only."""
    r = hixl(
        "bench", "--quick", "--transport", "tcp", "--block-sizes", "4K", "--baseline", "--json"
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    load = doc["load"]  # what the busy-machine line reads, in the JSON too
    assert load["cores"] == os.cpu_count() and len(load["loadavg"]) == 3, load
    assert load["steal_share"] is None or 0 <= load["steal_share"] <= 1, load
    text = table(doc["rows"], load)
    starts = ["reqs: requests timed", "us: microseconds", "cpu i/t: CPU seconds per GB"]
    starts += ["raw GB/s: the row's own raw path", "x raw: hixl's GB/s / raw GB/s"]
    starts += ["spread: how far those repetitions' ratios disagree"]
    lines = text.splitlines()
    for start in starts:
        assert any(line.startswith(start) for line in lines), (start, text)
    first, second = text.split("\n\n", 1)
    assert "reqs:" in first and "x raw:" not in first and "x raw:" in second
    assert all(len(line) <= MAX_WIDTH for line in lines), max(lines, key=len)


def test_a_busy_machine_is_named_when_most_verdicts_are_withheld() -> None:
    load = {"loadavg": [3.5, 2.25, 1.0], "cores": 2, "steal_share": 0.125}
    assert busy_note(1, 2, load) is None and busy_note(0, 0, load) is None
    note = busy_note(3, 4, load)
    assert note is not None and note.startswith("busy machine? 3 of 4 sizes got no verdict")
    assert "load average 3.50, 2.25, 1.00 on 2 cores; CPU steal 12.5% of the run" in note
    assert "CPU steal" not in (busy_note(2, 3, {**load, "steal_share": None}) or "")
    bare = busy_note(2, 3, {}) or ""
    assert bare.endswith("as when other work shares the CPUs; run again on a quieter machine")
    # Steal from two /proc/stat readings: user nice system idle iowait irq softirq steal.
    assert steal_share([0] * 8, [10, 0, 10, 60, 0, 0, 0, 20]) == 0.2
    assert steal_share([0] * 7, [1] * 7) is None and steal_share(None, [1] * 8) is None
    shaky = _rows({4096: [0.5, 0.9, 0.7], 65536: [1.0, 1.3, 0.9], 1 << 20: [1.0, 1.01, 0.99]})
    assert withheld(shaky) == (2, 3)
    rows = [{**r, "requests": 500, "gbps": 1.0} for r in shaky]
    text = table(rows, load)
    lines = text.splitlines()
    busy = [i for i, line in enumerate(lines) if line.startswith("busy machine? 2 of 3 sizes")]
    assert busy and busy[0] > max(i for i, ln in enumerate(lines) if ln.startswith("verdict "))
    assert all(len(line) <= MAX_WIDTH for line in text.splitlines())
    steady = [{**r, "requests": 500, "gbps": 1.0} for r in _rows({4096: [1.0, 1.01, 0.99]})]
    assert "busy machine" not in table(steady, load)


def test_plot_ticks_read_as_sizes() -> None:
    assert size_ticks([4096, 65536]) == [
        (4096, "4 KiB"), (8192, "8 KiB"), (16384, "16 KiB"), (32768, "32 KiB"), (65536, "64 KiB")
    ]  # fmt: skip
    full = size_ticks([1 << e for e in range(12, 27)])  # 4K..64M: every second power
    assert [label for _, label in full] == [
        "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"
    ]  # fmt: skip
    assert size_ticks([3000, 5000])[-1] == (8192, "8 KiB") and size_ticks([]) == []
    assert [size_label(n) for n in (512, 1536, 1 << 30, 3 << 29)] == [
        "512 B", "1.5 KiB", "1 GiB", "1.5 GiB"
    ]  # fmt: skip


def test_the_baseline_table_is_at_most_100_columns_and_one_baseline_per_row() -> None:
    row = {
        "op": "write", "strided": True, "transport": "tcp", "block": 16 << 20, "batch": 4096,
        "requests": 12345, "gbps": 123.456, "lat_avg_us": 123456.7, "lat_p50_us": 123456.7,
        "lat_p99_us": 1234567.8, "post_us": 12345.6, "cpu_initiator_s_per_gb": 12.345,
        "cpu_target_s_per_gb": 12.345, "check": "ok", "baseline": "tcp", "raw_gbps": 12.345,
        "x_raw": 10.0, "x_raw_reps": [9.0, 10.0, 11.0], "x_raw_spread": "20%",
    }  # fmt: skip
    text = table([row, {**row, "transport": "shm", "baseline": "cma"}])
    assert all(len(line) <= MAX_WIDTH for line in text.splitlines()), text
    second = text.split("\n\n", 1)[1].splitlines()
    assert second[0].split()[5:8] == ["baseline", "raw", "GB/s"], second[0]
    assert [w.split()[1:7:5] for w in second[1:3]] == [["strided", "tcp"], ["strided", "cma"]]


def test_a_sweep_of_one_4k_block_finds_its_target() -> None:
    # The target's data buffer once had the stats cell's length (4 KiB) here, and the
    # initiator could not tell them apart ("not a hixl bench target").
    r = hixl("bench", "--transport", "tcp", "--block-sizes", "4K", "--iterations", "4", "--check")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["bench", "--block-sizes", "4Q"], "'4Q'"),
        (["bench", "--op", "copy"], "'copy'"),
        (["bench", "--transport", "rdma"], "'rdma'"),
        (["bench", "--threads", "0"], "'0'"),
        (["bench", "--batch-sizes", "8-2"], "'8-2'"),
        (["bench", "--role", "initiator"], "--remote"),
        (["bench", "--option", "novalue"], "'novalue'"),
        (["bench", "--option", "hixl.bogus=1"], "hixl.bogus"),
        (["bench", "--option", "hixl.tcp.streams=0"], "hixl.tcp.streams"),
        (["bench", "--bogus"], "--bogus"),
        (["bench", "--strided", "--block-sizes", "100"], "64 bytes"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args: list[str], names: str) -> None:
    r = hixl(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert names in lines[0] and "error" in lines[0]


def _loadable(lib: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(lib)
        return True
    except OSError:
        return False


def test_info_reports_transports_and_options() -> None:
    r = hixl("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["transports"]["tcp"]["available"] is True
    assert info["transports"]["shm"]["available"] is True, info["transports"]["shm"]
    rdma = info["transports"]["rdma"]
    # libibverbs is loaded at run time: without rdma-core the wheel still imports and runs, and
    # says why RDMA is not there; with it but without a device (CI), it says that.
    if _loadable("libibverbs.so.1"):
        assert rdma["detail"].startswith(("no device", "devices:")), rdma
    else:
        assert rdma["available"] is False, rdma
        assert rdma["detail"].startswith("not loadable") and "libibverbs.so.1" in rdma["detail"]
    # GPU memory on RDMA: the path a registration would take, or every missing piece.
    gpudirect = info["transports"]["gpudirect"]
    assert gpudirect["path"].startswith(("dmabuf", "peermem", "no (missing: ")), gpudirect
    assert gpudirect["detail"].startswith(("dmabuf", "peermem", "missing: ")), gpudirect
    if not info["cuda"]["available"]:
        assert gpudirect["available"] is False, gpudirect
        assert "CUDA was" in gpudirect["detail"] and "libcuda.so.1" in gpudirect["detail"], (
            gpudirect
        )
    keys = {o["key"] for o in info["options"]}
    assert {"hixl.tcp.streams", "hixl.backends", "hixl.shm.threads"} <= keys
    assert "/" in info["host_identity"]
    text = hixl("info")
    assert text.returncode == 0 and "transports:" in text.stdout
    assert re.search(r"^  gpudirect +(yes|no ) +(dmabuf|peermem|missing: )", text.stdout, re.M), (
        text.stdout
    )


def test_info_says_once_why_cuda_was_not_found() -> None:
    """`hixl info` printed `CUDA not found: CUDA was not found: ...`."""
    from hixl.cli.info import no_cuda

    why = "CUDA was not found: libcuda.so.1 could not be loaded (no such file)"
    assert no_cuda(why) == why
    assert no_cuda("cuInit failed (999)") == "CUDA not found: cuInit failed (999)"
    text = hixl("info")
    assert text.returncode == 0, text.stderr
    assert "not found: CUDA was not found" not in text.stdout, text.stdout
    if not json.loads(hixl("info", "--json").stdout)["cuda"]["available"]:
        assert re.search(r"^CUDA (was )?not found: \S", text.stdout, re.M), text.stdout
        assert re.search(r"^  cuda_staging +no +CUDA (was )?not found: \S", text.stdout, re.M)


def test_secret_prints_a_fresh_strong_secret() -> None:
    outs = []
    for _ in range(2):
        r = hixl("secret")
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert re.fullmatch(r"[0-9a-f]{64}\n", r.stdout), repr(r.stdout)
        outs.append(r.stdout.strip())
    assert outs[0] != outs[1], "two runs printed the same secret"
    # What it prints is a secret that an engine accepts.
    with Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.secret": outs[0]})
    help_text = " ".join(hixl("secret", "--help").stdout.split())
    for words in ("hixl.secret", "HIXL_SECRET", "32 hex characters"):
        assert words in help_text, help_text


def test_stats_watches_a_running_engine_through_its_metrics_endpoint(make_peer) -> None:
    import numpy as np

    from hixl.metrics import serve

    peer = make_peer(1 << 20)
    e = Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    srv = serve(e)
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 20, np.uint8)
        e.register(src)
        for _ in range(3):
            e.put(peer.engine, src.ctypes.data, peer.addr, 1 << 20)
        r = hixl("stats", "--url", srv.url, "--watch", "0.2", "--count", "2")
        assert r.returncode == 0, r.stderr
        rows = [line for line in r.stdout.splitlines() if line.startswith(peer.engine)]
        assert len(rows) == 2, r.stdout  # two tables, one link each
        cols = rows[-1].split()
        assert cols[1:5] == ["tcp", "1", "3.15", "0.00"], rows[-1]  # 3 x 1 MiB written
        assert cols[5] == "0.0", rows[-1]  # nothing moved between the two scrapes
        bad = hixl("stats", "--url", "http://127.0.0.1:9/metrics", "--timeout", "2")
        assert bad.returncode == 1 and "cannot read http://127.0.0.1:9/metrics" in bad.stderr
    finally:
        srv.close()
        e.finalize()
