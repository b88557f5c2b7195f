"""The text of a layer notification: what a layerwise push sends after each layer's bytes,
and what a receive reads (a peer's text: parsed strictly, every field bounded).

Two forms, one notification name (LAYER_NOTIFY):

* ``RANK:CACHE_NAME:LAYER``: a whole cache's layer (no request id), as ever;
* a JSON object ``{"rank": R, "cache": NAME, "layer": K, "request": ID, "bytes": N}``: the
  blocks of request ID in layer K, N bytes of them. It starts with ``{``, which no rank of
  the first form does, so a receiver that knows only the first form refuses it rather than
  misreading it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .._errors import ParamInvalid
from .._peertext import Malformed, decimal, integer, loads, obj, shown, text

#: Name of the notification a producer sends after each layer's bytes are visible.
LAYER_NOTIFY = "hixl.kv.layer"
#: The longest layer notification text a receive reads (a cache name is a few characters).
MAX_LAYER_TEXT = 8192
#: The largest rank or layer a layer notification may name.
MAX_INDEX = 2**63 - 1
#: The longest request id (characters); control characters are refused.
MAX_REQUEST_ID = 256
#: The keys of a request's layer notification, all required, no other allowed.
NOTE_KEYS = frozenset({"rank", "cache", "layer", "request", "bytes"})


@dataclass(frozen=True)
class LayerNote:
    """A parsed layer notification: who (rank) announces which layer of which cache, for
    which request (None: the whole cache) and how many bytes (None: the whole layer)."""

    rank: int
    cache: str
    layer: int
    request: str | None = None
    nbytes: int | None = None


def parse_layer(msg: str) -> tuple[int, str, int]:
    """A layer notification's text "RANK:CACHE_NAME:LAYER" (a peer's) as (rank, cache name,
    layer): rank and layer decimal integers in [0, MAX_INDEX], the name what lies between
    (it may hold ':'), at most MAX_LAYER_TEXT characters in all; Malformed otherwise."""
    if len(msg) > MAX_LAYER_TEXT:
        raise Malformed(
            f"layer notification of {len(msg)} characters, over the {MAX_LAYER_TEXT} accepted"
        )
    rank, sep, rest = msg.partition(":")
    name, sep2, layer = rest.rpartition(":")
    if not sep or not sep2:
        raise Malformed(f"layer notification {shown(msg)} is not RANK:CACHE_NAME:LAYER")
    return (
        decimal(rank, "layer notification's rank", 0, MAX_INDEX),
        name,
        decimal(layer, "layer notification's layer", 0, MAX_INDEX),
    )


def parse_note(msg: str) -> LayerNote:
    """Either form of a layer notification's text (see the module); Malformed for anything
    else: over MAX_LAYER_TEXT characters, JSON that is not exactly the five keys, a rank,
    layer or byte count that is no integer in [0, MAX_INDEX], a cache name that is no string,
    a request id that is empty, over MAX_REQUEST_ID characters or holds control characters."""
    if not msg.startswith("{"):
        return LayerNote(*parse_layer(msg))
    doc = obj(loads(msg, "layer notification", MAX_LAYER_TEXT), "layer notification")
    if set(doc) != NOTE_KEYS:
        raise Malformed(f"layer notification has keys {sorted(doc)[:8]}, not {sorted(NOTE_KEYS)}")
    cache = doc["cache"]
    if not isinstance(cache, str):
        raise Malformed(f"layer notification's cache must be a string, not {shown(cache)}")
    return LayerNote(
        integer(doc["rank"], "layer notification's rank", 0, MAX_INDEX),
        cache,
        integer(doc["layer"], "layer notification's layer", 0, MAX_INDEX),
        request_text(doc["request"], Malformed),
        integer(doc["bytes"], "layer notification's bytes", 0, MAX_INDEX),
    )


def request_text(v: object, error: type[ValueError] = ParamInvalid) -> str:
    """`v` as a request id: a non-empty string of at most MAX_REQUEST_ID characters without
    control characters; `error` (ParamInvalid for an argument, Malformed for a peer's text)
    naming it otherwise."""
    try:
        rid = text(v, "request id", MAX_REQUEST_ID)
    except Malformed as exc:
        raise error(str(exc)) from None
    if not rid:
        raise error("request id is empty")
    return rid


def note_text(rank: int, cache: str, layer: int, request: str | None, nbytes: int) -> str:
    """The text a producer sends for `layer`: the first form without a request id, the JSON
    one with it."""
    if request is None:
        return f"{rank}:{cache}:{layer}"
    doc = {"rank": rank, "cache": cache, "layer": layer, "request": request, "bytes": nbytes}
    return json.dumps(doc, separators=(",", ":"))
