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
a secret nothing can be verified beyond the lease and the rank: "etcd trust model" in
https://github.com/hixl/hixl/blob/main/docs/RELIABILITY.md says what that leaves open.

An entry is also bound to the life of its key: it names (``created``, under the MAC) the
revision at which etcd created the key it is under, and a reader takes it only where etcd
reports that same create revision. etcd deletes the key when the rank's lease ends, and a key
created again gets a new, higher revision that no writer can choose; so a dead rank's signed
entry put back later (even on a lease granted again with the dead one's ID) is refused by
every reader, whenever it started. A rank publishes in two steps: it creates its key with a
*pending* entry (``created`` 0, which readers skip quietly), then writes the entry naming the
key's create revision, only while the key still has it (an etcd transaction).

Parsing is strict (``hixl._peertext``): a value is a Member or Refused, never an exception of
another kind, whatever bytes etcd holds.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass

from .. import _peertext as pt
from .._secret import cluster_secret as cluster_secret

#: domain separation: the entry key is HMAC-SHA256(secret, ENTRY_LABEL)
ENTRY_LABEL = b"hixl-v1 etcd discovery entry key"

#: bounds on what an entry may hold (a rank's own entry is far below them)
MAX_ENTRY_BYTES = 1 << 20
MAX_CACHES = 10_000
MAX_NAME_CHARS = 1024
MAX_RANK = (1 << 31) - 1
MAX_REVISION = (1 << 63) - 1


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
        """The member of an entry's value; Malformed (a ValueError naming what is wrong) for
        anything that is not a well-formed entry within the bounds above."""
        return cls.from_doc(pt.obj(pt.loads(raw, "entry", MAX_ENTRY_BYTES), "entry"))

    @classmethod
    def from_doc(cls, d: Mapping[str, object]) -> Member:
        if "rank" not in d or "role" not in d or "address" not in d:
            raise pt.Malformed("entry lacks one of rank, role, address")
        caches = pt.array(d.get("caches", []), "caches", MAX_CACHES)
        return cls(
            pt.integer(d["rank"], "rank", 0, MAX_RANK),
            pt.text(d["role"], "role", 64),
            pt.text(d["address"], "address", 512),
            pt.integer(d.get("device_id", 0), "device_id", 0, MAX_RANK),
            tuple(pt.text(c, "cache name", MAX_NAME_CHARS) for c in caches),
            pt.text(d.get("host", ""), "host", MAX_NAME_CHARS),
            pt.integer(d.get("pid", 0), "pid", 0, MAX_RANK),
        )


class Refused(Exception):
    """An entry a reader does not take; the message says why (never any secret)."""


class Pending(Refused):
    """A rank's first write of its key (``created`` 0): skipped quietly, the bound entry
    follows at once."""


class EntryKey:
    """The MAC key of discovery entries, derived from the cluster secret (never shown)."""

    def __init__(self, secret: str) -> None:
        self._key = hmac.new(secret.encode(), ENTRY_LABEL, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "EntryKey(<derived from the cluster secret>)"

    def mac(self, key: bytes, lease: int, created: int, member: Member) -> str:
        m = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (key, str(lease).encode(), str(created).encode(), member.to_json()):
            m.update(len(part).to_bytes(4, "little"))
            m.update(part)
        return m.hexdigest()


def seal(entry_key: EntryKey | None, key: bytes, lease: int, member: Member, created: int) -> bytes:
    """The value to publish under `key`, attached to `lease`, for the key created at revision
    `created` (0: the pending entry that creates it): with a key, MACed."""
    d = member.fields()
    d["created"] = created
    if entry_key is not None:
        d["mac"] = entry_key.mac(key, lease, created, member)
    return json.dumps(d, separators=(",", ":")).encode()


def open_entry(
    entry_key: EntryKey | None, key: bytes, rank: int, value: bytes, lease: int, created: int
) -> Member:
    """The member that `value`, found under `key` (the key of `rank`) attached to `lease`
    (0: none) and created at revision `created`, stands for; Refused (Pending for a rank's
    first write) when it must not be believed. Never raises anything else."""
    try:
        d = pt.obj(pt.loads(value, "entry", MAX_ENTRY_BYTES), "entry")
        m = Member.from_doc(d)
        signed = pt.integer(d.get("created"), "created", 0, MAX_REVISION)
        mac = d.get("mac")
        if mac is not None:
            mac = pt.text(mac, "mac", 64)
    except pt.Malformed as exc:
        raise Refused(f"malformed ({exc})") from None
    if m.rank != rank:
        raise Refused(f"it claims rank {m.rank}")
    if lease == 0:
        raise Refused("it is attached to no lease (every rank publishes under one)")
    if entry_key is not None:
        if mac is None:
            raise Refused("it has no MAC and this cluster has a secret")
        if not hmac.compare_digest(mac.encode(), entry_key.mac(key, lease, signed, m).encode()):
            raise Refused(
                f"its MAC does not verify for this key and lease {lease} (forged, moved, "
                "re-attached, or written with another secret)"
            )
    if signed == 0:
        raise Pending("pending (the rank is publishing it)")
    if signed != created:
        raise Refused(
            f"it was written for the key created at revision {signed}, and this key was "
            f"created at revision {created} (an entry of an earlier life of the key, put "
            "back: a dead rank's, replayed)"
        )
    return m
