"""hixl as a Ray tensor transport (Ray Direct Transport, Ray 2.60): ``hixl.ray.register()`` in
the driver, before the actors are created, and ``@ray.method(tensor_transport="hixl")`` (or
``ray.put(x, _tensor_transport="hixl")`` in an actor) moves torch tensors out of band, the
receiver READing them straight from the sender's memory. https://github.com/hixl/hixl/blob/main/docs/RAY.md
"""

from __future__ import annotations

from ._transport import (
    HixlCommunicatorMetadata,
    HixlFetchRequest,
    HixlTensorTransport,
    HixlTransportMetadata,
    cuda_present,
)

__all__ = [
    "HixlCommunicatorMetadata",
    "HixlFetchRequest",
    "HixlTensorTransport",
    "HixlTransportMetadata",
    "TRANSPORT",
    "register",
]

#: The transport's name in Ray (Ray upper-cases names; ``tensor_transport="hixl"`` matches).
TRANSPORT = "HIXL"


def register() -> list[str]:
    """Registers the transport "HIXL" with Ray (``register_tensor_transport``) for devices
    ``["cpu"]``, plus ``"cuda"`` where torch sees CUDA; call it in the driver before creating
    the actors that use it (Ray hands it to them). A second call does nothing. Returns the
    devices registered."""
    import torch  # type: ignore[import-not-found,unused-ignore]
    from ray.experimental.rdt import util  # type: ignore[import-not-found]

    devices = ["cpu", "cuda"] if cuda_present() else ["cpu"]
    util._ensure_default_transports_registered()
    if TRANSPORT in util.transport_manager_info:
        return list(util.transport_manager_info[TRANSPORT].devices)
    from ray.experimental import register_tensor_transport  # type: ignore[import-not-found]

    register_tensor_transport(TRANSPORT, devices, HixlTensorTransport, torch.Tensor)
    return devices
