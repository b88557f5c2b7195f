"""Discovery through a real etcd server (Debian's etcd-server package): KV ranks in their own
network namespaces, one per "host", joined by a bridge, with no address configured anywhere
but etcd's. They find each other, move caches (bytes compared), see a killed rank leave
within its TTL + 1 s, use a decoder started later, and keep their links when etcd dies.

Needs root, `ip` and `etcd`; skips with the reason otherwise (`.ci/run` installs them)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
from test_netns import _why_no_netns, sh

import hixl
from hixl.kv import LLM_NOT_LINKED
from hixl.kv._etcd import EtcdClient, EtcdError, Tls, b64

WORKER = str(Path(__file__).with_name("_kv_worker.py"))
TTL = 3  # seconds; etcd's own minimum is 2
SHAPE = [4, 2, 8, 4, 2, 32]
# The ranks listen on non-loopback addresses: authenticate the links.
SECRET = "45d95caf931b0a36ec7aa74400e9f42d"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Etcd:
    """One etcd server on `host`, its data in `data` (kept across restart())."""

    host: str
    data: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)
    #: TLS: {"ca", "cert", "key"} file paths (etcd's own cert and key, and the CA whose
    #: client certificates it requires)
    tls: dict[str, str] | None = None
    client_tls: Tls | None = None

    @property
    def url(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.host}:{self.port}"

    def start(self) -> None:
        if not self.port:
            self.port = free_port(self.host)
        peer = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        client = f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"
        self.log = self.data.with_suffix(".log")
        tls_args = []
        if self.tls:
            tls_args = [
                f"--cert-file={self.tls['cert']}",
                f"--key-file={self.tls['key']}",
                "--client-cert-auth",
                f"--trusted-ca-file={self.tls['ca']}",
            ]
        self.proc = subprocess.Popen(
            [
                "etcd",
                "--name=t",
                f"--data-dir={self.data}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=t={peer}",
                *tls_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("ab"),
        )
        c = EtcdClient([(self.host, self.port)], self.client_tls, timeout_s=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                c.status()
                return
            except EtcdError:
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                assert time.monotonic() < deadline, "etcd did not answer within 20 s"
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Hosts:
    """A bridge in the root namespace (etcd listens on it) and one namespace per host."""

    gateway: str
    names: list[str]
    ips: list[str]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    why = _why_no_netns()
    if why:
        pytest.skip(why)
    tag = os.getpid() % 100000
    octet = os.getpid() % 200 + 20
    br = f"hxbr{tag}"
    made = Hosts(f"10.{octet}.88.1", [], [])
    try:
        sh("ip", "link", "add", br, "type", "bridge")
        sh("ip", "addr", "add", f"{made.gateway}/24", "dev", br)
        sh("ip", "link", "set", br, "up")
        for i in range(5):
            ns, a, b, ip = (
                f"hixl-d{tag}-{i}",
                f"hxd{tag}{i}",
                f"hxe{tag}{i}",
                f"10.{octet}.88.{10 + i}",
            )
            sh("ip", "netns", "add", ns)
            made.names.append(ns)
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", b, "netns", ns)
            sh("ip", "link", "set", a, "master", br)
            sh("ip", "link", "set", a, "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", b)
            sh("ip", "-n", ns, "link", "set", b, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            made.ips.append(ip)
        yield made
    finally:
        for ns in made.names:
            sh("ip", "netns", "del", ns, check=False)  # takes its veth pair with it
        sh("ip", "link", "del", br, check=False)


@pytest.fixture
def etcd(tmp_path: Path, hosts: Hosts) -> Iterator[Etcd]:
    if not shutil.which("etcd"):
        pytest.skip("needs etcd (Debian: apt-get install etcd-server)")
    e = Etcd(hosts.gateway, tmp_path / "etcd")
    e.start()
    yield e
    e.kill()


class Rank:
    """A _kv_worker.py process in host `i`'s namespace, configured only by discovery."""

    def __init__(
        self,
        hosts: Hosts | None,
        i: int,
        rank: int,
        role: str,
        url: str,
        env: dict[str, str] | None = None,
        defer: bool = False,
        stderr: IO[bytes] | None = None,
    ) -> None:
        """In host `i`'s namespace, or on 127.0.0.1 in this one when `hosts` is None; its
        stderr (its log) goes to `stderr` when given."""
        ip = hosts.ips[i] if hosts else "127.0.0.1"
        env = {
            **os.environ,
            "HIXL_CLUSTER_ID": str(rank),
            "HIXL_ROLE": role,
            "HIXL_LISTEN": f"{ip}:0",
            "HIXL_PEERS": "",
            "HIXL_DISCOVERY": url,
            "HIXL_DISCOVERY_TTL_S": str(TTL),
            "HIXL_SECRET": SECRET,
            "HIXL_KV_DEFER_INIT": "1" if defer else "0",
            **(env or {}),
        }
        prefix = ["ip", "netns", "exec", hosts.names[i]] if hosts else []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.rank = rank
        tag, self.address = self.line(30).split()
        assert tag == "READY"
        assert defer or self.address.startswith(ip + ":"), self.address

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def line(self, timeout_s: float) -> str:
        try:
            out = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"rank {self.rank}: no answer in {timeout_s} s") from None
        assert out, f"rank {self.rank} exited ({self.proc.wait(5)})"
        return out

    def call(self, cmd: str, wait_s: float = 30, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.line(wait_s)))

    def ok(self, cmd: str, wait_s: float = 30, **kw: Any) -> dict[str, Any]:
        out = self.call(cmd, wait_s, **kw)
        assert out["ok"], out
        return out

    def wait_ranks(self, want: list[int], timeout_s: float, role: str | None = None) -> float:
        """Waits until this rank's view is exactly `want`; the monotonic time it was."""
        out = self.call("wait_ranks", timeout_s + 10, want=want, role=role, timeout_s=timeout_s)
        assert out["ok"], f"rank {self.rank} sees {out['ranks']}, not {want}"
        return float(out["at"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("exit", 15)
            self.proc.wait(10)
        except (OSError, ValueError, AssertionError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def etcd_local(tmp_path: Path) -> Iterator[Etcd]:
    """An etcd on 127.0.0.1 (no namespaces needed)."""
    if not shutil.which("etcd"):
        pytest.skip("needs etcd (Debian: apt-get install etcd-server)")
    e = Etcd("127.0.0.1", tmp_path / "etcd")
    e.start()
    yield e
    e.kill()


@pytest.fixture
def ranks(hosts: Hosts, etcd: Etcd) -> Iterator:
    made: list[Rank] = []

    def make(host: int, rank: int, role: str) -> Rank:
        r = Rank(hosts, host, rank, role, etcd.url + "/cluster-a")
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def digest(r: Rank, name: str) -> str:
    return str(r.ok("digest", name=name)["sha256"])


def alloc(r: Rank, name: str, seed: int | None) -> None:
    r.ok("alloc", name=name, shape=SHAPE, dtype="float16", seed=seed)


def test_one_prompt_three_decoders_find_each_other_on_separate_hosts(
    ranks, hosts: Hosts, etcd: Etcd
) -> None:
    prompt = ranks(0, 0, "prompt")
    decoders = [ranks(i, i, "decoder") for i in (1, 2, 3)]
    for r in [prompt, *decoders]:
        r.wait_ranks([x for x in (0, 1, 2, 3) if x != r.rank], 10)
    view = prompt.ok("ranks")["ranks"]
    assert view == [[d.rank, "decoder", d.address] for d in decoders]
    assert decoders[0].ok("ranks", role="prompt")["ranks"] == [[0, "prompt", prompt.address]]

    # prompt -> every decoder (links on demand), then each decoder pulls from prompt
    alloc(prompt, "kv", 7)
    alloc(prompt, "src", 8)
    for d in decoders:
        alloc(d, "kv", None)
        alloc(d, "src", None)
    assert prompt.ok("linked")["linked"] == []
    c, deadline = EtcdClient([(etcd.host, etcd.port)]), time.monotonic() + 5
    while json.loads(c.get(b"/cluster-a/ranks/0") or b"{}").get("caches") != ["kv", "src"]:
        assert time.monotonic() < deadline, c.get(b"/cluster-a/ranks/0")  # names published
        time.sleep(0.02)
    prompt.ok("push", ranks=[1, 2, 3], name="kv")
    assert prompt.ok("linked")["linked"] == [1, 2, 3]
    decoders[0].ok("link", ranks=[0])  # hixl.kv.link by rank alone: the view has the address
    assert decoders[0].ok("linked")["linked"] == [0]
    for d in decoders:
        assert digest(d, "kv") == digest(prompt, "kv")
        d.ok("pull", rank=0, name="src")
        assert digest(d, "src") == digest(prompt, "src")
        assert d.ok("linked")["linked"] == [0]


def test_killed_rank_disappears_within_ttl_and_a_new_decoder_is_used(ranks) -> None:
    prompt = ranks(0, 0, "prompt")
    d1, d2 = ranks(1, 1, "decoder"), ranks(2, 2, "decoder")
    prompt.wait_ranks([1, 2], 10)
    alloc(prompt, "kv", 3)
    for d in (d1, d2):
        alloc(d, "kv", None)
    prompt.ok("push", ranks=[1, 2], name="kv")

    t0 = time.monotonic()
    os.kill(d2.proc.pid, signal.SIGKILL)  # ip netns exec execs: this is the worker itself
    gone = prompt.wait_ranks([1], TTL + 5) - t0
    print(f"discovery: a killed rank left the view {gone:.2f} s after SIGKILL (TTL {TTL} s)")
    assert gone <= TTL + 1, f"killed rank left after {gone:.2f} s, TTL is {TTL} s"
    out = prompt.call("push", ranks=[2], name="kv")
    assert not out["ok"] and out["status_code"] == LLM_NOT_LINKED, out

    # a decoder started now, on another host, is used without restarting anyone
    t1 = time.monotonic()
    d3 = ranks(3, 3, "decoder")
    seen = prompt.wait_ranks([1, 3], 10) - t1
    print(f"discovery: a new decoder was in the view {seen:.2f} s after its process started")
    alloc(d3, "kv", None)
    prompt.ok("push", ranks=[1, 3], name="kv")
    assert digest(d3, "kv") == digest(prompt, "kv") == digest(d1, "kv")

    # a rank that finalizes leaves at once (its lease is revoked)
    t2 = time.monotonic()
    d3.ok("finalize")
    left = prompt.wait_ranks([1], 5) - t2
    print(f"discovery: a finalized rank left the view {left * 1000:.0f} ms after finalize")
    assert left < 1.0


def test_etcd_lost_later_keeps_links_working(ranks, etcd: Etcd) -> None:
    prompt = ranks(0, 0, "prompt")
    d1, d2 = ranks(1, 1, "decoder"), ranks(2, 2, "decoder")
    prompt.wait_ranks([1, 2], 10)
    alloc(prompt, "kv", 11)
    for d in (d1, d2):
        alloc(d, "kv", None)
    prompt.ok("push", ranks=[1], name="kv")  # linked to 1; 2 is known, not linked

    etcd.kill()
    time.sleep(TTL + 1)  # longer than the TTL: nobody may drop anyone for etcd's absence
    assert [r[0] for r in prompt.ok("ranks")["ranks"]] == [1, 2]
    prompt.ok("push", ranks=[1, 2], name="kv")  # the link, and a link made from the view
    assert digest(d1, "kv") == digest(d2, "kv") == digest(prompt, "kv")
    d1.ok("pull", rank=0, name="kv")

    # etcd back (same data): the view follows joins again
    etcd.start()
    d3 = ranks(3, 3, "decoder")
    prompt.wait_ranks([1, 2, 3], 15)
    alloc(d3, "kv", None)
    prompt.ok("push", ranks=[3], name="kv")
    assert digest(d3, "kv") == digest(prompt, "kv")


def test_etcd_down_at_start_is_a_clear_error() -> None:
    port = free_port("127.0.0.1")  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(hixl.NotConnected) as err:
        hixl.kv.init(cluster_id=0, role="prompt", discovery=f"etcd://127.0.0.1:{port}/x")
    took = time.monotonic() - t0
    msg = str(err.value)
    assert f"127.0.0.1:{port}" in msg and "does not answer" in msg, msg
    assert "Start etcd" in msg, msg
    assert took < 5, took
    hixl.kv.init(cluster_id=0, role="prompt")  # nothing was left behind
    hixl.kv.finalize()


def test_discovery_options_are_checked() -> None:
    with pytest.raises(hixl.ParamInvalid, match="need discovery"):
        hixl.kv.init(cluster_id=0, options={"hixl.discovery.ttl_s": "5"})
    with pytest.raises(hixl.ParamInvalid, match="unknown option 'hixl.discovery.ttl'"):
        hixl.kv.init(
            cluster_id=0, discovery="etcd://127.0.0.1:1/x", options={"hixl.discovery.ttl": "5"}
        )
    with pytest.raises(hixl.ParamInvalid, match="only etcd://"):
        hixl.kv.init(cluster_id=0, discovery="consul://127.0.0.1:8500/x")
    with pytest.raises(hixl.ParamInvalid, match="ttl_s"):
        hixl.kv.init(
            cluster_id=0, discovery="etcd://127.0.0.1:1/x", options={"hixl.discovery.ttl_s": "0"}
        )


def test_etcd_auth_and_a_rank_published_twice(etcd_local: Etcd) -> None:
    """With etcd's auth on, a rank with the password publishes itself and one without is
    refused clearly; a second process with a rank already published waits for it to expire
    (TTL + 1 s) and then says who holds it; once the holder finalizes, the rank is free."""
    e = etcd_local
    admin = EtcdClient([("127.0.0.1", e.port)])  # etcd's own auth API, over the gateway
    admin.call("auth/user/add", {"name": "root", "password": "rootpw"})
    admin.call("auth/user/grant", {"user": "root", "role": "root"})
    admin.call("auth/enable", {})
    url = f"{e.url}/auth-a"
    with pytest.raises(hixl.NotConnected, match="authentication failed"):
        hixl.kv.init(
            cluster_id=5,
            discovery=url,
            options={"hixl.discovery.user": "root", "hixl.discovery.password": "wrong"},
        )
    anon = EtcdClient([("127.0.0.1", e.port)])
    with pytest.raises(EtcdError):  # auth is really on
        anon.range_prefix(b"/auth-a/")

    opts = {
        "hixl.discovery.user": "root",
        "hixl.discovery.password": "rootpw",
        "hixl.discovery.ttl_s": str(TTL),
        "hixl.secret": SECRET,  # the workers' (with a secret, ranks check each other's entries)
    }
    hixl.kv.init(cluster_id=5, role="prompt", discovery=url, options=opts)
    try:
        auth = EtcdClient([("127.0.0.1", e.port)], user="root", password="rootpw")
        view, _ = auth.range_prefix(b"/auth-a/ranks/")
        assert json.loads(view[b"/auth-a/ranks/5"])["role"] == "prompt"

        auth_env = {"HIXL_DISCOVERY_USER": "root", "HIXL_DISCOVERY_PASSWORD": "rootpw"}
        twin = Rank(None, 0, 5, "decoder", url, env=auth_env, defer=True)
        try:
            init = {"at": 0, "cluster_id": 5, "role": "decoder", "listen": "127.0.0.1:0"}
            t0 = time.monotonic()
            out = twin.call("init", TTL + 15, peers={}, **init)
            took = time.monotonic() - t0
            assert not out["ok"] and "already published" in out["error"], out
            assert "prompt" in out["error"], out  # names the holder
            assert TTL < took < TTL + 5, took

            other = Rank(None, 0, 6, "decoder", url, env=auth_env)
            try:
                deadline = time.monotonic() + 10
                while [i.cluster_id for i in hixl.kv.ranks()] != [6]:
                    assert time.monotonic() < deadline, hixl.kv.ranks()
                    time.sleep(0.02)
                assert other.ok("ranks")["ranks"][0][:2] == [5, "prompt"]
            finally:
                other.close()
            hixl.kv.finalize()
            twin.ok("init", peers={}, **init)  # free at once: finalize revoked the lease
        finally:
            twin.close()
    finally:
        hixl.kv.finalize()


def test_etcd_restarted_without_its_data_ranks_publish_again(ranks, etcd: Etcd) -> None:
    """etcd comes back empty (a new store: the leases and keys are gone): every rank
    publishes itself again within a keepalive period, and the views follow new joins."""
    prompt = ranks(0, 0, "prompt")
    d1 = ranks(1, 1, "decoder")
    prompt.wait_ranks([1], 10)
    alloc(prompt, "kv", 5)
    alloc(d1, "kv", None)
    prompt.ok("push", ranks=[1], name="kv")

    etcd.kill()
    shutil.rmtree(etcd.data)
    etcd.start()
    t0 = time.monotonic()
    c = EtcdClient([(etcd.host, etcd.port)])
    while sorted(c.range_prefix(b"/cluster-a/ranks/")[0]) != [
        b"/cluster-a/ranks/0",
        b"/cluster-a/ranks/1",
    ]:
        assert time.monotonic() - t0 < TTL + 2, c.range_prefix(b"/cluster-a/ranks/")[0]
        time.sleep(0.05)
    print(f"discovery: both ranks published again {time.monotonic() - t0:.2f} s after etcd")

    d2 = ranks(2, 2, "decoder")
    prompt.wait_ranks([1, 2], 10)
    d2.wait_ranks([0, 1], 10)
    alloc(d2, "kv", None)
    prompt.ok("push", ranks=[1, 2], name="kv")
    assert digest(d1, "kv") == digest(d2, "kv") == digest(prompt, "kv")


def _certs(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made by openssl;
    returns etcd's files (the CA, its certificate and key)."""

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60, cwd=d)

    new = ["-newkey", "rsa:2048", "-nodes", "-days", "1"]
    ssl("req", "-x509", *new, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=hixl-ca")
    exts = {
        # etcd's JSON gateway dials etcd itself with the server certificate: clientAuth too
        "server": "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in exts.items():
        (d / f"{name}.ext").write_text(ext)
        ssl(
            "req", *new[:3], "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"
        )
        ca = ["-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1"]
        ssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            *ca,
            "-out",
            f"{name}.pem",
            "-extfile",
            f"{name}.ext",
        )
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key")}


def test_etcd_over_tls_with_a_client_certificate(tmp_path: Path) -> None:
    if not shutil.which("etcd") or not shutil.which("openssl"):
        pytest.skip("needs etcd and openssl")
    certs = _certs(tmp_path)
    client = Tls(certs["ca"], str(tmp_path / "client.pem"), str(tmp_path / "client.key"))
    e = Etcd("127.0.0.1", tmp_path / "etcd", tls=certs, client_tls=client)
    e.start()
    try:
        url = f"{e.url}/tls-a"
        with pytest.raises(hixl.NotConnected, match="does not answer"):  # etcd wants a cert
            hixl.kv.init(cluster_id=2, discovery=url, options={"hixl.discovery.ca": certs["ca"]})
        with pytest.raises(hixl.NotConnected, match="CERTIFICATE_VERIFY_FAILED"):  # not its CA
            hixl.kv.init(cluster_id=2, discovery=url)
        with pytest.raises(hixl.ParamInvalid, match="TLS"):
            hixl.kv.init(cluster_id=2, discovery=url, options={"hixl.discovery.ca": "/nonexistent"})
        opts = {
            "hixl.discovery.ca": certs["ca"],
            "hixl.discovery.cert": str(client.cert),
            "hixl.discovery.key": str(client.key),
        }
        me = hixl.kv.init(cluster_id=2, role="decoder", discovery=url, options=opts)
        try:
            view, _ = EtcdClient([("127.0.0.1", e.port)], client).range_prefix(b"/tls-a/ranks/")
            assert json.loads(view[b"/tls-a/ranks/2"])["address"] == me.address
        finally:
            hixl.kv.finalize()
        assert EtcdClient([("127.0.0.1", e.port)], client).range_prefix(b"/tls-a/")[0] == {}
    finally:
        e.kill()


def test_an_entry_removed_by_hand_is_published_again(etcd_local: Etcd) -> None:
    c = EtcdClient([("127.0.0.1", etcd_local.port)])
    key = b"/hand/ranks/4"
    me = hixl.kv.init(cluster_id=4, role="decoder", discovery=f"{etcd_local.url}/hand")
    try:
        assert json.loads(c.get(key) or b"{}").get("address") == me.address
        c.call("kv/deleterange", {"key": b64(key)})
        t0 = time.monotonic()
        while c.get(key) is None:
            assert time.monotonic() - t0 < 2, "the rank did not publish itself again"
            time.sleep(0.02)
        assert json.loads(c.get(key) or b"{}").get("address") == me.address
    finally:
        hixl.kv.finalize()
    assert c.get(key) is None  # finalize revoked the lease: the entry went with it
