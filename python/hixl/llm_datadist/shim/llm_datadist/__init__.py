"""Opt-in shim: ``import llm_datadist`` gives hixl's LLM-DataDist API (hixl.llm_datadist).
On PYTHONPATH only when asked for: ``PYTHONPATH=$(python -m hixl.llm_datadist)``."""

import sys

import hixl.llm_datadist as _impl

sys.modules[__name__] = _impl
