"""Print a fresh cluster secret: 64 hex characters (256 random bits) and a newline.

Give every engine of a cluster the same value, through the option hixl.secret or the
environment variable HIXL_SECRET:

    export HIXL_SECRET=$(hixl secret)

Engines refuse (ParamInvalid at initialize) a secret shorter than 32 hex characters, one
with any character other than 0-9, a-f, A-F, or one with a pattern (a repeated block, few
different characters or steps, a long run counting up or down, digits or letters alone; see
README, Options): a short or guessable secret could be found offline from a single handshake.
What this prints is refused with probability under 1e-15. The secret authenticates both ends
of every stream and keys the MACs of its frames (see https://github.com/hixl/hixl/blob/main/docs/PROTOCOL.md);
it is never logged or shown.
"""

from __future__ import annotations

import argparse
import secrets

NAME = "secret"
HELP = "print a fresh cluster secret (64 hex characters) for hixl.secret / HIXL_SECRET"


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # no options


def run(args: argparse.Namespace) -> int:
    del args
    print(secrets.token_hex(32))
    return 0
