"""Buffers, the GIL and lifetimes: what Python code relies on."""

from __future__ import annotations

import gc
import mmap
import os
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import proc_state, random_bytes

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ


def test_register_any_writable_buffer(engine, make_peer):
    peer = make_peer(4 * 4096)
    engine.connect(peer.engine, timeout_ms=5000)
    ba = bytearray(os.urandom(4096))
    mv = memoryview(bytearray(os.urandom(4096)))
    mm = mmap.mmap(-1, 4096)
    mm.write(os.urandom(4096))
    arr = random_bytes(4096, 5).view(np.float32)  # non-uint8 dtype: registered by bytes
    sources = [ba, mv, mm, arr]
    for i, obj in enumerate(sources):
        h = engine.register(obj)
        assert h.len == 4096
        engine.transfer_sync(peer.engine, W, [(h.addr, peer.addr + i * 4096, 4096)])
    target = peer.read()
    for i, obj in enumerate(sources):
        assert target[i * 4096 : (i + 1) * 4096].tobytes() == bytes(memoryview(obj).cast("B"))
    # READ into a bytearray lands in the object itself.
    dst = bytearray(4096)
    engine.register(dst)
    engine.transfer_sync(
        peer.engine, R, [(np.frombuffer(dst, np.uint8).ctypes.data, peer.addr, 4096)]
    )
    assert bytes(dst) == bytes(ba)


def test_registered_object_is_kept_alive_until_deregistered(engine):
    arr = np.zeros(4096, np.uint8)
    ref = weakref.ref(arr)
    h = engine.register(arr)
    del arr
    gc.collect()
    assert ref() is not None, "the engine keeps the buffer alive"
    engine.deregister_mem(h)
    gc.collect()
    assert ref() is None, "released after deregistration"


def test_gil_is_released_while_a_transfer_waits(engine, make_peer):
    size = 64 << 20
    peer = make_peer(size)
    engine.connect(peer.engine, timeout_ms=5000)
    src = np.ones(size, np.uint8)
    engine.register(src)
    done = threading.Event()

    def transfer():
        engine.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, size)], 20_000)
        done.set()

    with peer.stopped():  # the transfer cannot finish while the peer sleeps
        t = threading.Thread(target=transfer)
        t.start()
        time.sleep(0.05)
        count, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.5:  # Python keeps running during the blocked transfer
            count += 1
        assert not done.is_set()
    t.join(30)
    assert done.is_set()
    assert count > 50_000, f"main thread only ran {count} iterations: GIL held?"
    assert (peer.read(size - 16) == 1).all()


def test_two_threads_transfer_at_once(engine, make_peer):
    size = 16 << 20
    peer = make_peer(2 * size)
    engine.connect(peer.engine, timeout_ms=5000)
    srcs = [random_bytes(size, s) for s in (1, 2)]
    for s in srcs:
        engine.register(s)
    errors = []

    def run(i):
        try:
            for _ in range(5):
                engine.transfer_sync(
                    peer.engine, W, [(srcs[i].ctypes.data, peer.addr + i * size, size)], 30_000
                )
        except Exception as x:  # noqa: BLE001 - reported below
            errors.append(x)

    ts = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors
    target = peer.read()
    assert np.array_equal(target[:size], srcs[0]) and np.array_equal(target[size:], srcs[1])


def test_deregister_during_transfer_fails_it_and_never_hangs(make_peer):
    size = 64 << 20
    peer = make_peer(size)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.deregister_timeout_ms": "200", "hixl.backends": "tcp"})
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(size, np.uint8)
        h = e.register(src)
        with peer.stopped():
            req = e.transfer_async(peer.engine, W, [(src.ctypes.data, peer.addr, size)])
            t0 = time.monotonic()
            e.deregister_mem(h)  # waits 200 ms, then aborts the link that uses the region
            assert time.monotonic() - t0 < 10
            assert req.wait(5000) == hixl.TransferStatus.FAILED


def test_finalize_with_requests_in_flight(make_peer):
    size = 64 << 20
    peer = make_peer(size)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    e.connect(peer.engine, timeout_ms=5000)
    src = np.ones(size, np.uint8)
    e.register(src)
    with peer.stopped():
        reqs = [
            e.transfer_async(peer.engine, W, [(src.ctypes.data, peer.addr, size)]) for _ in range(3)
        ]
        e.finalize()
        assert [r.status() for r in reqs] == [hixl.TransferStatus.FAILED] * 3
        assert "finalized" in str(_error_of(reqs[0]))


def _error_of(req):
    try:
        req.result()
    except hixl.HixlError as x:
        return x
    return None


def test_log_level():
    hixl.set_log_level("DEBUG")
    assert hixl.get_log_level() == "DEBUG"
    hixl.set_log_level("WARN")
    try:
        hixl.set_log_level("LOUD")
    except hixl.ParamInvalid as x:
        assert "LOUD" in str(x)
    else:
        raise AssertionError("bad level accepted")


def test_engine_used_after_fork_fails_clearly(engine):
    import warnings

    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: intended here
        pid = os.fork()
    if pid == 0:  # child: the engine's threads did not survive; it must say so, not hang
        os.close(r)
        try:
            engine.register(bytearray(64))
            msg = b"no error"
        except hixl.Failed as x:
            msg = str(x).encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    os.waitpid(pid, 0)
    assert "fork" in msg, msg


class _TensorLike:
    """Duck-typed stand-in with torch's tensor interface (data_ptr, untyped_storage, device,
    is_contiguous, numel, element_size) over numpy memory: exercises the tensor path where
    torch is not installed. The real-torch test below runs when torch is importable."""

    class _Dev:
        def __init__(self, kind: str) -> None:
            self.type = kind

    def __init__(self, arr: np.ndarray, device: str = "cpu", contiguous: bool = True) -> None:
        self.arr, self.device, self.contiguous = arr, self._Dev(device), contiguous

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def untyped_storage(self) -> object:
        return self.arr

    def is_contiguous(self) -> bool:
        return self.contiguous

    def numel(self) -> int:
        return self.arr.size

    def element_size(self) -> int:
        return self.arr.itemsize


def test_tensor_like_objects_register_by_data_ptr(engine, make_peer):
    peer = make_peer(4096)
    engine.connect(peer.engine, timeout_ms=5000)
    arr = random_bytes(4096, 4).view(np.float16)
    t = _TensorLike(arr)
    h = engine.register(t)
    assert (h.addr, h.len) == (arr.ctypes.data, 4096)
    engine.transfer_sync(peer.engine, W, [(h.addr, peer.addr, 4096)])
    assert peer.read().tobytes() == arr.tobytes()
    with pytest.raises(hixl.Unsupported, match="cuda"):
        engine.register(_TensorLike(np.zeros(8), device="cuda"))
    with pytest.raises(hixl.ParamInvalid, match="contiguous"):
        engine.register(_TensorLike(np.zeros(8), contiguous=False))


def test_torch_cpu_tensor():
    torch = pytest.importorskip("torch", reason="torch is not installed (not a dependency)")
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1")
        t = torch.arange(1024, dtype=torch.float32)
        h = e.register(t)
        assert (h.addr, h.len) == (t.data_ptr(), 4096)


def test_a_failed_finalize_stays_failed_and_keeps_registered_memory_referenced() -> None:
    """finalize fails when a same-host peer (it copies with no check at this side) does not
    confirm that it dropped this engine's regions; the objects registered must then stay
    referenced, and a second finalize must not pretend all is well (it used to return None,
    and the bindings then released the objects a peer might still write)."""
    import os
    import signal
    import subprocess
    import sys

    t = hixl.Hixl()
    t.initialize("127.0.0.1:0", {"hixl.deregister_timeout_ms": "300"})
    buf = np.zeros(1 << 16, np.uint8)
    t.register(buf)
    script = (
        "import sys, hixl\n"
        "e = hixl.Hixl(); e.initialize('127.0.0.1', {'hixl.backends': 'shm'})\n"
        f"e.connect('{t.local_engine}', timeout_ms=5000)\n"
        "assert e.stats()['" + t.local_engine + "']['backend'] == 'shm'\n"
        "print('LINKED', flush=True); sys.stdin.read()\n"
    )
    peer = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "LINKED"
        os.kill(peer.pid, signal.SIGSTOP)  # it can no longer confirm anything
        deadline = time.monotonic() + 5
        while proc_state(peer.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.001)
        held = sys.getrefcount(buf)
        with pytest.raises(hixl.HixlError):
            t.finalize()
        with pytest.raises(hixl.HixlError, match="an earlier finalize failed"):
            t.finalize()
        assert sys.getrefcount(buf) == held, "the registered object was released"
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(10)


def test_an_engine_collected_without_finalize_keeps_what_a_peer_may_still_access(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 35, item 8: a Hixl dropped by garbage collection (no finalize) while a same-host
    peer (shm: it copies with no check at this side) is frozen and cannot confirm must do what
    explicit finalize does: wait with the GIL released, and then keep the registered object
    referenced, and log the failure (it used to finalize with the GIL held, ignore the failure
    and release it)."""
    import logging
    import signal
    import subprocess
    import sys

    t = hixl.Hixl()
    t.initialize("127.0.0.1:0", {"hixl.deregister_timeout_ms": "500"})
    buf = np.zeros(1 << 16, np.uint8)
    ref = weakref.ref(buf)
    t.register(buf)
    del buf
    script = (
        "import sys, hixl\n"
        "e = hixl.Hixl(); e.initialize('127.0.0.1', {'hixl.backends': 'shm'})\n"
        f"e.connect('{t.local_engine}', timeout_ms=5000)\n"
        "assert e.stats()['" + t.local_engine + "']['backend'] == 'shm'\n"
        "print('LINKED', flush=True); sys.stdin.read()\n"
    )
    peer = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    caplog.set_level(logging.WARNING, logger="hixl")
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "LINKED"
        os.kill(peer.pid, signal.SIGSTOP)  # it can no longer confirm anything
        deadline = time.monotonic() + 5
        while proc_state(peer.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.001)
        ticker.start()
        time.sleep(0.05)
        before = ticks[0]
        start = time.monotonic()
        del t
        gc.collect()
        waited = time.monotonic() - start
        during = ticks[0] - before
        assert waited >= 0.4, f"the drop did not wait for the peer ({waited:.3f} s)"
        gc.collect()
        assert ref() is not None, "the registered object was released under a peer's mapping"
        held = f"{during} ticks in {waited:.2f} s"
        assert during >= 20, f"the drop held the GIL while waiting ({held})"
        deadline = time.monotonic() + 5  # the log drain hands records over asynchronously
        while "could not finalize" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "could not finalize" in caplog.text, "the failed finalize was not logged"
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join()
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(10)
