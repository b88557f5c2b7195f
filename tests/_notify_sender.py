"""A process that sends notifications when told: the peer of the notification tests of
tests/test_aio.py (driven through _lineproc.LineProc).

python _notify_sender.py TARGET
    An engine of its own on 127.0.0.1 connects to TARGET and prints "READY <its engine id>".
    Then, per line on stdin: "send NAME [NAME ...]" sends one notification per name (its msg
    "<name>#<how many this process has sent before>") and prints "SENT <count>" once the
    target has every one; "exit" (or end of input) finalizes and exits. A failure prints
    "ERR <message>".
"""

from __future__ import annotations

import sys

import hixl


def main(target: str) -> None:
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
        e.connect(target, timeout_ms=10_000)
        print(f"READY {e.local_engine}", flush=True)
        sent = 0
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] != "send":
                break
            try:
                for name in words[1:]:
                    e.send_notify(target, hixl.NotifyDesc(name, f"{name}#{sent}"), 10_000)
                    sent += 1
            except hixl.HixlError as exc:
                print(f"ERR {exc}", flush=True)
                continue
            print(f"SENT {sent}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
