"""Parsing and printing byte sizes for the command line: 4K, 64M, 1G, 4K-64M, 4K,1M."""

from __future__ import annotations

import argparse

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """'4K' -> 4096 (binary units). Raises ArgumentTypeError naming the text."""
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    if not num.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 4K, 64M, 1G)")
    value = int(num) * _UNITS[unit]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return value


def parse_size_list(text: str) -> list[int]:
    """'4K-64M' -> powers of two from 4 KiB to 64 MiB; '4K,1M' -> both; mixes allowed."""
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo_s, hi_s = part.split("-", 1)
            lo, hi = parse_size(lo_s), parse_size(hi_s)
            if lo > hi:
                raise argparse.ArgumentTypeError(f"range {part!r} runs backwards")
            v = lo
            while v <= hi:
                out.append(v)
                v *= 2
        else:
            out.append(parse_size(part))
    return sorted(set(out))


def parse_count_list(text: str) -> list[int]:
    """'1,16,256' -> [1, 16, 256]; '1-256' -> powers of two from 1 to 256."""
    out: list[int] = []
    for part in text.split(","):
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo < 1 or lo > hi:
                    raise ValueError
                v = lo
                while v <= hi:
                    out.append(v)
                    v *= 2
            else:
                v = int(part)
                if v < 1:
                    raise ValueError
                out.append(v)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a count >= 1 or a range like 1-256"
            ) from None
    return sorted(set(out))


def human(n: int) -> str:
    """4096 -> '4K', 3 << 20 -> '3M', 1000 -> '1000'."""
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def size_label(n: int) -> str:
    """A size as a person reads it on an axis: 512 -> '512 B', 4096 -> '4 KiB', 1 << 20 ->
    '1 MiB', 3 << 29 -> '1.5 GiB'."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.3g} {unit}"
    return f"{n} B"


def size_ticks(sizes: list[int], most: int = 9) -> list[tuple[int, str]]:
    """Ticks for a log2 axis over `sizes`: powers of two from the smallest to the largest,
    every second (or fourth...) one when there would be more than `most`, each with its
    `size_label`."""
    if not sizes:
        return []
    lo = max(1, min(sizes)).bit_length() - 1
    hi = max(max(sizes), 1 << lo).bit_length() - 1
    if (1 << hi) < max(sizes):
        hi += 1
    step = 1
    while (hi - lo) // step + 1 > most:
        step *= 2
    return [(1 << e, size_label(1 << e)) for e in range(lo, hi + 1, step)]
