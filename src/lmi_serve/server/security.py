"""Access control's gate (docs/security.md): what config/security.py's `SecurityConfig` asks for,
enforced on every request. Flask is imported by `install` alone.

`install(app, security)` adds one `before_request` gate, run for every request the app sees,
matched or not, before any view and before the body is read:

1. exempt routes (`EXEMPT`: the health routes, and `/metrics` when `option.public_metrics`) pass;
2. a management route (a view marked `@management_route`) is a 403 while
   `option.enable_management_api` is false, and needs an admin key when `option.admin_api_keys` is set;
3. any other request needs one of `option.api_keys` (or an admin key) when keys are set.

A key is sent as `Authorization: Bearer <key>` (OpenAI's clients and most others) or as
`x-api-key: <key>` (Anthropic's); either one that matches opens the route. A refused request is a
401 (missing or wrong key, with `WWW-Authenticate: Bearer`) or a 403 in its route's dialect
(app.py's renderers); no model is touched. The gate keys on the app's own URL rules, so a route
added later is guarded by default: only the short list below is exempt.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from typing import Any

from lmi_serve.config.security import SecurityConfig, digest
from lmi_serve.dialects.common.management import MARK

log = logging.getLogger(__name__)

#: (URL rule, method) pairs that answer without a key: health checks (load balancers, kubelets and
#: SageMaker's /ping carry no key) read no body and start no model work. HEAD goes with GET.
EXEMPT: frozenset[tuple[str, str]] = frozenset({
    ("/ping", "GET"), ("/health", "GET"), ("/", "GET"),  # LMI / SageMaker, TGI (GET / is TGI's health too)
    ("/execution-parameters", "GET"),  # asked by SageMaker Batch Transform, which carries no key either
    ("/v2/health/live", "GET"), ("/v2/health/ready", "GET"),  # Triton / KServe v2
})
METRICS = ("/metrics", "GET")
#: Management routes that SageMaker's multi-model contract calls without a key (it sends none): with
#: SAGEMAKER_MULTI_MODEL they are ordinary routes (the everyday keys, if any), not management ones.
MULTI_MODEL_ROUTES: frozenset[tuple[str, str]] = frozenset({("/models", "POST"), ("/models/<model_name>", "DELETE")})


# --- the gate ----------------------------------------------------------------------------------

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


def presented_keys(headers) -> tuple[str | None, str | None]:
    """The keys a request presents: its `Authorization: Bearer` token and its `x-api-key` header
    (Anthropic's clients send their key there)."""
    return bearer_token(headers.get("Authorization")), (headers.get("x-api-key") or "").strip() or None


def open_routes(security: SecurityConfig) -> frozenset[tuple[str, str]]:
    """The (rule, method) pairs that answer without a key under `security`."""
    return EXEMPT | ({METRICS} if security.public_metrics else frozenset())


def install(app, security: SecurityConfig, refuse: Callable[[int, str, str], Any], *, multi_model: bool = False) -> None:
    """Add the gate (the module docstring) to `app`. `refuse(status, error_type, message)` renders a
    refusal in the dialect of the request's route (app.py's `render_error`). `multi_model`: SageMaker's
    load and unload calls (MULTI_MODEL_ROUTES) are not management routes."""
    from flask import request

    exempt = open_routes(security)
    # An admin key also opens the ordinary routes, where keys are required at all.
    everyday = security.api_key_digests + security.admin_key_digests if security.api_key_digests else ()
    app.extensions["lmi_serve.server.security"] = security

    @app.before_request
    def require_access():
        rule = request.url_rule.rule if request.url_rule is not None else None
        method = "GET" if request.method == "HEAD" else request.method
        if (rule, method) in exempt:
            return None
        view = app.view_functions.get(request.endpoint) if request.url_rule is not None else None
        digests = everyday
        if getattr(view, MARK, False) and not (multi_model and (rule, method) in MULTI_MODEL_ROUTES):
            if not security.enable_management_api:
                return refuse(403, "ForbiddenException", "The management API is off: this route changes what the "
                              "server serves; set option.enable_management_api=true to allow it")
            digests = security.admin_key_digests or digests
        if not digests or any(key_matches(key, digests) for key in presented_keys(request.headers)):
            return None
        response = refuse(401, "UnauthorizedException", _unauthorized_message(request.headers))
        response.headers["WWW-Authenticate"] = 'Bearer realm="lmi-serve"'
        return response


def _unauthorized_message(headers) -> str:
    # Never echo what was sent: a wrong key may be a real key for another service.
    authorization = headers.get("Authorization")
    if headers.get("x-api-key"):
        return "Invalid API key"
    if not authorization:
        return "Missing API key: send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`)"
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
