"""The ``hixl`` command: ``hixl bench``, ``hixl info``, ``hixl demo``, ``hixl stats`` and
``hixl secret``.

Every subcommand has ``--help``. Bad arguments print one line naming the value and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .. import __version__

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage dump), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> OneLineParser:
    from . import bench, demo, info, secret, stats

    ap = OneLineParser(
        prog="hixl",
        description=(
            "hixl: one-sided, batched, zero-copy transfers. Measure, inspect, demo; "
            "make a cluster secret."
        ),
    )
    ap.add_argument("--version", action="version", version=f"hixl {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for mod in (bench, info, demo, stats, secret):
        p = sub.add_parser(
            mod.NAME,
            help=mod.HELP,
            description=mod.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(run=mod.run, parser=p)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    from .. import HixlError

    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("hixl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`hixl stats | head`, a demo parent that was
        # interrupted): nothing is left to say to it. Point stdout at /dev/null so the flush at
        # exit does not raise again, and end as a process killed by SIGPIPE would.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except HixlError as exc:  # the run itself failed: say why in one line
        print(f"hixl {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
