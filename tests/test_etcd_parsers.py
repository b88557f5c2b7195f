"""Property-based fuzz tests (hypothesis) of the parsers of what etcd and peers hold: a
discovery entry (`open_entry`, `Member.from_json`), etcd's answers (`parse_kv`,
`parse_watch`, and `EtcdClient`'s calls against a hostile etcd) and a peer's KV-cache
directory (`_directory.parse`). Whatever the bytes, only a value or a refusal (Refused,
Malformed, EtcdError, KVError) comes out, never another exception."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hixl import _peertext as pt
from hixl.kv import _directory
from hixl.kv._entries import EntryKey, Member, Refused, open_entry, seal
from hixl.kv._errors import KVError
from hixl.kv._etcd import EtcdClient, EtcdError, parse_kv, parse_watch

KEY = b"/p/ranks/3"
SECRET = "45d95caf931b0a36ec7aa74400e9f42d"

# JSON-ish values, hostile ones included: huge and non-finite numbers, bools where ints
# belong, deep and wide nesting
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 80), max_value=1 << 80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
values = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = ["rank", "role", "address", "device_id", "caches", "host", "pid", "created", "mac"]
# entry-shaped documents: the real fields, each with any value
entries = st.dictionaries(st.sampled_from(FIELDS), values, max_size=len(FIELDS))


def dumps(v: object) -> bytes:
    return json.dumps(v).encode()  # writes inf / nan as Infinity / NaN, as an attacker may


raw_values = st.one_of(
    st.binary(max_size=200),
    values.map(dumps),
    entries.map(dumps),
    st.integers(1, 5000).map(lambda n: b"[" * n),
    st.just(b'{"rank": 1e999, "role": "r", "address": "a"}'),
)


def opened(key: EntryKey | None, value: bytes, lease: int, created: int) -> Member | None:
    try:
        return open_entry(key, KEY, 3, value, lease, created)
    except Refused:
        return None


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(raw_values, st.integers(0, 1 << 63), st.integers(0, 1 << 63), st.booleans())
def test_open_entry_gives_a_member_or_refuses(
    value: bytes, lease: int, created: int, secret: bool
) -> None:
    m = opened(EntryKey(SECRET) if secret else None, value, lease, created)
    assert m is None or isinstance(m, Member)


@settings(max_examples=400)
@given(raw_values)
def test_member_from_json_gives_a_member_or_malformed(value: bytes) -> None:
    try:
        m = Member.from_json(value)
    except pt.Malformed:
        return
    assert isinstance(m, Member) and type(m.rank) is int and type(m.pid) is int


members = st.builds(
    Member,
    st.integers(0, (1 << 31) - 1),
    st.text(max_size=10).filter(lambda s: s.isprintable()),
    st.text(max_size=30).filter(lambda s: s.isprintable()),
    st.integers(0, 1000),
    st.lists(st.text(max_size=10).filter(lambda s: s.isprintable()), max_size=5).map(tuple),
    st.text(max_size=10).filter(lambda s: s.isprintable()),
    st.integers(0, 1 << 22),
)


@settings(max_examples=200)
@given(members, st.integers(1, 1 << 62), st.integers(1, 1 << 62), st.booleans())
def test_a_sealed_entry_opens_only_where_it_was_written(
    m: Member, lease: int, created: int, secret: bool
) -> None:
    """The round trip gives the member back, for its key's create revision only."""
    key = f"/p/ranks/{m.rank}".encode()
    ek = EntryKey(SECRET) if secret else None
    value = seal(ek, key, lease, m, created)
    assert open_entry(ek, key, m.rank, value, lease, created) == m
    with pytest.raises(Refused, match="created at revision"):
        open_entry(ek, key, m.rank, value, lease, created + 1)


kvs = st.dictionaries(
    st.sampled_from(["key", "value", "lease", "create_revision", "mod_revision"]),
    st.one_of(values, st.sampled_from(["L3Bh", "%%%", "9" * 30, "-1", "12"])),
)


@settings(max_examples=300)
@given(kvs)
def test_parse_kv_gives_a_kv_or_malformed(kv: dict[str, object]) -> None:
    try:
        key, got = parse_kv(kv)
    except pt.Malformed:
        return
    assert isinstance(key, bytes) and type(got.lease) is int and type(got.created) is int


watch_docs = st.fixed_dictionaries(
    {},
    optional={
        "result": st.one_of(
            values,
            st.fixed_dictionaries(
                {},
                optional={
                    "header": st.one_of(values, st.fixed_dictionaries({"revision": values})),
                    "events": st.one_of(
                        values,
                        st.lists(
                            st.one_of(
                                values,
                                st.fixed_dictionaries(
                                    {"type": st.sampled_from(["PUT", "DELETE", 1]), "kv": kvs}
                                ),
                            ),
                            max_size=4,
                        ),
                    ),
                    "canceled": values,
                },
            ),
        ),
        "error": values,
    },
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(watch_docs.map(dumps), st.binary(max_size=100)))
def test_parse_watch_gives_events_or_an_etcd_error(line: bytes) -> None:
    try:
        events, rev = parse_watch(line)
    except EtcdError:
        return
    assert type(rev) is int
    for kind, key, kv, mod in events:
        assert kind in ("PUT", "DELETE") and isinstance(key, bytes) and type(mod) is int
        assert type(kv.lease) is int and type(kv.created) is int


caches = st.one_of(
    values,
    st.fixed_dictionaries(
        {
            "name": values,
            "shape": st.one_of(values, st.lists(values, max_size=4)),
            "dtype": st.one_of(values, st.sampled_from(["float16", "int8", "nope", "i4,i4"])),
            "addr": values,
            "nbytes": values,
            "layer_axis": values,
            "block_axis": values,
        }
    ),
)
directories = st.fixed_dictionaries(
    {},
    optional={
        "rank": values,
        "role": values,
        "caches": st.one_of(values, st.lists(caches, max_size=3)),
        "extra": values,
    },
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(directories.map(dumps), st.binary(max_size=100)))
def test_directory_parse_gives_a_directory_or_a_kv_error(body: bytes) -> None:
    try:
        peer = _directory.parse("127.0.0.1:9", 0, body)
    except KVError:
        return
    assert type(peer.rank) is int and all(type(c.addr) is int for c in peer.caches.values())


class _Hostile(BaseHTTPRequestHandler):
    """An "etcd" that answers every call with the body the test set."""

    body = b"{}"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def hostile_etcd() -> Iterator[tuple[EtcdClient, type[_Hostile]]]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield EtcdClient([("127.0.0.1", srv.server_address[1])], timeout_s=2), _Hostile
    srv.shutdown()


HOSTILE_ANSWERS = [
    b'{"header": {"revision": 1e999}, "kvs": []}',
    b'{"ID": 1e999, "TTL": 5}',
    b'{"result": {"TTL": NaN}}',
    b'{"TTL": "5e3"}',
    b'{"kvs": [{"key": 7, "value": "@@", "lease": [1]}], "header": {}}',
    b'{"succeeded": false, "responses": [{"response_range": {"kvs": [{"lease": 1e999}]}}]}',
    b'{"succeeded": true, "header": {"revision": true}}',
    b'{"token": {"x": 1}}',
    b"[" * 100,
    b"not json",
    b'"a string"',
]


@pytest.mark.parametrize("body", HOSTILE_ANSWERS)
def test_etcd_client_refuses_a_hostile_etcd(
    hostile_etcd: tuple[EtcdClient, type[_Hostile]], body: bytes
) -> None:
    """Every call discovery makes gets an answer or an EtcdError from an etcd that answers
    nonsense, never another exception (which would end the thread that made it)."""
    c, handler = hostile_etcd
    handler.body = body
    calls = [
        lambda: c.grant(5),
        lambda: c.keepalive(1),
        lambda: c.lease_ttl(1),
        lambda: c.get_leased(KEY),
        lambda: c.range_leased(b"/p/"),
        lambda: c.create(KEY, b"v", 1),
        lambda: c.put_if_created(KEY, b"v", 1, 2),
        lambda: c.status(),
    ]
    for call in calls:
        try:
            call()
        except EtcdError:
            pass
