"""Attacks on etcd discovery by whoever may write etcd (docs/RELIABILITY.md, "etcd trust
model"), against a real etcd server and real rank processes (tests/_kv_worker.py): a forged
entry re-pointing rank 1 at an attacker's address, with and without a cluster secret, and an
etcd password given in the discovery URL, which must never be shown.

Needs `etcd` (Debian: etcd-server); skips with the reason otherwise (`.ci/run` installs it)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_discovery import SECRET, TTL, Etcd, Rank, alloc, digest, etcd_local, free_port

import hixl
from hixl.kv import LLM_NOT_LINKED
from hixl.kv._context import context
from hixl.kv._etcd import EtcdClient, b64, unb64

__all__ = ["etcd_local"]  # a fixture of test_discovery.py, used here


class Attacker:
    """The address a forger points rank 1 at: a TCP listener that counts who dials it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.dialled = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.dialled += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    yield a
    a.close()


def forge(c: EtcdClient, key: bytes, value: bytes, lease: int) -> None:
    """What anyone with etcd write access can do: put any value under a rank's key."""
    body = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    c.call("kv/put", body)


def read(c: EtcdClient, key: bytes) -> tuple[bytes, int] | None:
    """The key's value and its lease (0: none), as etcd has them; None when absent."""
    kvs = c.call("kv/range", {"key": b64(key)}).get("kvs", [])
    return (unb64(kvs[0].get("value", "")), int(kvs[0].get("lease", 0))) if kvs else None


def wait_republished(c: EtcdClient, key: bytes, real: bytes, lease: int, bound_s: float) -> float:
    """Waits until `key` holds the real rank's entry again, attached to its lease; the time it
    took (fails after `bound_s`)."""
    t0, address = time.monotonic(), json.loads(real)["address"]
    while True:
        got = read(c, key)
        if got is not None and got[1] == lease and json.loads(got[0])["address"] == address:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < bound_s, (
            f"rank 1 did not write its entry back within {bound_s} s: {key!r} holds {got}"
        )
        time.sleep(0.02)


def rank1_address(r0: Rank) -> str | None:
    return next((a for rank, _, a in r0.ok("ranks")["ranks"] if rank == 1), None)


def test_forged_entry_is_ignored_with_a_secret(
    etcd_local: Etcd, attacker: Attacker, tmp_path: Path
) -> None:
    """With a cluster secret, entries re-pointing rank 1 at an attacker (no lease; the
    attacker's own lease; rank 1's real lease, read from etcd) are ignored and logged once
    each; rank 0's pushes keep reaching the real rank 1 (bytes compared), nobody dials the
    attacker, and the secret is nowhere in etcd or the log."""
    url = f"{etcd_local.url}/forge-a"
    key = b"/forge-a/ranks/1"
    log0 = tmp_path / "rank0.log"
    r1 = Rank(None, 0, 1, "decoder", url)
    with log0.open("wb") as err:
        r0 = Rank(None, 0, 0, "prompt", url, stderr=err)
    try:
        r0.wait_ranks([1], 10)
        alloc(r0, "kv", 1)
        alloc(r1, "kv", None)
        r0.ok("push", ranks=[1], name="kv")  # linked to the real rank 1
        assert digest(r1, "kv") == digest(r0, "kv")

        c = EtcdClient([("127.0.0.1", etcd_local.port)])
        got = read(c, key)
        assert got is not None and got[1] != 0, got
        real, real_lease = got
        entry = json.loads(real)
        forged = json.dumps({**entry, "address": attacker.address}).encode()
        own_lease, _ = c.grant(60)
        refusal = "ignoring the entry under '/forge-a/ranks/1'"
        for n, lease in enumerate((0, own_lease, real_lease), start=1):
            forge(c, key, forged, lease)
            deadline = time.monotonic() + 10
            while log0.read_text().count(refusal) < n:  # rank 0 has seen it
                assert rank1_address(r0) != attacker.address, (
                    f"a forged entry (lease {lease}) re-pointed rank 1 at the attacker"
                )
                assert time.monotonic() < deadline, log0.read_text()[-2000:]
                time.sleep(0.02)
            assert rank1_address(r0) == r1.address
            wait_republished(c, key, real, real_lease, TTL)
            alloc(r0, f"kv{n}", 10 + n)  # new bytes, pushed after the forgery
            alloc(r1, f"kv{n}", None)
            r0.ok("push", ranks=[1], name=f"kv{n}")
            assert digest(r1, f"kv{n}") == digest(r0, f"kv{n}")
        assert attacker.dialled == 0
        assert "mac" in entry, entry  # the real entry is MACed (never with the secret itself)
        text = log0.read_text()
        assert text.count(refusal) == 3, text  # once per forgery, never per read
        view, _ = c.range_prefix(b"/forge-a/")
        assert all(SECRET.encode() not in v for v in view.values()), view
        assert SECRET not in text
    finally:
        r0.close()
        r1.close()


def test_forged_entry_without_a_secret_is_written_back(
    etcd_local: Etcd, attacker: Attacker
) -> None:
    """Without a secret entries cannot be authenticated, but the real rank 1 writes its own
    entry back within the TTL after a forged one (attached to the attacker's own lease, or to
    none), and rank 0's next push reaches it."""
    url = f"{etcd_local.url}/forge-b"
    key = b"/forge-b/ranks/1"
    no_secret = {"HIXL_SECRET": ""}
    r1 = Rank(None, 0, 1, "decoder", url, env=no_secret)
    r0 = Rank(None, 0, 0, "prompt", url, env=no_secret)
    try:
        r0.wait_ranks([1], 10)
        c = EtcdClient([("127.0.0.1", etcd_local.port)])
        got = read(c, key)
        assert got is not None and got[1] != 0, got
        real, real_lease = got
        forged = json.dumps({**json.loads(real), "address": attacker.address}).encode()
        own_lease, _ = c.grant(60)
        for n, lease in enumerate((own_lease, 0), start=1):
            forge(c, key, forged, lease)
            took = wait_republished(c, key, real, real_lease, TTL)
            print(f"etcd: rank 1 wrote its entry back {took * 1000:.0f} ms after a forgery")
            deadline = time.monotonic() + 10
            while rank1_address(r0) != r1.address:
                assert time.monotonic() < deadline, r0.ok("ranks")
                time.sleep(0.02)
            alloc(r0, f"kv{n}", 20 + n)
            alloc(r1, f"kv{n}", None)
            r0.ok("push", ranks=[1], name=f"kv{n}")
            assert digest(r1, f"kv{n}") == digest(r0, f"kv{n}")
    finally:
        r0.close()
        r1.close()


def test_forged_entry_cannot_keep_a_dead_rank_alive(etcd_local: Etcd, attacker: Attacker) -> None:
    """A forged entry put over a rank's key just after the rank died detaches the key from
    the dead rank's lease, so etcd would never delete it: rank 0 still drops rank 1 once that
    lease has ended (within the TTL and one keepalive period), and never uses the forgery."""
    url = f"{etcd_local.url}/forge-d"
    key = b"/forge-d/ranks/1"
    r1 = Rank(None, 0, 1, "decoder", url)
    r0 = Rank(None, 0, 0, "prompt", url)
    try:
        r0.wait_ranks([1], 10)
        alloc(r0, "kv", 4)
        alloc(r1, "kv", None)
        r0.ok("push", ranks=[1], name="kv")  # linked
        c = EtcdClient([("127.0.0.1", etcd_local.port)])
        got = read(c, key)
        assert got is not None, key
        forged = json.dumps({**json.loads(got[0]), "address": attacker.address}).encode()
        t0 = time.monotonic()
        os.kill(r1.proc.pid, signal.SIGKILL)
        forge(c, key, forged, 0)
        gone = r0.wait_ranks([], TTL + 5) - t0
        print(f"etcd: a dead rank under a forged entry left the view {gone:.2f} s after SIGKILL")
        assert gone <= TTL + 2, f"rank 1 left {gone:.2f} s after it died (TTL {TTL} s)"
        assert read(c, key) == (forged, 0)  # etcd still holds the forgery: rank 0 chose
        out = r0.call("push", ranks=[1], name="kv")
        assert not out["ok"] and out["status_code"] == LLM_NOT_LINKED, out
        assert attacker.dialled == 0
    finally:
        r0.close()
        r1.close()


def test_etcd_password_in_the_url_is_never_shown(
    etcd_local: Etcd, caplog: pytest.LogCaptureFixture
) -> None:
    """A password in etcd://user:PASSWORD@... is in no error (etcd down, a bad endpoint, a
    wrong password), no log line (etcd lost while running, finalize) and no repr or stats."""
    caplog.set_level(logging.DEBUG, logger="hixl")
    pw = "pw-" + secrets.token_hex(8)
    shown: list[str] = []

    def refused(exc: type[Exception], url: str) -> None:
        with pytest.raises(exc) as err:
            hixl.kv.init(cluster_id=0, discovery=url)
        shown.append(str(err.value))
        assert "root:***@" in str(err.value), str(err.value)

    down = free_port("127.0.0.1")  # nothing listens there
    refused(hixl.NotConnected, f"etcd://root:{pw}@127.0.0.1:{down}/red")
    refused(hixl.ParamInvalid, f"etcd://root:{pw}@127.0.0.1:99999/red")
    refused(hixl.ParamInvalid, f"consul://root:{pw}@127.0.0.1:{down}/red")

    e = etcd_local
    admin = EtcdClient([("127.0.0.1", e.port)])
    admin.call("auth/user/add", {"name": "root", "password": pw})
    admin.call("auth/user/grant", {"user": "root", "role": "root"})
    admin.call("auth/enable", {})
    with pytest.raises(hixl.NotConnected, match="authentication failed") as err:
        hixl.kv.init(cluster_id=0, discovery=f"etcd://root:{pw}x@127.0.0.1:{e.port}/red")
    shown.append(str(err.value))

    ttl = {"hixl.discovery.ttl_s": str(TTL)}
    hixl.kv.init(cluster_id=3, discovery=f"etcd://root:{pw}@127.0.0.1:{e.port}/red", options=ttl)
    try:
        d = context().discovery
        assert d is not None
        shown += [
            repr(d.cfg),
            str(d.cfg.url),
            repr(d),
            repr(d.client),
            str(context().engine.stats()),
        ]
        e.kill()  # the lease thread finds etcd away and logs it, naming etcd
        deadline = time.monotonic() + 3 * TTL
        while "is away" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-2000:]
            time.sleep(0.05)
    finally:
        hixl.kv.finalize()  # cannot revoke: logged, naming etcd
    shown.append(caplog.text)
    assert "127.0.0.1" in caplog.text, caplog.text
    leaked = [s for s in shown if pw in s]
    assert not leaked, leaked


def test_stats_url_password_is_never_shown() -> None:
    """`hixl stats --url` with a password in the URL: the error names the URL, masked."""
    pw = "pw-" + secrets.token_hex(8)
    url = f"http://admin:{pw}@127.0.0.1:{free_port('127.0.0.1')}/metrics"
    out = subprocess.run(
        [sys.executable, "-m", "hixl", "stats", "--url", url, "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out
    assert "admin:***@127.0.0.1" in out.stderr, out.stderr
    assert pw not in out.stdout + out.stderr, out


#: values whose parsing raised something other than a refusal before hixl._peertext
HOSTILE_ENTRIES = [
    b'{"rank": 1e999, "role": "decoder", "address": "127.0.0.1:9"}',
    b'{"rank": 5, "role": "decoder", "address": "127.0.0.1:9", "device_id": 1e999}',
    b'{"rank": 5, "role": "decoder", "address": "127.0.0.1:9", "pid": NaN}',
    b'{"rank": 5, "role": "decoder", "address": "127.0.0.1:9", "caches": 7}',
    b'{"rank": 5, "role": "decoder", "address": "127.0.0.1:9", "caches": [{"a": []}]}',
    b'{"rank": 5.0, "role": "decoder", "address": "127.0.0.1:9"}',
    b'{"rank": true, "role": "decoder", "address": "127.0.0.1:9"}',
    b'{"rank": 5, "role": ["x"], "address": {"y": 1}}',
    b'{"rank": 5, "role": "decoder", "address": "127.0.0.1:9", "created": -1e999}',
    b"[" * 50_000,
    b"\xff\xfe not utf-8",
    b'"just a string"',
    b"null",
    json.dumps(
        {"rank": 5, "role": "d", "address": "127.0.0.1:9", "caches": ["c"] * 20_000}
    ).encode(),
]


def test_hostile_entries_never_stop_discovery(etcd_local: Etcd, tmp_path: Path) -> None:
    """Values no rank writes (1e999 where an integer belongs, NaN, wrong types, deep nesting,
    not UTF-8, 20000 caches) put under the discovery prefix, with a lease and without: each is
    refused and logged (escaped); rank 0's watch goes on (rank 1, SIGKILLed, leaves its view
    within the TTL), and a rank started after them initializes and sees rank 0."""
    url = f"{etcd_local.url}/hostile"
    log0 = tmp_path / "rank0.log"
    r1 = Rank(None, 0, 1, "decoder", url)
    with log0.open("wb") as err:
        r0 = Rank(None, 0, 0, "prompt", url, stderr=err)
    r2 = None
    try:
        r0.wait_ranks([1], 10)
        c = EtcdClient([("127.0.0.1", etcd_local.port)])
        own_lease, _ = c.grant(60)
        keys = []
        for n, value in enumerate(HOSTILE_ENTRIES):
            key = f"/hostile/ranks/{5 + n}".encode()
            forge(c, key, value, own_lease if n % 2 == 0 else 0)
            keys.append(key)
        forge(c, b"/hostile/ranks/" + b"9" * 40, HOSTILE_ENTRIES[0], own_lease)
        deadline = time.monotonic() + 20
        while not all(f"ignoring the entry under {k.decode()!r}" in log0.read_text() for k in keys):
            assert time.monotonic() < deadline, log0.read_text()[-3000:]
            time.sleep(0.05)
        assert r0.ok("ranks")["ranks"] == [[1, "decoder", r1.address]]
        os.kill(r1.proc.pid, signal.SIGKILL)
        r0.wait_ranks([], TTL + 5)  # the watch still applies events
        r2 = Rank(None, 0, 2, "decoder", url)  # its hixl.kv.init reads all of them
        assert r2.ok("ranks")["ranks"] == [[0, "prompt", r0.address]]
        r0.wait_ranks([2], 10)
        text = log0.read_text()
        assert "\n[[[[" not in text and "\\xff\\xfe" in text  # shown escaped, never raw
        assert "Traceback" not in text, text[-3000:]
    finally:
        r0.close()
        r1.close()
        if r2 is not None:
            r2.close()


def test_dead_ranks_entry_replayed_on_its_regranted_lease_is_refused(
    etcd_local: Etcd, tmp_path: Path
) -> None:
    """Rank 1 dies and its lease expires; the attacker grants a lease with the dead one's ID
    again (etcd lets a client choose it), puts rank 1's last signed entry back on it and keeps
    it alive. Its MAC verifies (same key, lease ID, fields), but it names the create revision
    of the key it was written for, and etcd created the key again at a later one: rank 0 does
    not take rank 1 back, nor does rank 2, started after the replay."""
    url = f"{etcd_local.url}/replay"
    key = b"/replay/ranks/1"
    log0, log2 = tmp_path / "rank0.log", tmp_path / "rank2.log"
    r1 = Rank(None, 0, 1, "decoder", url)
    with log0.open("wb") as err:
        r0 = Rank(None, 0, 0, "prompt", url, stderr=err)
    r2 = None
    stop = threading.Event()
    try:
        r0.wait_ranks([1], 10)
        c = EtcdClient([("127.0.0.1", etcd_local.port)])
        got = read(c, key)
        assert got is not None and got[1] != 0, got
        value, lease = got
        os.kill(r1.proc.pid, signal.SIGKILL)
        r0.wait_ranks([], TTL + 5)
        deadline = time.monotonic() + TTL + 5
        while read(c, key) is not None:  # etcd deleted it with the lease
            assert time.monotonic() < deadline, read(c, key)
            time.sleep(0.05)
        out = c.call("lease/grant", {"ID": str(lease), "TTL": TTL})
        assert int(out["ID"]) == lease, out  # the dead rank's lease ID, granted again
        forge(c, key, value, lease)
        assert read(c, key) == (value, lease)

        def keep() -> None:
            while not stop.wait(TTL / 3):
                c.keepalive(lease)

        threading.Thread(target=keep, daemon=True).start()
        refusal = "ignoring the entry under '/replay/ranks/1'"
        deadline = time.monotonic() + 10
        while refusal not in log0.read_text():
            assert rank1_address(r0) is None, "a replayed entry brought dead rank 1 back"
            assert time.monotonic() < deadline, log0.read_text()[-2000:]
            time.sleep(0.05)
        assert rank1_address(r0) is None
        with log2.open("wb") as err:
            r2 = Rank(None, 0, 2, "decoder", url, stderr=err)
        assert r2.ok("ranks")["ranks"] == [[0, "prompt", r0.address]]
        time.sleep(TTL)  # the replay is still kept alive: it is still refused
        assert read(c, key) == (value, lease)
        assert rank1_address(r0) is None
        assert r2.ok("ranks")["ranks"] == [[0, "prompt", r0.address]]
        assert refusal in log2.read_text()
    finally:
        stop.set()
        r0.close()
        r1.close()
        if r2 is not None:
            r2.close()
