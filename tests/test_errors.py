"""Every status code Python can reach, raised by the condition that causes it; bad input is
refused with a clear message and nothing is written at the target."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest
from conftest import random_bytes

import hixl

W = hixl.TransferOp.WRITE


def wait_status(e: hixl.Hixl, peer: str, want, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = e.get_async_connect_status(peer)
        if s == want:
            return s
        time.sleep(0.005)
    raise AssertionError(f"{peer} never reached {want}, last {s}")


def test_status_enum_and_hierarchy():
    assert hixl.Status.PARAM_INVALID == 103900 and hixl.Status.FAILED == 503900
    for cls, code in [
        (hixl.ParamInvalid, 103900),
        (hixl.Timeout, 103901),
        (hixl.NotConnected, 103902),
        (hixl.AlreadyConnected, 103903),
        (hixl.NotifyFailed, 103904),
        (hixl.Unsupported, 103905),
        (hixl.ResourceExhausted, 203900),
        (hixl.Failed, 503900),
    ]:
        err = cls("x")
        assert isinstance(err, hixl.HixlError) and err.code == code


def test_every_layer_uses_the_one_definition_of_the_codes():
    """The core defines the status codes and transfer states once; the Python enums, the
    exception classes and the bindings' conversions must all agree with it."""
    from hixl import _hixl

    core = dict(_hixl.status_codes())
    assert core == {s.name: int(s) for s in hixl.Status}, "hixl.Status differs from the core"
    for name, code in core.items():
        if name == "SUCCESS":
            continue
        cls = {c.status: c for c in hixl.HixlError.__subclasses__()}[hixl.Status(code)]
        assert cls.status.name == name
    states = dict(_hixl.transfer_states())
    py_states = {n: int(getattr(hixl.TransferStatus, n)) for n in states}
    assert py_states == states, "hixl.TransferStatus differs from the core"
    assert states == {"WAITING": 0, "COMPLETED": 1, "TIMEOUT": 2, "FAILED": 3}


def test_errors_from_the_core_carry_its_codes(engine):
    """An error raised by the core reaches Python as the class of its code."""
    with pytest.raises(hixl.ParamInvalid) as e:
        engine.register_mem(hixl.MemDesc(0, 10))
    assert e.value.code == dict(hixl._hixl.status_codes())["PARAM_INVALID"]
    with pytest.raises(hixl.NotConnected) as e:
        engine.put("127.0.0.1:9", 1, 1, 1)
    assert e.value.code == dict(hixl._hixl.status_codes())["NOT_CONNECTED"]


def test_bad_ranges_are_refused_and_nothing_is_written(engine, make_peer):
    peer = make_peer(4096)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(4096, 1)
    engine.register(src)
    a, r = src.ctypes.data, peer.addr
    cases = [
        ([(a, r + 4000, 100)], "remote range"),  # past the remote region
        ([(a, r - 1, 10)], "remote range"),  # before it
        ([(a + 4000, r, 100)], "local range"),  # past the local region
        ([(a, r, 10), (a, r + 10, 0)], "descriptor 1: length is 0"),
        ([(a, r, 10), (a + 1, r + 8192, 1)], "descriptor 1"),  # one bad descriptor refuses all
        ([], "empty"),
    ]
    for descs, words in cases:
        with pytest.raises(hixl.ParamInvalid) as ei:
            engine.transfer_sync(peer.engine, W, descs)
        assert ei.value.code == 103900 and words in str(ei.value), str(ei.value)
    assert not peer.read().any(), "nothing was written"


def test_wrong_types_and_negative_sizes(engine):
    with pytest.raises(hixl.ParamInvalid, match="length=-5"):
        hixl.TransferOpDesc(1, 2, -5)
    with pytest.raises(hixl.ParamInvalid, match="local_addr must be an int"):
        hixl.TransferOpDesc("a", 2, 3)
    with pytest.raises(hixl.ParamInvalid, match="addr=-1"):
        hixl.MemDesc(-1, 10)
    with pytest.raises(hixl.ParamInvalid, match=r"descs\[0\]"):
        engine.transfer_sync("127.0.0.1:1", W, ["nope"])
    with pytest.raises(hixl.ParamInvalid, match="shape"):
        engine.transfer_sync("127.0.0.1:1", W, np.zeros((2, 2), np.uint64))
    with pytest.raises(hixl.ParamInvalid, match="uint64"):
        engine.transfer_sync("127.0.0.1:1", W, np.zeros((2, 3), np.float32))
    with pytest.raises(hixl.ParamInvalid, match="timeout_ms=-1"):
        engine.connect("127.0.0.1:1", timeout_ms=-1)


def test_registration_errors(engine):
    buf = np.zeros(4096, np.uint8)
    h = engine.register(buf)
    assert (h.addr, h.len) == (buf.ctypes.data, 4096)
    assert engine.register_mem(hixl.MemDesc(h.addr, 4096)).id == h.id, "same range, same handle"
    with pytest.raises(hixl.ParamInvalid, match="overlaps"):
        engine.register_mem(hixl.MemDesc(h.addr + 100, 4096))
    with pytest.raises(hixl.ParamInvalid, match="null"):
        engine.register_mem(hixl.MemDesc(0, 10))
    with pytest.raises(hixl.ParamInvalid, match="len=0"):
        engine.register_mem(hixl.MemDesc(h.addr + 8192, 0))
    with pytest.raises(hixl.ParamInvalid, match="bytes"):
        engine.register(b"read-only bytes")
    with pytest.raises(hixl.Unsupported):
        engine.register_mem(hixl.MemDesc(1 << 40, 10), hixl.MemType.DEVICE)
    engine.deregister_mem(h)
    engine.deregister_mem(h)  # idempotent


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("hixl.transport", None),
        ("hixl.streams", "hixl.tcp.streams"),
        ("hixl.coalesce_us", "hixl.tcp.coalesce_us"),
        ("hixl.coalesce_max_ops", "hixl.tcp.coalesce_max_ops"),
        ("hixl.shm_threads", "hixl.shm.threads"),
    ],
)
def test_an_old_option_key_is_an_unknown_key(old: str, new: str | None) -> None:
    """The keys the backends' own keys replaced have no alias: each is refused, naming it and
    (where one is close) its current key; hixl.backends is in the list of known keys."""
    with hixl.Hixl() as e:
        with pytest.raises(hixl.ParamInvalid) as got:
            e.initialize("127.0.0.1", {old: "tcp" if old == "hixl.transport" else "2"})
    msg = str(got.value)
    hint = f' (did you mean "{new}"?)' if new else ""
    assert f'unknown option key "{old}"{hint}; known keys: hixl.backends,' in msg, msg
    assert old not in {k for k, _, _ in hixl.option_keys()}


def test_options_are_checked():
    e = hixl.Hixl()
    with pytest.raises(hixl.ParamInvalid, match='"hixl.nope"'):
        e.initialize("127.0.0.1", {"hixl.nope": "1"})
    with pytest.raises(hixl.ParamInvalid, match='hixl.tcp.streams="0"'):
        e.initialize("127.0.0.1", {"hixl.tcp.streams": "0"})
    with pytest.raises(hixl.ParamInvalid, match="cannot listen"):
        e.initialize("8.8.8.8:1")
    keys = {k for k, _, _ in hixl.option_keys()}
    assert "hixl.tcp.streams" in keys and "hixl.transfer_timeout_ms" in keys


@pytest.mark.parametrize(
    "weak",
    [
        "summer2024",  # a password: guessed offline in 117 tries in the security review
        "0123456789abcdef0123456789abcde",  # 31 hex characters: one short
        "correct-horse-battery-staple-not-hex-40c",  # 40 characters, not hex
        # Patterned: 32+ hex characters, but one AuthChallenge is an offline oracle for them.
        "0" * 32,  # one character repeated
        "deadbeef" * 4,  # a word repeated
        "3f" * 32,  # 64 characters, a block of 2
        "00112233445566778899aabbccddeeff",  # its steps (0, 1, 0, 1, ...) repeat
        "0123456789abcdefABCDEF0123456789",  # counting up: 2 different steps
        "0" * 31 + "1",  # 2 different characters
        "20261202" + "31415926535897932384626433",  # 34 digits: under 128 bits
    ],
)
@pytest.mark.parametrize("via", ["option", "env"])
def test_weak_secrets_are_refused(weak: str, via: str, monkeypatch: pytest.MonkeyPatch):
    options = {"hixl.secret": weak} if via == "option" else {}
    if via == "env":
        monkeypatch.setenv("HIXL_SECRET", weak)
    with hixl.Hixl() as e, pytest.raises(hixl.ParamInvalid, match="hixl secret") as ei:
        e.initialize("127.0.0.1", options)
    assert ei.value.code == 103900 and weak not in str(ei.value), str(ei.value)


@pytest.mark.parametrize(
    "strong",
    # 32 (mixed case) and 64 random hex characters (`hixl secret`), and 39 digits (> 128 bits)
    [
        "A0a05abe5918446A7cb7c05dee7d2866",
        "d9eed47fb14091f5b40a1e06d007badf7f8199a099a322a195ea29ec1fd7e2c9",
        "314159265358979323846264338327950288419",
    ],
)
def test_strong_secrets_are_accepted(strong: str):
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.secret": strong})


def test_connect_timeout_and_not_connected(engine):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    t0 = time.monotonic()
    with pytest.raises(hixl.Timeout) as ei:
        engine.connect(dead, timeout_ms=200)
    assert time.monotonic() - t0 < 3 and dead in str(ei.value) and ei.value.code == 103901
    with pytest.raises(hixl.NotConnected, match="not connected to 127.0.0.1:9"):
        engine.transfer_sync("127.0.0.1:9", W, [(1, 2, 3)])
    with pytest.raises(hixl.NotConnected):
        engine.disconnect("127.0.0.1:9")
    with pytest.raises(hixl.ParamInvalid, match="not-an-address"):
        engine.connect("not-an-address")


def test_dead_peer_not_connected_and_notify_failed(engine, make_peer):
    peer = make_peer(4096)
    engine.connect(peer.engine, timeout_ms=5000)
    src = np.zeros(4096, np.uint8)
    engine.register(src)
    peer.proc.kill()
    peer.proc.wait(10)
    wait_status(engine, peer.engine, hixl.AsyncConnectStatus.CONNECT_FAILED)
    with pytest.raises(hixl.NotConnected, match="died"):
        engine.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, 16)])
    with pytest.raises(hixl.NotifyFailed) as ei:
        engine.send_notify(peer.engine, hixl.NotifyDesc("n", "m"))
    assert ei.value.code == 103904


def test_transfer_timeout_and_ctrl_c(engine, make_peer):
    size = 64 << 20
    peer = make_peer(size)
    engine.connect(peer.engine, timeout_ms=5000)
    src = np.ones(size, np.uint8)
    engine.register(src)
    with peer.stopped():
        t0 = time.monotonic()
        with pytest.raises(hixl.Timeout):
            engine.transfer_sync(
                peer.engine, W, [(src.ctypes.data, peer.addr, size)], timeout_ms=300
            )
        assert time.monotonic() - t0 < 5
        req = engine.transfer_async(peer.engine, W, [(src.ctypes.data, peer.addr, size)])
        assert req.wait(timeout_ms=50) == hixl.TransferStatus.WAITING
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            import threading

            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(KeyboardInterrupt):
                req.wait(timeout_ms=5000)
        finally:
            signal.signal(signal.SIGINT, old)
    assert req.wait(timeout_ms=20_000) == hixl.TransferStatus.COMPLETED
    assert (peer.read(size - 4096) == 1).all()


def test_queue_full_is_resource_exhausted(make_peer):
    size = 32 << 20
    peer = make_peer(size)
    with hixl.Hixl() as e:
        e.initialize(
            "127.0.0.1", {"hixl.queue_depth": "1", "hixl.tcp.streams": "1", "hixl.backends": "tcp"}
        )
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(size, np.uint8)
        e.register(src)
        reqs, err = [], None
        for _ in range(100):
            try:
                reqs.append(e.transfer_async(peer.engine, W, [(src.ctypes.data, peer.addr, size)]))
            except hixl.ResourceExhausted as x:
                err = x
                break
        assert err is not None and err.code == 203900 and "queue full" in str(err)
        for r in reqs:
            assert r.wait(30_000) == hixl.TransferStatus.COMPLETED


def test_notify_cap_is_resource_exhausted(make_peer, engine):
    peer = make_peer(64, {"hixl.max_notifies": "2"})
    engine.connect(peer.engine, timeout_ms=5000)
    engine.send_notify(peer.engine, hixl.NotifyDesc("a", "1"))
    engine.send_notify(peer.engine, hixl.NotifyDesc("b", "2"))
    with pytest.raises(hixl.ResourceExhausted, match="pending"):
        engine.send_notify(peer.engine, hixl.NotifyDesc("c", "3"))
    assert peer.notifies() == [["a", "1"], ["b", "2"]]
    engine.send_notify(peer.engine, hixl.NotifyDesc("d", "4"))
    with pytest.raises(hixl.ParamInvalid, match="too long"):
        engine.send_notify(peer.engine, hixl.NotifyDesc("x" * 2000, ""))


def test_use_after_finalize_is_failed():
    e = hixl.Hixl()
    with pytest.raises(hixl.Failed, match="not initialized"):
        e.register(bytearray(10))
    e.initialize("127.0.0.1:0")
    with pytest.raises(hixl.Failed, match="already initialized"):
        e.initialize("127.0.0.1:0")
    e.finalize()
    e.finalize()
    with pytest.raises(hixl.Failed, match="finalized") as ei:
        e.connect("127.0.0.1:1")
    assert ei.value.code == 503900


def test_wrong_types_name_the_argument_and_the_value(engine):
    """These once said `must be real number, not str`, `'str' object cannot be converted to
    'TransferOp'`, `... to 'PyString'` and `... to 'PyDict'`: no value named."""
    with pytest.raises(TypeError, match=r"argument 'timeout_ms': '100' \(str\) is not a number"):
        engine.connect("127.0.0.1:1", timeout_ms="100")
    with pytest.raises(TypeError, match=r"argument 'timeout_ms': '5' \(str\) is not a number"):
        engine.put("127.0.0.1:1", 1, 2, 3, timeout_ms="5")
    with pytest.raises(TypeError, match=r"argument 'timeout_ms': None \(NoneType\)"):
        engine.wait_notifies(None)
    with pytest.raises(TypeError, match=r"argument 'name': 1 \(int\) is not a str"):
        hixl.NotifyDesc(1, 2)
    with pytest.raises(TypeError, match=r"argument 'msg': b'x' \(bytes\) is not a str"):
        hixl.NotifyDesc("n", b"x")
    with pytest.raises(TypeError, match=r"argument 'op': 'WRTE' \(str\) is not a TransferOp"):
        engine.transfer_sync("127.0.0.1:1", "WRTE", [(1, 2, 3)])
    with pytest.raises(TypeError, match=r"argument 'op': 1 \(int\) is not a TransferOp"):
        engine.transfer_async("127.0.0.1:1", 1, [(1, 2, 3)])
    e = hixl.Hixl()
    with pytest.raises(hixl.ParamInvalid, match=r"options=\['hixl.tcp.streams'\] \(list\) is not"):
        e.initialize("127.0.0.1", ["hixl.tcp.streams"])


def test_an_address_that_is_not_a_str_is_named_with_what_to_pass(engine):
    """`connect(19501)` once said `'int' object cannot be converted to 'PyString'`: every str
    argument of the engine's methods names itself, the value and the type it wants."""
    want = r' \(int\) is not a str: pass the address as "host:port"'
    calls = {
        "connect": lambda: engine.connect(19501),
        "disconnect": lambda: engine.disconnect(19501),
        "connect_async": lambda: engine.connect_async(19501),
        "get_async_connect_status": lambda: engine.get_async_connect_status(19501),
        "remote_mems": lambda: engine.remote_mems(19501),
        "remote_regions": lambda: engine.remote_regions(19501),
        "remote_region": lambda: engine.remote_region(19501, "kv"),
        "put": lambda: engine.put(19501, 1, 2, 3),
        "get_async": lambda: engine.get_async(19501, 1, 2, 3),
        "transfer_sync": lambda: engine.transfer_sync(19501, W, [(1, 2, 3)]),
        "send_notify": lambda: engine.send_notify(19501, hixl.NotifyDesc("n")),
        "initialize": lambda: hixl.Hixl().initialize(19501),
    }
    for method, call in calls.items():
        arg = "local_engine" if method == "initialize" else "remote"
        with pytest.raises(TypeError, match=rf"^argument '{arg}': 19501{want}") as ei:
            call()
        assert "PyString" not in str(ei.value), method
    buf = bytearray(8)
    for call, arg, shown in [
        (lambda: engine.remote_region("127.0.0.1:1", 5), "name", "5 (int) is not a str"),
        (lambda: engine.register(buf, access=1), "access", "1 (int) is not a str"),
        (lambda: engine.register(buf, name=7), "name", "7 (int) is not a str"),
        (lambda: engine.alloc(8, name=b"kv"), "name", "b'kv' (bytes) is not a str"),
        (lambda: hixl.set_log_level(10), "level", "10 (int) is not a str"),
        (
            lambda: engine.wait_notifies(0, name=1),
            "name",
            "1 (int) is not a str, a list or tuple of str, or None",
        ),
        (lambda: engine.wait_notifies(0, name=["a", 2]), "name", "item [1] 2 (int) is not a str"),
    ]:
        with pytest.raises(TypeError) as ei:
            call()
        assert str(ei.value) == f"argument '{arg}': {shown}"
    assert engine.register(buf, access="r", name="b").name == "b"


def test_a_host_name_that_does_not_resolve_is_named_so(engine):
    """`connect("locahost:19501")` once said the address `is not "ip:port"`: a host name that
    does not resolve says so, with the resolver's reason; text that is no "host:port" at all
    still says that."""
    for addr, host in [("locahost:19501", "locahost"), ("nohost.invalid:19501", "nohost.invalid")]:
        with pytest.raises(hixl.ParamInvalid) as ei:
            engine.connect(addr, timeout_ms=1000)
        msg = ei.value.message
        assert msg.startswith(f'address "{addr}": host name "{host}" did not resolve (')
        assert msg.endswith(")") and len(msg) > len(addr) + len(host) + 40, msg
        assert "ip:port" not in msg
    for bad in ["19501", "localhost", "localhost:port", "localhost:99999", "[::1]"]:
        with pytest.raises(hixl.ParamInvalid) as ei:
            engine.connect(bad, timeout_ms=1000)
        assert ei.value.message.startswith(f'address "{bad}" is not "ip:port"'), ei.value
    hixl.Hixl().initialize("localhost:0")  # a name that resolves still works


def test_an_unknown_option_key_suggests_the_closest_known_one():
    e = hixl.Hixl()
    with pytest.raises(
        hixl.ParamInvalid, match=r'"hixl.tcp.stream" \(did you mean "hixl.tcp.streams"'
    ):
        e.initialize("127.0.0.1", {"hixl.tcp.stream": 2})
    with pytest.raises(
        hixl.ParamInvalid, match=r'"HIXL.QUEUE-DEPTH" \(did you mean "hixl.queue_depth"'
    ):
        e.initialize("127.0.0.1", {"HIXL.QUEUE-DEPTH": 2})
    with pytest.raises(hixl.ParamInvalid) as ei:
        e.initialize("127.0.0.1", {"hixl.nope": 2})
    assert "did you mean" not in str(ei.value) and "known keys: hixl.backends" in str(ei.value)


def test_the_op_may_be_given_by_its_name_in_any_case(engine, make_peer):
    """`TransferOp.WRITE.name` is "WRITE": that name, in any case, is the op."""
    import types

    peer = make_peer(4096)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(4096, 7)
    engine.register(src)
    engine.transfer_sync(peer.engine, "WRITE", [(src.ctypes.data, peer.addr, 1024)])
    req = engine.transfer_async(
        peer.engine, "write", [(src.ctypes.data + 1024, peer.addr + 1024, 1024)]
    )
    assert req.wait(5000) == hixl.TransferStatus.COMPLETED
    back = np.zeros(2048, np.uint8)
    engine.register(back)
    engine.transfer_sync(peer.engine, "Read", [(back.ctypes.data, peer.addr, 2048)])
    assert (back == src[:2048]).all() and (peer.read(0, 2048) == src[:2048]).all()
    # Options may be any mapping, not only a dict.
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", types.MappingProxyType({"hixl.tcp.streams": 2}))


def test_the_kv_layer_names_a_wrong_argument_and_takes_timeout_0():
    """`hixl.kv.init(peers=[...])` once said `dictionary update sequence element #0 ...`;
    CacheTransferConfig refused timeout_ms=0 (">= 1") where the engine's timeout_ms takes 0."""
    with pytest.raises(hixl.ParamInvalid, match=r"peers=\['127.0.0.1:1'\] \(list\) must map each"):
        hixl.kv.init(cluster_id=0, peers=["127.0.0.1:1"])
    assert hixl.kv.CacheTransferConfig(timeout_ms=0).timeout_ms == 0
    with pytest.raises(hixl.ParamInvalid, match="timeout_ms=-1 must be an integer >= 0"):
        hixl.kv.CacheTransferConfig(timeout_ms=-1)
    with pytest.raises(hixl.ParamInvalid, match="max_concurrent=0 must be an integer >= 1"):
        hixl.kv.CacheTransferConfig(max_concurrent=0)


def test_stats_takes_a_url_without_a_scheme(engine):
    """`hixl stats --url 127.0.0.1:9464` once ended in a traceback (unknown url type)."""
    import subprocess
    import sys

    def stats(url: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "hixl.cli", "stats", "--url", url, "--timeout", "5"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    with hixl.metrics.serve(engine) as srv:
        r = stats(f"127.0.0.1:{srv.port}")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert r.stdout.startswith("peer"), r.stdout
    bad = stats("ftp://127.0.0.1:1/metrics")
    assert bad.returncode == 2, bad.stderr
    assert "--url 'ftp://127.0.0.1:1/metrics': expected http://host:port/metrics" in bad.stderr
