"""Every parser of peer-supplied notification text, fuzzed (issue 46, item 1): each gives a
value or refuses with ``hixl._peertext.Malformed`` (a ValueError), never anything else; the
loop that serves every peer's notifications survives whatever one handler raises; and the
warning lines about a peer's notification show its sender escaped (item 8: a sender id with a
newline or an escape sequence cannot forge a log line or drive a terminal)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hixl
from hixl._kvcore._notify import Router
from hixl._peertext import Malformed
from hixl.kv._layerwise import MAX_INDEX, parse_layer
from hixl.llm_datadist._node import (
    BYE_NOTIFY,
    HELLO_NOTIFY,
    MAX_ID,
    RELEASE_NOTIFY,
    Node,
    parse_cluster,
    parse_release,
)
from hixl.nixl._notifs import _Notifs, parse_notif

#: A sender id as a raw client could claim it: a forged log line and an escape sequence.
EVIL = "127.0.0.1:9\nWARNING hixl forged line\x1b[2J"

# -- fuzz ---------------------------------------------------------------------------------------

#: Number-like tokens JSON and int() read differently, and tokens that are no number.
TOKENS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(
        ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "true", "null", '"7"', "1.0", "-0"]
        + ["+1", " 1", "1_0", "\u0663", "0x10", "9" * 5000, "[]", "{}", ""]
    ),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=5), c, max_size=5),
    max_leaves=20,
).map(json.dumps)  # NaN and Infinity included (allow_nan)
ARRAYS = st.lists(TOKENS, max_size=6).map(lambda t: "[" + ",".join(t) + "]")
CLUSTERS = TOKENS.map(lambda t: '{"cluster": ' + t + ', "address": "x"}')
TEXTS = st.one_of(st.text(), JSON, ARRAYS, CLUSTERS, st.sampled_from(["[" * 5000, "{" * 5000]))


def outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None when it refuses; anything else it raises fails the test."""
    try:
        return fn(*args)
    except Malformed as exc:
        assert str(exc)  # it says what was wrong
        return None


@settings(max_examples=400, deadline=None)
@given(TEXTS)
def test_release_texts_give_a_key_or_a_refusal(text: str) -> None:
    key = outcome(parse_release, text)
    if key is not None:
        assert len(key) == 4 and all(type(x) is int and 0 <= x <= MAX_ID for x in key)
        assert list(key) == json.loads(text)


@settings(max_examples=400, deadline=None)
@given(TEXTS, st.sampled_from(["hello", "bye"]))
def test_hello_and_bye_texts_give_a_cluster_or_a_refusal(text: str, what: str) -> None:
    cid = outcome(parse_cluster, text, what)
    if cid is not None:
        assert type(cid) is int and 0 <= cid <= MAX_ID
        assert cid == json.loads(text)["cluster"]


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(), st.tuples(TOKENS, st.text(), TOKENS).map(":".join)))
def test_layer_texts_give_a_layer_or_a_refusal(text: str) -> None:
    got = outcome(parse_layer, text)
    if got is not None:
        rank, name, layer = got
        assert 0 <= rank <= MAX_INDEX and 0 <= layer <= MAX_INDEX
        head, _, tail = text.partition(":")
        assert (rank, name, layer) == (
            int(head),
            tail.rpartition(":")[0],
            int(tail.rpartition(":")[2]),
        )


@given(st.integers(0, MAX_INDEX), st.text(max_size=50), st.integers(0, MAX_INDEX))
def test_layer_texts_a_producer_sends_are_read_back(rank: int, name: str, layer: int) -> None:
    assert parse_layer(f"{rank}:{name}:{layer}") == (rank, name, layer)


@given(st.text(), st.text())
def test_nixl_notifications_are_filed_whatever_their_text(name: str, msg: str) -> None:
    key, data, agent = parse_notif(name, msg)
    assert agent == name.startswith("nixl:")
    assert key == (name[5:] if agent else name) and isinstance(data, bytes)


def test_the_texts_of_the_report_are_refused() -> None:
    for text in ("[1e999,0,0,0]", "[NaN,0,0,0]", "[1.0,0,0,0]", "[true,0,0,0]", "[1,2,3]"):
        with pytest.raises(Malformed, match="release"):
            parse_release(text)
    with pytest.raises(Malformed, match="hello: '1e999' is not a finite number"):
        parse_cluster('{"cluster": 1e999}', "hello")
    with pytest.raises(Malformed, match="layer"):
        parse_layer("0:kv:" + "9" * 5000)


# -- the serving loop ---------------------------------------------------------------------------


@dataclass
class Note:
    """A received notification as the engine gives it (with a sender no engine here has)."""

    name: str
    msg: str
    peer: str


class Engine:
    """Hands out `notes` once, then raises `then`: Failed (finalized, which ends
    Router.serve) or Timeout (none pending)."""

    def __init__(self, notes: list[Note], then: type[hixl.HixlError] = hixl.Failed) -> None:
        self.notes, self.then = notes, then

    def wait_notifies(self, timeout_ms: float, name: Any = None) -> list[Note]:
        if not self.notes:
            raise self.then("none")
        got, self.notes = self.notes, []
        return got


def test_serve_drops_one_message_whatever_its_handler_raises(caplog) -> None:
    """Router.serve: a handler raising OverflowError, RecursionError, RuntimeError or
    Malformed loses that message only; the next is still handled, and each drop is logged
    with its sender escaped."""
    raises = {
        "overflow": OverflowError("int too large"),
        "recursion": RecursionError("deep"),
        "runtime": RuntimeError("boom"),
    }
    handled: list[str] = []

    def handle(n: Note) -> None:
        if n.msg in raises:
            raise raises[n.msg]
        if n.msg.startswith("["):
            parse_release(n.msg)
        handled.append(n.msg)

    notes = [Note("x", m, EVIL) for m in ("overflow", "[1e999,0,0,0]", "recursion", "runtime")]
    router = Router(Engine([*notes, Note("x", "good", EVIL)]), logging.getLogger("hixl.kv"))
    with caplog.at_level(logging.WARNING, logger="hixl.kv"):
        router.serve(["x"], handle, lambda: True)
    assert handled == ["good"] and router.dropped == 4
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all(repr(EVIL) in x for x in lines), lines
    assert any("OverflowError" in x for x in lines) and any("Malformed" in x for x in lines)
    assert not any("\n" in x or "\x1b" in x for x in lines), lines


# -- peer text in log lines ---------------------------------------------------------------------


def escaped(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The captured lines, each checked to show EVIL escaped only."""
    lines = [r.getMessage() for r in caplog.records]
    assert lines
    for x in lines:
        assert "\n" not in x and "\x1b" not in x, x
        assert repr(EVIL) in x, x
    return lines


def _node() -> Any:
    """A Node's notification handling alone: cluster 0 linked at 127.0.0.1:1 and routed."""
    node: Any = Node.__new__(Node)
    node.ctx = SimpleNamespace(lock=threading.Lock(), peers={0: SimpleNamespace(address="x")})
    node.ctx.peers[0].address = "127.0.0.1:1"
    node.lock = threading.RLock()
    node.routes = {0: "127.0.0.1:1"}
    node.cluster_id = 1
    return node


@pytest.mark.parametrize(
    "name, msg",
    [
        (RELEASE_NOTIFY, "[1,2,3,4]"),
        (BYE_NOTIFY, '{"cluster": 0}'),
        (HELLO_NOTIFY, '{"cluster": 0}'),
    ],
)
def test_lldd_warnings_show_the_sender_escaped(caplog, name: str, msg: str) -> None:
    with caplog.at_level(logging.INFO, logger="hixl.llm_datadist"):
        _node()._apply(Note(name, msg, EVIL))
    escaped(caplog)


def test_nixl_warning_shows_the_sender_escaped(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="hixl.nixl"):
        assert _Notifs._sender("b", EVIL, True, [("b", "127.0.0.1:1")]) is None
    escaped(caplog)


def test_layer_receive_warning_shows_the_sender_escaped(caplog) -> None:
    """A receive for rank 5 (at 127.0.0.1:1) drops a layer notification naming rank 5 from
    another sender, and says so with the sender escaped."""
    import numpy as np

    hixl.kv.init(cluster_id=0, role="decoder", peers={})
    try:
        from hixl.kv._context import context

        ctx = context()
        ctx.known[5] = "127.0.0.1:1"
        cache = hixl.kv.allocate_cache(
            np.zeros((2, 64), np.uint8), name="kv", layer_axis=0, block_axis=None
        )
        ctx.mailbox.engine = Engine([Note("hixl.kv.layer", "5:kv:0", EVIL)], hixl.Timeout)
        syncer = hixl.kv.LayerTracker(2)
        cfg = hixl.kv.CacheTransferConfig(timeout_ms=100)
        with caplog.at_level(logging.WARNING, logger="hixl.kv"):
            with pytest.raises(hixl.kv.KVError):
                hixl.kv.receive_cache_async(5, cache, syncer, cfg).wait(10_000)
        assert syncer.get_layer_count() == 0
        assert any("dropped a layer notification" in x for x in escaped_some(caplog))
    finally:
        hixl.kv.finalize()


def escaped_some(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The captured lines that name EVIL, each checked to show it escaped only."""
    lines = [r.getMessage() for r in caplog.records]
    for x in lines:
        assert "\n" not in x and "\x1b" not in x, x
    return [x for x in lines if repr(EVIL) in x]
