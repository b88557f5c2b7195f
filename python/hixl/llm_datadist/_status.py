"""LLMStatusCode, LLMException and Status: the error model of LLM-DataDist's Python API.

Numbers: where LLM-DataDist's public C++ header gives a code (``0x5010B0xx``), the member has
that value; the others (Python-only codes) have hixl's own values in the same range.
Programs compare members (``ret == LLMStatusCode.LLM_SUCCESS``), never numbers.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from .._errors import HixlError
from .._errors import Status as HixlStatus


class LLMStatusCode(Enum):
    """What every call reports: returned by link_clusters / unlink_clusters / CacheTask, and
    carried by LLMException.status_code."""

    LLM_SUCCESS = 0x0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 0x5010B01D
    LLM_SUSPECT_REMOTE_ERROR = 0x5010B01E
    LLM_UNKNOWN_ERROR = -1
    # The spelling LLM-DataDist's package uses is LLM_SEQ_LENOVERLIMIT; this is the readable
    # alias (the same member).
    LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011


class LLMException(RuntimeError):
    """Raised by every failing call; ``status_code`` is an LLMStatusCode. When the engine
    failed, ``__cause__`` is hixl's own HixlError (with its numeric ``code``)."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_FAILED):
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __str__(self) -> str:
        return f"{self._status_code.name}: {super().__str__()}"


class Status:
    """A status as a value: ``is_ok()`` and ``status_code``."""

    def __init__(self, status: LLMStatusCode) -> None:
        self._status_code = status

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __repr__(self) -> str:
        return f"Status({self._status_code.name})"


#: How hixl's engine statuses map onto LLM-DataDist's.
_FROM_HIXL = {
    HixlStatus.PARAM_INVALID: LLMStatusCode.LLM_PARAM_INVALID,
    HixlStatus.TIMEOUT: LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    HixlStatus.NOT_CONNECTED: LLMStatusCode.LLM_NOT_YET_LINK,
    HixlStatus.ALREADY_CONNECTED: LLMStatusCode.LLM_ALREADY_LINK,
    HixlStatus.NOTIFY_FAILED: LLMStatusCode.LLM_FAILED,
    HixlStatus.UNSUPPORTED: LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
    HixlStatus.RESOURCE_EXHAUSTED: LLMStatusCode.LLM_OUT_OF_MEMORY,
    HixlStatus.FAILED: LLMStatusCode.LLM_FAILED,
}

#: hixl.kv's LLM_00200x status strings -> LLM-DataDist's codes.
_FROM_KV_LAYER = {
    "LLM_002001": LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    "LLM_002002": LLMStatusCode.LLM_PARAM_INVALID,
    "LLM_002003": LLMStatusCode.LLM_LINK_FAILED,
    "LLM_002004": LLMStatusCode.LLM_NOT_YET_LINK,
}


def code_of(exc: BaseException) -> LLMStatusCode:
    """The LLMStatusCode that describes `exc` (LLM_FAILED for anything unknown)."""
    if isinstance(exc, LLMException):
        return exc.status_code
    sc = getattr(exc, "status_code", None)
    if isinstance(sc, str) and sc in _FROM_KV_LAYER:
        return _FROM_KV_LAYER[sc]
    if isinstance(exc, HixlError):
        return _FROM_HIXL.get(exc.status, LLMStatusCode.LLM_FAILED)
    return LLMStatusCode.LLM_FAILED


def wrap(exc: BaseException, what: str) -> LLMException:
    """An LLMException for `exc` (unchanged if it already is one), naming `what` failed."""
    if isinstance(exc, LLMException):
        return exc
    out = LLMException(f"{what}: {exc}", status_code=code_of(exc))
    out.__cause__ = exc
    return out


def fail(code: LLMStatusCode, message: str) -> LLMException:
    return LLMException(message, status_code=code)


def check(pred: bool, message: str, code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID) -> None:
    """Raises LLMException(code) with `message` unless `pred`."""
    if not pred:
        raise LLMException(message, status_code=code)
