"""Notifications of ``nixl_agent`` (``get_new_notifs``, ``update_notifs``,
``check_remote_xfer_done``, ``send_notif``): hixl notifications named ``"nixl:" + sender``.

The agent a notification is filed under comes from its connection where it can: one from the
engine of a loaded agent is that agent's, whatever its name says; one that names a loaded
agent but comes from another engine is dropped and logged. A sender that was never loaded
(a NIXL target need not load its initiators) is known only by the name it gives.

The agent owns its whole engine, so it takes every notification through the KV core's one
router (``_kvcore._notify.Router.take_all``); what it adds is the filing by agent. Taking,
filing and keeping (``update_notifs``) hold the agent's notification lock, so concurrent calls
neither lose a notification nor hand one out twice, and each agent's list keeps arrival order.
"""

from __future__ import annotations

import threading
from typing import Any

from .._errors import HixlError, NotConnected
from .._hixl import NotifyDesc
from .._kvcore._notify import Router
from ..kv._sender import same_engine
from ._bindings import from_hixl
from ._common import _NOTIF_PREFIX, _msg, _name, log
from ._metadata import _Metadata


def parse_notif(name: str, msg: str) -> tuple[str, bytes, bool]:
    """A received hixl notification (a peer's name and text) as NIXL sees it: (the agent it
    claims to come from, its message's bytes, whether it came as an agent's). An agent's
    (named "nixl:" + agent) carries bytes as latin-1 text (characters above U+00FF, which no
    agent sends, as UTF-8); a plain hixl engine's is filed under its notification name, its
    text as UTF-8. Every text gives a value: there is nothing to refuse."""
    if name.startswith(_NOTIF_PREFIX):
        key = name[len(_NOTIF_PREFIX) :]
        try:
            return key, msg.encode("latin-1"), True
        except UnicodeEncodeError:
            return key, msg.encode("utf-8", "surrogatepass"), True
    return name, msg.encode("utf-8", "surrogatepass"), False


class _Notifs(_Metadata):
    """Notifications: the part of ``nixl_agent`` that sends and collects them."""

    notifs: dict[str, list[bytes]]
    _router: Router  # the agent engine's notifications (all of them are the agent's)
    _notes_lock: threading.Lock  # taking, filing and keeping them: one caller at a time

    # --- notifications --------------------------------------------------------------------------

    @staticmethod
    def _sender(claimed: str, peer: str, agent: bool, loaded: list[tuple[str, str]]) -> str | None:
        """The key to file a notification under (None: a forgery, dropped). `agent`: it
        comes as an agent's (named "nixl:" + agent); `loaded`: (name, engine) of each loaded
        agent."""
        for name, engine in loaded:
            if same_engine(peer, engine):
                return name  # whatever it claims, plain hixl notifications included
        if any(name == claimed for name, _ in loaded):
            log.warning(
                "hixl.nixl: dropped a notification claiming agent %r from %r, which is not "
                "its engine",
                claimed,
                peer,
            )
            return None
        return claimed

    def _drain(self) -> dict[str, list[bytes]]:
        """The notifications that came since the last call, filed by agent (the caller holds
        ``_notes_lock``)."""
        out: dict[str, list[bytes]] = {}
        notes = self._router.take_all()
        with self._lock:
            loaded = [(r.name, r.engine) for r in self._remotes.values()]
        for n in notes:
            key, msg, agent = parse_notif(n.name, n.msg)
            filed = self._sender(key, n.peer, agent, loaded)
            if filed is not None:
                out.setdefault(filed, []).append(msg)
        return out

    def get_new_notifs(self, backends: Any = None) -> dict[str, list[bytes]]:
        with self._notes_lock:
            return self._drain()

    def update_notifs(self, backends: Any = None) -> dict[str, list[bytes]]:
        with self._notes_lock:
            self._keep()
        return self.notifs

    def _keep(self) -> None:
        """Adds the new notifications to ``notifs`` (the caller holds ``_notes_lock``)."""
        for k, v in self._drain().items():
            self.notifs.setdefault(k, []).extend(v)

    def check_remote_xfer_done(
        self,
        remote_agent_name: Any,
        lookup_tag: Any,
        backends: Any = None,
        tag_is_prefix: bool = True,
    ) -> bool:
        name, tag = _name(remote_agent_name), _msg(lookup_tag)
        with self._notes_lock:
            self._keep()
            msgs = self.notifs.get(name)
            if not msgs:
                return False
            for i, m in enumerate(msgs):
                if m.startswith(tag) if tag_is_prefix else tag in m:
                    del msgs[i]
                    return True
            return False

    def send_notif(self, remote_agent_name: Any, notif_msg: Any, backend: Any = None) -> None:
        if backend is not None and backend not in self.backends:
            raise KeyError(backend)
        r = self._remote(remote_agent_name)
        self._ready(r)
        try:
            self._engine.send_notify(
                r.engine, NotifyDesc(self._notif_name, _msg(notif_msg).decode("latin-1"))
            )
        except HixlError as e:
            if isinstance(e, NotConnected):
                r.ready = False
            raise from_hixl(e, f"notifying agent {r.name!r}") from e
