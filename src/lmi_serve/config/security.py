"""Access-control options (docs/security.md): API keys, the management switch, the adapters root.

`SecurityConfig` is the server-wide block of options, built once by the launcher (`build_security`)
from `option.<key>` (serving.properties or `OPTION_<KEY>`) or `LMI_SERVE_<KEY>`; it holds SHA-256
digests of the keys, never the keys, so neither the startup log nor anything that dumps the config
can show one. Only the stdlib and pydantic are imported (the launcher runs this before torch). The
gate that enforces it on every request is server/security.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: The server-wide options of this block: option key -> ServerConfig.security field.
OPTION_KEYS = ("api_keys", "api_keys_file", "admin_api_keys", "admin_api_keys_file", "public_metrics",
               "enable_management_api", "adapters_root")


class SecurityError(ValueError):
    """A bad security option; the message starts with the key (config/sources.py turns it into ConfigError)."""


class SecurityConfig(BaseModel):
    """The resolved access-control options. Digests are hex SHA-256 of each key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key_digests: tuple[str, ...] = ()
    admin_key_digests: tuple[str, ...] = ()
    public_metrics: bool = False  # /metrics answers without a key (a scraper without credentials)
    enable_management_api: bool = False  # the adapters register / update / unregister routes
    adapters_root: str | None = None  # the folder adapters may be registered from (default: <model dir>/adapters)
    sources: dict[str, str] = Field(default_factory=dict)  # field -> the key it was read from (for the log)

    @property
    def keys_required(self) -> bool:
        return bool(self.api_key_digests)

    def describe(self) -> list[str]:
        """The startup log's lines: counts, never keys or digests."""
        keys = f"on, {len(self.api_key_digests)} key(s)" if self.api_key_digests else "off (no key is required)"
        admin = (f"{len(self.admin_key_digests)} admin key(s)" if self.admin_key_digests
                 else "the API keys" if self.api_key_digests else "no key")
        management = f"on ({admin})" if self.enable_management_api else "off"
        return [f"  api keys = {keys}",
                f"  metrics = {'public' if self.public_metrics or not self.api_key_digests else 'key required'}",
                f"  management api = {management}",
                f"  adapters_root = {self.adapters_root or '<model dir>/adapters'}"]


# --- building the block from options -------------------------------------------------------------

def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _split_keys(text: str) -> list[str]:
    return [k.strip() for k in text.replace("\n", ",").split(",") if k.strip()]


def _read_key_file(path: str, source: str) -> list[str]:
    """A file of keys: one per line (commas also split); blank lines and `#` comments are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SecurityError(f"{source}: cannot read {path!r} ({exc.strerror or exc})") from None
    keys = [k for line in text.splitlines() if not line.strip().startswith("#") for k in _split_keys(line)]
    if not keys:
        raise SecurityError(f"{source}: {path!r} holds no key")
    return keys


def _bool(text: str, source: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise SecurityError(f"{source}: {text!r} is not a boolean (use true/false, 1/0, yes/no)")


def server_option(key: str, env: Mapping[str, str], model_options: Sequence[tuple[str, Mapping[str, str]]]
                  ) -> tuple[str, str] | None:
    """A server-wide option as (value, the key it came from): `option.<key>` of the models (their
    serving.properties, else `OPTION_<KEY>`, config/sources.py's precedence), else `LMI_SERVE_<KEY>`.
    Models that set it must agree: one server has one value. `model_options`: (name, options)."""
    values = {(options.get(key) or "").strip() for _, options in model_options} - {""}
    if len(values) > 1:
        names = ", ".join(name for name, options in model_options if (options.get(key) or "").strip())
        raise SecurityError(f"option.{key}: the models ({names}) set different values; it is server-wide, so set "
                            f"it once (in the environment as OPTION_{key.upper()}) or the same in each")
    if values:
        return values.pop(), f"option.{key}"
    env_name = f"LMI_SERVE_{key.upper()}"
    value = env.get(env_name, "").strip()
    return (value, env_name) if value else None


def build_security(env: Mapping[str, str], model_options: Sequence[tuple[str, Mapping[str, str]]]
                   ) -> SecurityConfig:
    """The SecurityConfig of these options; SecurityError naming the key for a bad value."""
    def get(key: str) -> tuple[str, str] | None:
        return server_option(key, env, model_options)

    def keys(list_key: str, file_key: str) -> tuple[tuple[str, ...], str | None]:
        found: list[str] = []
        sources = []
        for key, read in ((list_key, lambda v, s: _split_keys(v)), (file_key, _read_key_file)):
            hit = get(key)
            if hit:
                found += read(*hit)
                sources.append(hit[1])
        return tuple(dict.fromkeys(digest(k) for k in found)), " + ".join(sources) or None

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    values["api_key_digests"], sources["api_keys"] = keys("api_keys", "api_keys_file")
    values["admin_key_digests"], sources["admin_api_keys"] = keys("admin_api_keys", "admin_api_keys_file")
    for flag in ("public_metrics", "enable_management_api"):
        hit = get(flag)
        if hit:
            values[flag], sources[flag] = _bool(*hit), hit[1]
    root = get("adapters_root")
    if root:
        path = Path(root[0]).expanduser()
        if not path.is_absolute() or not path.is_dir():
            raise SecurityError(f"{root[1]}: {root[0]!r} is not an absolute path to a folder")
        values["adapters_root"], sources["adapters_root"] = str(path.resolve()), root[1]
    if values["admin_key_digests"] and not values.get("enable_management_api"):
        raise SecurityError(f"{sources['admin_api_keys']}: admin keys are set but the management API is off "
                            "(set option.enable_management_api=true, or drop the admin keys)")
    return SecurityConfig(**values, sources={k: v for k, v in sources.items() if v})
