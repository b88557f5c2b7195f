"""hixl.nixl's notifications on the KV core's one router (``_kvcore._notify.Router``): the
router's ``take_all`` hands every notification out once, in arrival order, and a NIXL agent
polled from several threads at once neither loses nor duplicates one. Two engines, real
sockets, messages compared."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

import hixl
from hixl._kvcore._notify import Router
from hixl.nixl import nixl_agent

N = 300  # notifications per test
THREADS = 4


@pytest.fixture
def pair() -> Iterator[tuple[nixl_agent, nixl_agent]]:
    """(target, initiator): the initiator has loaded the target's metadata."""
    a, b = nixl_agent("t-" + uuid.uuid4().hex[:8]), nixl_agent("i-" + uuid.uuid4().hex[:8])
    b.add_remote_agent(a.get_agent_metadata())
    yield a, b
    b.close()
    a.close()


def _in_threads(poll: Callable[[], None], done: Callable[[], bool]) -> None:
    """Runs `poll` in THREADS threads at once until `done()` or 30 s."""
    deadline = time.monotonic() + 30.0
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not done() and time.monotonic() < deadline:
                poll()
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    ts = [threading.Thread(target=loop) for _ in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert done(), "not all notifications came within 30 s"


def test_router_take_all_hands_each_out_once_in_order():
    """take_all: what take() left waiting first, then the engine's, whatever their name; the
    next call has only what came since."""
    with hixl.Hixl() as e, hixl.Hixl() as sender:
        e.initialize("127.0.0.1:0")
        sender.initialize("127.0.0.1:0")
        router = Router(e, logging.getLogger("test"))
        sender.connect(e.local_engine, timeout_ms=10_000)
        for name, msg in (("mine", "1"), ("other", "2"), ("mine", "3")):
            sender.send_notify(e.local_engine, hixl.NotifyDesc(name, msg), timeout_ms=10_000)
        deadline = time.monotonic() + 10
        got: list[hixl.NotifyDesc] = []
        while not got and time.monotonic() < deadline:
            got += router.take("mine", lambda n: n.msg == "3")
        assert [n.msg for n in got] == ["3"]
        assert [n.msg for n in router.pending] == ["1"]  # named "mine", not matched: waits
        everything: list[hixl.NotifyDesc] = []
        while len(everything) < 2 and time.monotonic() < deadline:
            everything += router.take_all()
        assert [(n.name, n.msg) for n in everything] == [("mine", "1"), ("other", "2")]
        assert router.pending == [] and router.take_all() == []


def test_new_notifs_from_several_threads_none_lost_or_twice(pair):
    a, b = pair
    sent = [f"m{i:04d}".encode() for i in range(N)]
    got: list[bytes] = []
    lock = threading.Lock()

    def poll() -> None:
        new = a.get_new_notifs()
        assert set(new) <= {b.name}, new
        with lock:
            got.extend(new.get(b.name, []))

    sender = threading.Thread(target=lambda: [b.send_notif(a.name, m) for m in sent])
    sender.start()
    _in_threads(poll, lambda: len(got) >= N)
    sender.join()
    time.sleep(0.2)
    poll()  # nothing more: none was handed out twice
    assert sorted(got) == sent


def test_check_remote_xfer_done_from_several_threads_finds_each_once(pair):
    """Each thread looks for its own tags: every tag is found exactly once, and what is left
    in notifs afterwards is what no thread looked for, in arrival order."""
    a, b = pair
    tags = [f"T{i:04d}".encode() for i in range(N)]
    extra = [f"x{i:02d}".encode() for i in range(20)]
    for i, m in enumerate(tags):
        b.send_notif(a.name, m)
        if i % 15 == 0:
            b.send_notif(a.name, extra[i // 15])
    found: list[bytes] = []
    lock = threading.Lock()
    mine = {t: [m for j, m in enumerate(tags) if j % THREADS == t] for t in range(THREADS)}
    local = threading.local()

    def poll() -> None:
        if not hasattr(local, "todo"):
            with lock:
                local.todo = mine.pop(next(iter(mine)))
        for m in list(local.todo):
            if a.check_remote_xfer_done(b.name, m):
                local.todo.remove(m)
                with lock:
                    found.append(m)

    _in_threads(poll, lambda: len(found) >= N)
    assert sorted(found) == tags
    assert a.update_notifs()[b.name] == extra
