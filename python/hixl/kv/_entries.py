"""The discovery entry of a rank, ``<prefix>/ranks/<rank>`` in etcd, and how a reader decides
whether to believe one.

Anyone who may write that etcd prefix can put any value under any key. So a reader takes an
entry only when it is attached to a lease (every rank publishes under one, which etcd deletes
when the rank stops renewing it) and names the rank of its key; and with a cluster secret
(``hixl.secret`` / ``HIXL_SECRET``, the engine's) only when its ``mac`` verifies: an
HMAC-SHA256 over the etcd key, the lease the entry is attached to and the entry's canonical
JSON (rank, role, address, device id, caches, host, pid), under a key derived from the secret
with its own label (``ENTRY_LABEL``), never the secret itself. A copy moved to another key,
re-attached to another lease (or to none), or with any field changed does not verify. Without
a secret nothing can be verified beyond the lease and the rank: docs/RELIABILITY.md, "etcd
trust model", says what that leaves open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass

#: where the engine takes the cluster secret from (crates/hixl-core/src/options/mod.rs)
SECRET_OPTION = "hixl.secret"
SECRET_ENV = "HIXL_SECRET"
#: domain separation: the entry key is HMAC-SHA256(secret, ENTRY_LABEL)
ENTRY_LABEL = b"hixl-v1 etcd discovery entry key"


@dataclass
class Member:
    """A rank as published in etcd."""

    rank: int
    role: str
    address: str
    device_id: int = 0
    caches: tuple[str, ...] = ()
    host: str = ""
    pid: int = 0

    def fields(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "role": self.role,
            "address": self.address,
            "device_id": self.device_id,
            "caches": list(self.caches),
            "host": self.host,
            "pid": self.pid,
        }

    def to_json(self) -> bytes:
        """The canonical form: what the MAC covers."""
        return json.dumps(self.fields(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Member:
        d = json.loads(raw)
        return cls(
            int(d["rank"]),
            str(d["role"]),
            str(d["address"]),
            int(d.get("device_id", 0)),
            tuple(str(c) for c in d.get("caches", [])),
            str(d.get("host", "")),
            int(d.get("pid", 0)),
        )


class Refused(Exception):
    """An entry a reader does not take; the message says why (never any secret)."""


def cluster_secret(engine_options: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """The secret the engine uses: the option, else the environment variable (the engine has
    checked it already: too weak a secret fails hixl.kv.init before discovery starts)."""
    return str(engine_options.get(SECRET_OPTION) or env.get(SECRET_ENV) or "") or None


class EntryKey:
    """The MAC key of discovery entries, derived from the cluster secret (never shown)."""

    def __init__(self, secret: str) -> None:
        self._key = hmac.new(secret.encode(), ENTRY_LABEL, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "EntryKey(<derived from the cluster secret>)"

    def mac(self, key: bytes, lease: int, member: Member) -> str:
        m = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (key, str(lease).encode(), member.to_json()):
            m.update(len(part).to_bytes(4, "little"))
            m.update(part)
        return m.hexdigest()


def seal(entry_key: EntryKey | None, key: bytes, lease: int, member: Member) -> bytes:
    """The value to publish under `key`, attached to `lease`: with a key, MACed."""
    d = member.fields()
    if entry_key is not None:
        d["mac"] = entry_key.mac(key, lease, member)
    return json.dumps(d, separators=(",", ":")).encode()


def open_entry(
    entry_key: EntryKey | None, key: bytes, rank: int, value: bytes, lease: int
) -> Member:
    """The member that `value`, found under `key` (the key of `rank`) attached to `lease`
    (0: none), stands for; Refused when it must not be believed."""
    try:
        m = Member.from_json(value)
        mac = json.loads(value).get("mac")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Refused(f"malformed ({type(exc).__name__}: {exc})") from None
    if m.rank != rank:
        raise Refused(f"it claims rank {m.rank}")
    if lease == 0:
        raise Refused("it is attached to no lease (every rank publishes under one)")
    if entry_key is not None:
        if not isinstance(mac, str):
            raise Refused("it has no MAC and this cluster has a secret")
        if not hmac.compare_digest(mac.encode(), entry_key.mac(key, lease, m).encode()):
            raise Refused(
                f"its MAC does not verify for this key and lease {lease} (forged, moved, "
                "re-attached, or written with another secret)"
            )
    return m
