"""LLMConfig (engine options) and LLMClusterInfo (a cluster to link to)."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from ._status import check
from ._types import LLMRole, check_int

#: LLMConfig attribute -> the option key generate_options() writes (LLM-DataDist's keys).
_OPTION_KEYS = {
    "listen_ip_info": "llm.listenIpInfo",
    "sync_kv_timeout": "llm.SyncKvCacheWaitTime",
    "deploy_res_path": "llm.deployResPath",
    "buf_pool_cfg": "llm.BufPoolCfg",
    "mem_pool_cfg": "llm.MemPoolConfig",
    "host_mem_pool_cfg": "llm.HostMemPoolConfig",
    "cluster_info": "llm.ClusterInfo",
    "output_max_size": "llm.OutputMaxSize",
    "link_total_time": "llm.LinkTotalTime",
    "link_retry_count": "llm.LinkRetryCount",
    "rdma_traffic_class": "llm.RdmaTrafficClass",
    "rdma_service_level": "llm.RdmaServiceLevel",
    "local_comm_res": "llm.LocalCommRes",
}
_BOOL_KEYS = {
    "enable_cache_manager": "llm.EnableCacheManager",
    "enable_remote_cache_accessible": "llm.EnableRemoteCacheAccessible",
}


class LLMConfig:
    """LLM-DataDist's configuration; ``generate_options()`` gives the options dict that
    ``LLMDataDist.init`` takes. What each option does on hixl:
    https://github.com/hixl/hixl/blob/main/docs/LLM_DATADIST.md.

    hixl adds ``hixl_options``: engine options (``hixl.*`` keys, e.g. ``hixl.backends``),
    passed through to the engine."""

    def __init__(self) -> None:
        self.device_id: int | list[int] | None = None
        self.listen_ip_info: str = ""
        self.sync_kv_timeout: int | None = None
        self.deploy_res_path: str = ""
        self.buf_pool_cfg: str = ""
        self.mem_pool_cfg: str = ""
        self.host_mem_pool_cfg: str = ""
        self.output_max_size: str = ""
        self.mem_utilization: float = 0.95
        self.enable_switch_role: bool = False
        self.link_total_time: int | None = None
        self.link_retry_count: int | None = None
        self.enable_cache_manager: bool | None = None
        self.enable_remote_cache_accessible: bool | None = None
        self.rdma_traffic_class: int | None = None
        self.rdma_service_level: int | None = None
        self.local_comm_res: str | None = None
        self.ge_options: dict[str, str] = {}
        self.hixl_options: dict[str, str] = {}
        self._cluster_info = ""

    @property
    def cluster_info(self) -> str:
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, v: str) -> None:
        try:
            json.loads(v)
        except (TypeError, ValueError) as exc:
            check(False, f"cluster_info is not JSON: {exc}")
        self._cluster_info = v

    @property
    def options(self) -> dict[str, str]:
        return self.generate_options()

    def generate_options(self) -> dict[str, str]:
        out: dict[str, str] = {str(k): str(v) for k, v in self.ge_options.items()}
        if self.device_id is not None:
            ids = self.device_id if isinstance(self.device_id, list) else [self.device_id]
            out["ge.exec.deviceId"] = ";".join(str(i) for i in ids)
            out["ge.session_device_id"] = str(ids[0])
        for attr, key in _OPTION_KEYS.items():
            v = getattr(self, attr) if attr != "cluster_info" else self._cluster_info
            if v is not None and v != "":
                out[key] = str(v)
        if self.local_comm_res is not None:
            out["llm.LocalCommRes"] = str(self.local_comm_res)
        for attr, key in _BOOL_KEYS.items():
            v = getattr(self, attr)
            if v is not None:
                out[key] = "1" if v else "0"
        if self.enable_switch_role:
            out["llm.EnableSwitchRole"] = "1"
        out["llm.MemoryUtilization"] = str(self.mem_utilization)
        out.update({str(k): str(v) for k, v in self.hixl_options.items()})
        return out

    gen_options = generate_options


LlmConfig = LLMConfig


def _ip(ip: Any) -> str:
    if isinstance(ip, int) and not isinstance(ip, bool):
        try:
            return str(ipaddress.IPv4Address(ip))
        except ValueError:
            check(False, f"ip={ip!r} is not an IPv4 address")
    check(isinstance(ip, str) and len(ip) > 0, f"ip={ip!r} must be a string or an int")
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        check(False, f"ip={ip!r} is not an IP address")
    return str(ip)


class LLMClusterInfo:
    """A remote cluster to link to: ``remote_cluster_id`` and its address,
    ``append_remote_ip_info(ip, port)`` (where its engine listens: its listen_ip_info).
    ``append_local_ip_info`` is accepted and ignored (hixl picks the local interface)."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | None = None
        self._local: list[tuple[str, int]] = []
        self._remote: list[tuple[str, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, v: int) -> None:
        self._remote_cluster_id = check_int("remote_cluster_id", v)

    @property
    def remote_role_type(self) -> LLMRole | None:
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, v: LLMRole | int) -> None:
        self._remote_role_type = v if isinstance(v, LLMRole) else LLMRole(v)

    @property
    def local_ip_info_list(self) -> list[tuple[str, int]]:
        return list(self._local)

    @property
    def remote_ip_info_list(self) -> list[tuple[str, int]]:
        return list(self._remote)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        self._local.append((_ip(ip), check_int("port", port, 0, 65535)))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        self._remote.append((_ip(ip), check_int("port", port, 0, 65535)))

    def __repr__(self) -> str:
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
            f"remote={self._remote}, local={self._local})"
        )
