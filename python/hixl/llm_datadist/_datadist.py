"""LLMDataDist: one process's endpoint (cluster_id, role), its links and its cache manager."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _place
from .._errors import HixlError
from .._hixl import Hixl
from .._kvcore._links import in_parallel
from .._typing import Options, OptionValue
from ..kv._context import PeerRank as KvClusterInfo
from . import _ranktable
from ._config import LLMClusterInfo
from ._manager import CacheManager, KvCacheManager
from ._node import Node
from ._status import LLMException, LLMStatusCode, check, fail, wrap
from ._types import ROLE_NAMES, LLMRole, RegisterMemStatus, check_int

log = logging.getLogger("hixl.llm_datadist")

#: Most clusters one link_clusters / unlink_clusters call takes (LLM-DataDist's limit).
MAX_CLUSTERS = 16
#: Default of llm.SyncKvCacheWaitTime (ms): how long one transfer may take.
DEFAULT_TIMEOUT_MS = 5000
#: Default of llm.LinkTotalTime (ms) for the rank-table link().
DEFAULT_LINK_MS = 30_000


def _option_text(v: OptionValue) -> str:
    """An option's value as the engine reads it: True and False are "1" and "0"."""
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def _on(options: Mapping[str, str], key: str) -> bool:
    return str(options.get(key, "0")).strip().lower() in ("1", "true")


def _int_option(options: Mapping[str, str], key: str, default: int) -> int:
    v = options.get(key)
    if v is None or v == "":
        return default
    try:
        out = int(str(v))
    except ValueError:
        out = -1
    check(out > 0, f"option {key}={v!r} must be an integer > 0")
    return out


def _secret(engine_opts: Mapping[str, str]) -> bool:
    """Whether the engine has a cluster secret (its option, else HIXL_SECRET)."""
    return bool(engine_opts.get("hixl.secret") or os.environ.get("HIXL_SECRET"))


def _listen(v: str) -> str:
    host, sep, port = v.rpartition(":")
    check(bool(sep) and bool(host) and port.isdigit(), f"listen_ip_info={v!r} is not ip:port")
    return v


class _RankLink:
    """A rank-table link() in progress or done (query_register_mem_status polls it)."""

    def __init__(self, clusters: list[int]) -> None:
        self.clusters = clusters
        self.status = RegisterMemStatus.PREPARING
        self.error: BaseException | None = None


class LLMDataDist:
    """An LLM-DataDist endpoint on hixl: ``LLMDataDist(role, cluster_id)``, then
    ``init(options)``. One per process, as on Ascend."""

    llm_engine_instance: LLMDataDist | None = None

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check(isinstance(role, LLMRole), f"role={role!r} must be an LLMRole")
        self._role = role
        self._cluster_id = check_int("cluster_id", cluster_id)
        self._node: Node | None = None
        self._cache_manager: CacheManager | None = None
        self._kv_cache_manager: KvCacheManager | None = None
        self._options: dict[str, str] = {}
        self._enable_cache_mgr = False
        self._remote_accessible = False
        self._switch_role = False
        self._rank_links: dict[int, _RankLink] = {}
        self._next_comm = 1
        self._lock = threading.Lock()
        #: hixl: why each cluster of the last link_clusters call failed (cluster -> text).
        self.link_errors: dict[int, str] = {}

    # -- life cycle ------------------------------------------------------------------------

    def init(self, options: Options) -> None:
        """Starts the engine. Options (LLMConfig.generate_options()): llm.listenIpInfo is
        where peers reach this process (default 127.0.0.1 on a free port, or $HIXL_LISTEN);
        llm.SyncKvCacheWaitTime bounds each transfer; llm.EnableCacheManager selects
        cache_manager (else kv_cache_manager); llm.hixlDeviceIp (this rank's device_ip in a
        rank table without ports) listens at once at its derived address, device_ip and
        llm.hixlDevicePortBase + ge.exec.deviceId, and fails naming it when another process
        holds it; hixl.* keys go to the engine; the rest are accepted and ignored
        (https://github.com/hixl/hixl/blob/main/docs/LLM_DATADIST.md). Values are str, int or
        bool (True and False read as "1" and "0", as the engine reads them)."""
        if self._node is not None:
            return
        check(isinstance(options, Mapping), f"options must be a dict, not {type(options).__name__}")
        if LLMDataDist.llm_engine_instance is not None:
            raise fail(
                LLMStatusCode.LLM_FAILED, "an LLMDataDist is already initialized in this process"
            )
        opts = {str(k): _option_text(v) for k, v in options.items()}
        local_comm = "llm.LocalCommRes" in opts
        self._enable_cache_mgr = _on(opts, "llm.EnableCacheManager") or (
            local_comm and "llm.EnableCacheManager" not in opts
        )
        self._remote_accessible = _on(opts, "llm.EnableRemoteCacheAccessible") or (
            local_comm and "llm.EnableRemoteCacheAccessible" not in opts
        )
        self._switch_role = _on(opts, "llm.EnableSwitchRole")
        timeout = _int_option(opts, "llm.SyncKvCacheWaitTime", DEFAULT_TIMEOUT_MS)
        listen = opts.get("llm.listenIpInfo") or os.environ.get("HIXL_LISTEN", "127.0.0.1:0")
        derived = _ranktable.own_address(opts)
        if derived is not None:
            given = opts.get("llm.listenIpInfo")
            check(
                given in (None, "", derived),
                f"{_ranktable.DEVICE_IP_OPTION} puts this process at {derived}, but "
                f"llm.listenIpInfo={given!r}: give one of them",
            )
            listen = derived
        dev = opts.get("ge.exec.deviceId", "0").split(";")[0]
        engine_opts = {k: v for k, v in opts.items() if k.startswith("hixl.")}
        try:
            self._node = Node(
                self._cluster_id,
                ROLE_NAMES[self._role],
                _listen(listen),
                int(dev) if dev.isdigit() else 0,
                engine_opts,
                timeout,
            )
        except HixlError as exc:
            if derived is not None:
                raise wrap(
                    exc,
                    f"LLMDataDist.init: cannot listen at {derived}, the derived address of "
                    f"{_ranktable.DEVICE_IP_OPTION} (port {derived.rpartition(':')[2]} = "
                    f"{_ranktable.PORT_BASE_OPTION} + ge.exec.deviceId; another process may "
                    "hold it, and would get the links meant for this rank)",
                ) from exc
            raise wrap(exc, f"LLMDataDist.init (listen {listen})") from exc
        self._options = opts
        if derived is not None and not _secret(engine_opts):
            log.warning(
                "LLMDataDist.init: listening at the derived address %s without a secret "
                "(hixl.secret / HIXL_SECRET): peers link to whatever answers at a derived "
                "port; give every cluster the secret",
                derived,
            )
        if self._enable_cache_mgr:
            self._cache_manager = CacheManager(self._node, self._remote_accessible)
        else:
            self._kv_cache_manager = KvCacheManager(self._node, self._remote_accessible)
        LLMDataDist.llm_engine_instance = self

    def _engine_opts(self) -> dict[str, str]:
        return {k: v for k, v in self._options.items() if k.startswith("hixl.")}

    def finalize(self) -> None:
        """Stops the engine (every cache is deregistered, every link closed). Idempotent."""
        node, self._node = self._node, None
        if node is None:
            return
        for m in (self._cache_manager, self._kv_cache_manager):
            if m is not None:
                m._initialized = False
        node.close()
        if LLMDataDist.llm_engine_instance is self:
            LLMDataDist.llm_engine_instance = None

    def _live(self) -> Node:
        if self._node is None:
            raise fail(LLMStatusCode.LLM_FAILED, "LLMDataDist is not initialized: call init()")
        return self._node

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def role(self) -> LLMRole:
        return self._role

    @property
    def local_address(self) -> str:
        """hixl: the ip:port this process's engine listens on (after port 0)."""
        return str(self._live().ctx.address)

    @property
    def engine(self) -> Hixl:
        """hixl: the engine behind this LLMDataDist (another one after switch_role). The
        application's own notifications reach its get_notifies / wait_notifies; this layer
        takes only its own (hixl.lldd.*)."""
        return self._live().ctx.engine

    @property
    def cache_manager(self) -> CacheManager:
        self._live()
        if self._cache_manager is None:
            raise fail(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "cache_manager needs LLMConfig.enable_cache_manager = True "
                "(without it, use kv_cache_manager)",
            )
        return self._cache_manager

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        self._live()
        if self._kv_cache_manager is None:
            raise fail(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "kv_cache_manager is the API without enable_cache_manager; use cache_manager",
            )
        return self._kv_cache_manager

    # -- links ------------------------------------------------------------------------------

    def _link_one(self, cluster: LLMClusterInfo, timeout_ms: int) -> LLMStatusCode:
        node = self._live()
        rid = cluster.remote_cluster_id
        assert rid is not None
        with node.ctx.lock:
            linked = rid in node.ctx.peers
        if linked:
            with node.lock:
                if rid not in node.back:
                    return LLMStatusCode.LLM_ALREADY_LINK
                node.back.discard(rid)  # a way back opened on demand becomes this link
            return LLMStatusCode.LLM_SUCCESS
        ip, port = cluster.remote_ip_info_list[0]
        role = None if cluster.remote_role_type is None else ROLE_NAMES[cluster.remote_role_type]
        try:
            node.ctx.link_all([KvClusterInfo(rid, role, f"{ip}:{port}")], timeout_ms)
        except Exception as exc:  # noqa: BLE001 - reported per cluster
            self.link_errors[rid] = str(exc)
            log.warning("link to cluster %s at %s:%s failed: %s", rid, ip, port, exc)
            return LLMStatusCode.LLM_LINK_FAILED
        node.hello(f"{ip}:{port}")
        return LLMStatusCode.LLM_SUCCESS

    def _clusters(self, clusters: Any, timeout: Any) -> list[LLMClusterInfo]:
        check_int("timeout", timeout, 1, 2**31 - 1)
        check(
            isinstance(clusters, (list, tuple))
            and all(isinstance(c, LLMClusterInfo) for c in clusters),
            "clusters must be a list or tuple of LLMClusterInfo",
        )
        for c in clusters:
            check(c.remote_cluster_id is not None, f"{c!r} has no remote_cluster_id")
        return list(clusters)

    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Links to every cluster at once (each at its remote ip info, retrying while it is
        not up yet, within `timeout` ms). Returns (LLM_SUCCESS only if all linked, the status
        of each cluster): LLM_ALREADY_LINK, LLM_LINK_FAILED (reason in link_errors)."""
        node = self._live()
        cl = self._clusters(clusters, timeout)
        if len(cl) > MAX_CLUSTERS:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(cl)
        for c in cl:
            check(
                len(c.remote_ip_info_list) > 0,
                f"cluster {c.remote_cluster_id}: call append_remote_ip_info(ip, port) first",
            )
        self.link_errors = {}
        rets = [LLMStatusCode.LLM_FAILED] * len(cl)

        def run(i: int) -> None:
            rets[i] = self._link_one(cl[i], timeout)

        in_parallel(run, len(cl), "hixl-lldd-link")
        del node
        ok = all(r == LLMStatusCode.LLM_SUCCESS for r in rets)
        return (LLMStatusCode.LLM_SUCCESS if ok else LLMStatusCode.LLM_LINK_FAILED), rets

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000, force: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Closes the link with each cluster: the one this side made (without force the
        peer is told, and closes its way back), or the way back to a cluster that linked to
        this side. A cluster linked neither way gives LLM_NOT_YET_LINK, or LLM_SUCCESS with
        force=True (nothing to tear down)."""
        node = self._live()
        cl = self._clusters(clusters, timeout)
        check(isinstance(force, bool), f"force={force!r} must be a bool")
        if len(cl) > MAX_CLUSTERS:
            code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
            return code, [code] * len(cl)
        rets = []
        for c in cl:
            rid = int(c.remote_cluster_id)  # type: ignore[arg-type]
            with node.ctx.lock:
                peer = node.ctx.peers.get(rid)
            with node.lock:
                routed, back = rid in node.routes, rid in node.back
            if peer is None and not routed:
                rets.append(LLMStatusCode.LLM_SUCCESS if force else LLMStatusCode.LLM_NOT_YET_LINK)
                continue
            try:
                if routed:
                    node.forget_route(rid)
                if peer is not None and not back:
                    if not force:
                        node.bye(peer.address)
                    node.ctx.unlink(rid)
                rets.append(LLMStatusCode.LLM_SUCCESS)
            except HixlError as exc:
                log.warning("unlink from cluster %s failed: %s", rid, exc)
                rets.append(LLMStatusCode.LLM_UNLINK_FAILED)
        ok = all(r == LLMStatusCode.LLM_SUCCESS for r in rets)
        return (LLMStatusCode.LLM_SUCCESS if ok else LLMStatusCode.LLM_UNLINK_FAILED), rets

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Returns if the link to the cluster works (one one-sided read of its directory);
        raises LLMException (LLM_NOT_YET_LINK, LLM_LINK_FAILED, ...) otherwise."""
        node = self._live()
        rid = check_int("remote_cluster_id", remote_cluster_id)
        try:
            node.view(rid)
        except LLMException as exc:
            code = exc.status_code
            if code == LLMStatusCode.LLM_FAILED:
                code = LLMStatusCode.LLM_LINK_FAILED
            raise fail(code, f"the link to cluster {rid} does not work: {exc}") from exc

    # -- rank-table links -------------------------------------------------------------------

    def link(self, comm_name: str, cluster_rank_info: Mapping[int, int], rank_table: str) -> int:
        """Rank-table style link: every cluster in cluster_rank_info (cluster_id -> rank_id)
        is linked, in the background, at the address its rank's device entry gives:
        "device_ip" (else "host_ip") and "device_port", or without one llm.hixlDevicePortBase
        (default 16666) + "device_id". This cluster first listens at its own rank's address
        (the engine moves there unless it is there already). Returns a comm id for
        query_register_mem_status (PREPARING, then OK or FAILED) and unlink."""
        node = self._live()
        check(
            isinstance(comm_name, str) and 0 < len(comm_name) < 128,
            "comm_name must be 1..127 chars",
        )
        check(
            isinstance(cluster_rank_info, Mapping) and len(cluster_rank_info) > 1,
            "cluster_rank_info must map at least two cluster ids to ranks",
        )
        ranks = {
            check_int("cluster id", c): check_int("rank", r) for c, r in cluster_rank_info.items()
        }
        check(
            self._cluster_id in ranks,
            f"cluster_rank_info does not name this cluster ({self._cluster_id})",
        )
        table = _ranktable.entries(rank_table)
        base = _ranktable.port_base(self._options)
        own = table.get(ranks[self._cluster_id])
        check(
            own is not None,
            f"rank_table has no device with rank_id {ranks[self._cluster_id]} (this cluster, "
            f"{self._cluster_id})",
        )
        assert own is not None
        own_addr = _ranktable.address(own, base)
        port = own[0].get("device_port", own[0].get("port"))
        derived = port is None or str(port) == ""
        if derived and node.ctx.address != own_addr:
            log.warning(
                "link: binding this rank's derived address %s only now: a process that took "
                "that port first gets the links meant for it; give %s at init to bind it there",
                own_addr,
                _ranktable.DEVICE_IP_OPTION,
            )
        if derived and not _secret(self._engine_opts()):
            log.warning(
                "link: the rank table names no ports (derived: %s + device_id) and there is no "
                "secret (hixl.secret / HIXL_SECRET): a process holding a derived port is "
                "linked to as that rank; give every cluster the secret",
                _ranktable.PORT_BASE_OPTION,
            )
        self._listen_at(node, own_addr)
        targets = []
        for cid, rank in ranks.items():
            if cid == self._cluster_id:
                continue
            d = table.get(rank)
            check(d is not None, f"rank_table has no device with rank_id {rank} (cluster {cid})")
            assert d is not None
            ip, _, port = _ranktable.address(d, base).rpartition(":")
            info = LLMClusterInfo()
            info.remote_cluster_id = cid
            info.append_remote_ip_info(ip.strip("[]"), int(port))
            targets.append(info)
        with self._lock:
            comm_id = self._next_comm
            self._next_comm += 1
            job = _RankLink([int(c.remote_cluster_id or 0) for c in targets])
            self._rank_links[comm_id] = job
        total = _int_option(self._options, "llm.LinkTotalTime", DEFAULT_LINK_MS)

        def run() -> None:
            codes = [self._link_one(c, total) for c in targets]
            bad = [
                c
                for c in codes
                if c not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK)
            ]
            job.status = RegisterMemStatus.FAILED if bad else RegisterMemStatus.OK

        del node
        _place.thread(run, name="hixl-lldd-link").start()
        return comm_id

    def _listen_at(self, node: Node, address: str) -> None:
        """Moves this cluster's engine to ``address`` (its own rank's in the rank table) unless
        it listens there already; refused with LLM_EXIST_LINK while it has links of its own."""
        if node.ctx.address == address:
            return
        linked = node.explicit_links()
        if linked:
            raise fail(
                LLMStatusCode.LLM_EXIST_LINK,
                f"the rank table puts this cluster at {address}, but it listens at "
                f"{node.ctx.address} and is linked to clusters {linked}: unlink them first",
            )
        try:
            node.restart(ROLE_NAMES[self._role], address)
        except HixlError as exc:
            raise wrap(exc, f"link: listening at this rank's address {address}") from exc
        log.info("link: this cluster now listens at %s (its rank's in the rank table)", address)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        self._live()
        job = self._rank_links.get(check_int("comm_id", comm_id))
        if job is None:
            raise fail(LLMStatusCode.LLM_PARAM_INVALID, f"comm_id={comm_id} is unknown")
        return job.status

    def unlink(self, comm_id: int) -> None:
        node = self._live()
        with self._lock:
            job = self._rank_links.get(check_int("comm_id", comm_id))
        if job is None:
            raise fail(LLMStatusCode.LLM_PARAM_INVALID, f"comm_id={comm_id} is unknown")
        deadline = time.monotonic() + 10
        while job.status == RegisterMemStatus.PREPARING and time.monotonic() < deadline:
            time.sleep(0.01)
        for cid in job.clusters:  # the comm domain goes: this side's link and the way back
            with node.ctx.lock:
                peer = node.ctx.peers.get(cid)
            node.forget_route(cid)
            if peer is None:
                continue
            node.bye(peer.address)
            try:
                node.ctx.unlink(cid)
            except HixlError as exc:
                raise wrap(exc, f"unlink from cluster {cid}") from exc
        with self._lock:
            self._rank_links.pop(comm_id, None)

    # -- roles --------------------------------------------------------------------------

    def switch_role(self, role: LLMRole, switch_options: Options | None = None) -> None:
        """Changes this process's role. Every link must be closed first (LLM_EXIST_LINK).
        The engine restarts (at switch_options' llm.listenIpInfo when given, else on a free
        port) and every cache is registered again at the same addresses."""
        node = self._live()
        check(isinstance(role, LLMRole), f"role={role!r} must be an LLMRole")
        if not self._enable_cache_mgr and not self._switch_role:
            raise fail(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "switch_role needs LLMConfig.enable_switch_role = True",
            )
        opts = {str(k): _option_text(v) for k, v in (switch_options or {}).items()}
        linked = node.explicit_links()
        if linked:
            raise fail(LLMStatusCode.LLM_EXIST_LINK, f"unlink clusters {linked} before switch_role")
        listen = opts.get("llm.listenIpInfo") or os.environ.get("HIXL_LISTEN", "127.0.0.1:0")
        try:
            node.restart(ROLE_NAMES[role], _listen(listen))
        except HixlError as exc:
            raise wrap(exc, f"switch_role (listen {listen})") from exc
        self._role = role


def _shutdown() -> None:
    inst = LLMDataDist.llm_engine_instance
    if inst is not None:
        try:
            inst.finalize()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


atexit.register(_shutdown)
