"""Access control: API keys, the management switch, and the adapters root (docs/security.md).

`SecurityConfig` is the server-wide block of options, built once by the launcher (`build_security`)
from `option.<key>` (serving.properties or `OPTION_<KEY>`) or `LMI_SERVE_<KEY>`; it holds SHA-256
digests of the keys, never the keys, so neither the startup log nor anything that dumps the config
can show one. This module imports only the stdlib and pydantic at import time (the launcher runs it
before torch); Flask is imported by `install` alone.

`install(app, security)` adds one `before_request` gate, run for every request the app sees,
matched or not, before any view and before the body is read:

1. exempt routes (`EXEMPT`: the health routes, and `/metrics` when `option.public_metrics`) pass;
2. a management route (a view marked `@management_route`) is a 403 while
   `option.enable_management_api` is false, and needs an admin key when `option.admin_api_keys` is set;
3. any other request needs one of `option.api_keys` (or an admin key) when keys are set.

A refused request is a 401 (missing or wrong key, with `WWW-Authenticate: Bearer`) or a 403 in
its route's dialect (app.py's renderers); no model is touched. The gate keys on the app's own
URL rules, so a route added later is guarded by default: only the short list below is exempt.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

#: (URL rule, method) pairs that answer without a key: health checks (load balancers, kubelets and
#: SageMaker's /ping carry no key) read no body and start no model work. HEAD goes with GET.
EXEMPT: frozenset[tuple[str, str]] = frozenset({
    ("/ping", "GET"), ("/health", "GET"), ("/", "GET"),  # LMI / SageMaker, TGI (GET / is TGI's health too)
    ("/v2/health/live", "GET"), ("/v2/health/ready", "GET"),  # Triton / KServe v2
})
METRICS = ("/metrics", "GET")
#: The server-wide options of this block: option key -> ServerConfig.security field.
OPTION_KEYS = ("api_keys", "api_keys_file", "admin_api_keys", "admin_api_keys_file", "public_metrics",
               "enable_management_api", "adapters_root")

F = TypeVar("F", bound=Callable[..., Any])


class SecurityError(ValueError):
    """A bad security option; the message starts with the key (config.py turns it into ConfigError)."""


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
    serving.properties, else `OPTION_<KEY>`, config.py's precedence), else `LMI_SERVE_<KEY>`.
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


# --- the gate ----------------------------------------------------------------------------------

def management_route(view: F) -> F:
    """Mark a view as a management route: it changes what the server serves (option.enable_management_api)."""
    view.management_route = True  # type: ignore[attr-defined]
    return view


def key_matches(presented: str | None, digests: Iterable[str]) -> bool:
    """Whether `presented` is one of the keys, compared in constant time against every key (no early
    exit, so the time taken says nothing about which key, or how much of one, matched)."""
    if not presented:
        return False
    given = digest(presented)
    matched = False
    for known in digests:
        matched |= hmac.compare_digest(given, known)
    return matched


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def open_routes(security: SecurityConfig) -> frozenset[tuple[str, str]]:
    """The (rule, method) pairs that answer without a key under `security`."""
    return EXEMPT | ({METRICS} if security.public_metrics else frozenset())


def install(app, security: SecurityConfig, refuse: Callable[[int, str, str], Any]) -> None:
    """Add the gate (the module docstring) to `app`. `refuse(status, error_type, message)` renders a
    refusal in the dialect of the request's route (app.py's `render_error`)."""
    from flask import request

    exempt = open_routes(security)
    # An admin key also opens the ordinary routes, where keys are required at all.
    everyday = security.api_key_digests + security.admin_key_digests if security.api_key_digests else ()
    app.extensions["lmi_serve.security"] = security

    @app.before_request
    def require_access():
        rule = request.url_rule.rule if request.url_rule is not None else None
        method = "GET" if request.method == "HEAD" else request.method
        if (rule, method) in exempt:
            return None
        view = app.view_functions.get(request.endpoint) if request.url_rule is not None else None
        digests = everyday
        if getattr(view, "management_route", False):
            if not security.enable_management_api:
                return refuse(403, "ForbiddenException", "The management API is off: this route changes what the "
                              "server serves; set option.enable_management_api=true to allow it")
            digests = security.admin_key_digests or digests
        if not digests or key_matches(bearer_token(request.headers.get("Authorization")), digests):
            return None
        response = refuse(401, "UnauthorizedException", _unauthorized_message(request.headers.get("Authorization")))
        response.headers["WWW-Authenticate"] = 'Bearer realm="lmi-serve"'
        return response


def _unauthorized_message(authorization: str | None) -> str:
    # Never echo what was sent: a wrong key may be a real key for another service.
    if not authorization:
        return "Missing API key: send it as `Authorization: Bearer <key>`"
    if bearer_token(authorization) is None:
        return "The Authorization header must be `Bearer <key>`"
    return "Invalid API key"


def log_startup(security: SecurityConfig) -> None:
    """One line at start-up whether keys are required, and how many (never the keys)."""
    if security.keys_required:
        log.info("API keys: required on every route but health%s (%d key(s)%s)",
                 "" if not security.public_metrics else " and /metrics", len(security.api_key_digests),
                 f", {len(security.admin_key_digests)} admin key(s)" if security.admin_key_digests else "")
    elif security.admin_key_digests:
        log.info("API keys: off but for the management routes, which need one of %d admin key(s)",
                 len(security.admin_key_digests))
    else:
        log.info("API keys: off, every route answers without a key (set option.api_keys or LMI_SERVE_API_KEYS)")
    if security.enable_management_api and not (security.api_key_digests or security.admin_key_digests):
        log.warning("The management API is on without any key: whoever reaches the port can register adapters "
                    "from %s", security.adapters_root or "each model's adapters/ folder")
