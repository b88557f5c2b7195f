"""hixl's own vLLM v1 KV connector, loaded by module path with no change to vLLM:

    KVTransferConfig(kv_connector="HixlConnector", kv_connector_module_path="hixl.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={...})

Built on hixl.kv's request handoff (a pool of vLLM's per-layer KV tensors, block lists
read one-sidedly). ``HixlConnector`` needs vLLM and is imported on first use, so that the
parts without vLLM (``_params``: the extra config, kv_transfer_params, the handshake)
import anywhere. https://github.com/hixl/hixl/blob/main/docs/VLLM.md has the keys
and the flow."""

from __future__ import annotations

from typing import Any

__all__ = ["HixlConnector"]


def __getattr__(name: str) -> Any:
    if name == "HixlConnector":
        from ._connector import HixlConnector

        return HixlConnector
    raise AttributeError(f"module 'hixl.vllm' has no attribute {name!r}")
