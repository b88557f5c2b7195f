"""``HixlConnector``: the KVConnectorBase_V1 subclass vLLM loads by module path; each of
its two roles delegates to its half (_scheduler.Scheduler, _worker.Worker)."""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ._params import Handshake, Settings
from ._scheduler import Meta, Scheduler
from ._worker import Worker

log = logging.getLogger("hixl.vllm")


def _show_logs() -> None:
    """Shows the connector's INFO lines on stderr, as vLLM shows its own, unless the
    application routes hixl's logging itself."""
    if not logging.getLogger("hixl").hasHandlers():
        from .._logging import _fallback

        log.addHandler(_fallback)
        log.setLevel(logging.INFO)
        log.propagate = False


#: vLLM's kv_role -> hixl.kv's role of the engine's ranks.
ROLES = {"kv_producer": "prompt", "kv_consumer": "decoder", "kv_both": "mix"}


class HixlMeta(KVConnectorMetadata, Meta):  # type: ignore[misc]
    """The scheduler's step metadata as vLLM's type."""


class HixlHandshake(KVConnectorHandshakeMetadata, Handshake):  # type: ignore[misc]
    """A worker's Handshake as vLLM's type."""


class HixlConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """A vLLM v1 KV connector over hixl.kv: the decode reads a request's blocks from its
    prefill's pool (one-sided READs, runs of blocks merged, layer by layer), the prefill
    keeps them until then or for lease_s. Select it with
    ``KVTransferConfig(kv_connector="HixlConnector", kv_connector_module_path="hixl.vllm",
    kv_role=..., kv_connector_extra_config={...})`` (the keys:
    https://github.com/hixl/hixl/blob/main/docs/VLLM.md)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _show_logs()
        cfg = vllm_config.kv_transfer_config
        if cfg.kv_role not in ROLES:
            raise ValueError(f"HixlConnector: kv_role={cfg.kv_role!r} is not one of {list(ROLES)}")
        self.settings = Settings.from_extra(cfg.kv_connector_extra_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self._sched: Scheduler | None = None
        self._worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            bs = vllm_config.cache_config.block_size
            self._sched = Scheduler(self.settings, str(cfg.engine_id), tp, bs)
        else:
            from vllm.distributed.parallel_state import (  # type: ignore[import-not-found]
                get_tensor_model_parallel_rank,
            )

            blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
            self._worker = Worker(
                self.settings, ROLES[cfg.kv_role], get_tensor_model_parallel_rank(), tp, blocks
            )

    # -- scheduler side --------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HixlMeta:
        assert self._sched is not None
        m = self._sched.build_meta()
        return HixlMeta(m.loads, m.holds)

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        assert self._sched is not None
        return self._sched.finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._sched is not None:
            self._sched.set_handshakes(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return (0,)  # one group (no hybrid KV-cache manager): the request's own blocks

    # -- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> HixlHandshake | None:
        me = self._worker.me if self._worker is not None else None
        return None if me is None else HixlHandshake(me.tp_rank, me.address, me.rank, me.cache)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, Meta):
            self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish between steps: a request runs once its blocks are here

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # the decode reads; the prefill saves nothing

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        assert self._worker is not None
        sent, recvd, failed = self._worker.finished()
        return KVConnectorTransferResults(sent, recvd, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
