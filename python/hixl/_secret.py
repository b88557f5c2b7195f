"""Where the Python layers take the cluster secret from: the engine's option, else its
environment variable (crates/hixl-core/src/options/mod.rs reads the same two). The engine has
checked the secret already when a layer asks: too weak a secret fails its initialize."""

from __future__ import annotations

from collections.abc import Mapping

#: the engine option and the environment variable that carry the cluster secret
SECRET_OPTION = "hixl.secret"
SECRET_ENV = "HIXL_SECRET"


def cluster_secret(options: Mapping[str, object], env: Mapping[str, str]) -> str | None:
    """The secret the engine uses: `options`' value, else `env`'s; None without one."""
    return str(options.get(SECRET_OPTION) or env.get(SECRET_ENV) or "") or None
