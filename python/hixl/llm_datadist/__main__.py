"""``python -m hixl.llm_datadist`` prints the directory to put on PYTHONPATH so that
unchanged programs' ``import llm_datadist`` gets hixl's implementation."""

from . import SHIM_PATH

print(SHIM_PATH)
