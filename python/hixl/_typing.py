"""Type aliases of the public signatures, as wide as what the calls accept at run time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

#: An option's value: a str, or an int or bool, which the engine reads as its text (True and
#: False as "1" and "0"): ``{"hixl.tcp.streams": 4, "hixl.strict_alignment": False}``.
OptionValue: TypeAlias = str | int | bool
#: Engine options, ``{key: value}``: a dict or any other mapping.
Options: TypeAlias = Mapping[str, OptionValue]
