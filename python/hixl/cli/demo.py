"""Prefill/decode disaggregation demo: a tiny numpy transformer whose prompt KV cache moves
layer by layer from a prefill process to a decode process over hixl."""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "PD-disaggregation demo: layerwise KV-cache transfer between two processes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    args.parser.error("the demo is not built yet")
    return 2
