"""The numbers Mooncake's Python API returns, in one place.

Mooncake's calls return ``0`` for success and a negative code for failure; the codes below are
the ones ``mooncake-transfer-engine`` 0.3.13 returns for the same situations (observed against
that package; https://github.com/hixl/hixl/blob/main/docs/MOONCAKE.md lists which call returns
which).
"""

from __future__ import annotations

#: Success.
OK = 0
#: A bad argument, or a transfer that failed (Mooncake returns -1 for both).
ERR_INVALID_ARGUMENT = -1
#: The address given to ``unregister_memory`` was never registered.
ERR_ADDRESS_NOT_REGISTERED = -3
#: No device for the requested protocol (returned only under ``HIXL_MOONCAKE_STRICT=1``).
ERR_DEVICE_NOT_FOUND = -6
#: ``register_memory`` of a range overlapping one already registered.
ERR_ADDRESS_OVERLAPPED = -7
#: ``send_probe`` to a peer that did not answer (0.3.13 returns -102 for it).
ERR_PROBE_FAILED = -102

#: ``transfer_check_status``: still in flight.
CHECK_PENDING = 0
#: ``transfer_check_status``: every byte arrived (the id is forgotten afterwards).
CHECK_COMPLETED = 1
#: ``transfer_check_status``: failed (the id is forgotten afterwards).
CHECK_FAILED = -1
#: ``transfer_check_status``: its deadline passed (the id is forgotten afterwards).
CHECK_TIMEOUT = -2

#: The RPC port Mooncake uses when a hostname names none (outside P2PHANDSHAKE mode).
DEFAULT_RPC_PORT = 12001
#: ``metadata_server`` value for peer-to-peer handshakes without a metadata service.
P2P_HANDSHAKE = "P2PHANDSHAKE"

#: Environment: ``1`` makes an unavailable protocol fail ``initialize`` as Mooncake does.
ENV_STRICT = "HIXL_MOONCAKE_STRICT"
#: Environment: hixl's ``hixl.backends`` for every engine, whatever ``protocol`` says.
ENV_BACKENDS = "HIXL_MOONCAKE_BACKENDS"
#: Environment: seconds a first contact with a session may take (default 3, as hixl's connect).
ENV_CONNECT_TIMEOUT = "HIXL_MOONCAKE_CONNECT_TIMEOUT_S"
#: Default of ``HIXL_MOONCAKE_CONNECT_TIMEOUT_S``.
DEFAULT_CONNECT_TIMEOUT_S = 3.0
