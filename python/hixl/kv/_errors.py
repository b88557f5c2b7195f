"""KVError: what the KV-cache layer raises, with an LLM-DataDist style ``status_code``."""

from __future__ import annotations

from .._errors import HixlError, ParamInvalid, Status

#: The transfer succeeded.
LLM_SUCCESS = "LLM_SUCCESS"
#: The remote cache does not exist (the message names the cache and the rank).
LLM_CACHE_NOT_FOUND = "LLM_002001"
#: The transfer is larger than the registered destination (the message names both sizes).
LLM_TOO_LARGE = "LLM_002002"
#: The two ranks may not link: both "prompt" or both "decoder".
LLM_ROLE_MISMATCH = "LLM_002003"
#: The rank is not linked (call hixl.kv.link or pass it in peers=).
LLM_NOT_LINKED = "LLM_002004"


class KVError(HixlError):
    """An error of the KV-cache layer. ``status_code`` is one of the ``LLM_00200x`` strings
    above, or, when the engine failed, the engine's numeric code as a string (``"103901"``
    for a timeout); ``code`` is always the numeric engine status, and ``__cause__`` is the
    engine's own HixlError when there is one."""

    def __init__(self, status_code: str, message: str, status: Status = Status.PARAM_INVALID):
        super().__init__(message)
        self.status_code = status_code
        self.status = status

    def __str__(self) -> str:
        """``"LLM_002001: message"`` for the KV layer's own codes; ``"NAME (code): message"``,
        as every HixlError, when the engine failed (the code once)."""
        if self.status_code == str(self.code):
            return HixlError.__str__(self)
        return f"{self.status_code}: {self.message}"

    @classmethod
    def from_engine(cls, err: HixlError, what: str) -> KVError:
        """The KVError of an engine error while doing `what` (a PARAM_INVALID one is a
        ``KVParamInvalid``, also a ``ParamInvalid``), with `err` as its cause."""
        make = KVParamInvalid if err.status == Status.PARAM_INVALID else cls
        out = make(str(err.code), f"{what}: {err.message}", err.status)
        out.__cause__ = err
        return out


class KVParamInvalid(KVError, ParamInvalid):
    """A KVError for a bad argument (PARAM_INVALID, ``status_code`` ``"103900"``): also
    ``hixl.ParamInvalid`` and so a ``ValueError``, whether the KV layer or the engine refused
    it (a block id out of range, block lists of different lengths, a range outside the
    registered regions)."""


# The seed article's engine error names, as aliases of the matching status codes (compare
# with ``err.status`` or ``err.code`` of any HixlError, a KVError included).
#: Registration failed (the memory overlaps a registered region, or is not usable memory).
HIXL_001001 = Status.PARAM_INVALID
#: Link timeout: the peer did not answer (not started, wrong address, network).
HIXL_001002 = Status.TIMEOUT
#: Invalid handle: the instance was finalized (use after finalize).
HIXL_001003 = Status.FAILED
