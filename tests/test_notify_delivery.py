"""A notification the target acknowledged is delivered, whatever the target does next."""

from __future__ import annotations

import contextlib

import pytest
from _lineproc import HERE, LineProc

import hixl

ROUNDS = 20


@pytest.mark.parametrize("backends", ["tcp", "shm"])
def test_send_notify_succeeds_when_the_target_finalizes_at_once(backends):
    # The target finalizes as soon as wait_notifies hands it the notification: send_notify
    # must not report a failure for a notification the target has (a retry would deliver it
    # twice). Over tcp the control channel and the data streams close together.
    target = LineProc([HERE / "_notify_bye.py"])
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": backends})
    failures = []
    try:
        for i in range(ROUNDS):
            tag, remote = target.cmd("round").split()
            assert tag == "ENGINE", remote
            e.connect(remote, timeout_ms=10_000)
            try:
                e.send_notify(remote, hixl.NotifyDesc("bye", ""), timeout_ms=10_000)
            except hixl.HixlError as x:
                failures.append(f"round {i}: {type(x).__name__}: {x}")
            assert target.line(60) == "GOT 1"
            with contextlib.suppress(hixl.HixlError):
                e.disconnect(remote)
    finally:
        e.finalize()
        target.close()
    assert not failures, f"{len(failures)} of {ROUNDS} raised though the target got it: {failures}"
