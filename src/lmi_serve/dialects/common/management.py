"""Marking a route as management: it changes what the server serves (registering or removing an
adapter, say). The server's gate (server/security.py) refuses such a route while
`option.enable_management_api` is false, and asks for an admin key when admin keys are set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute the mark sets on a view function.
MARK = "management_route"


def management_route(view: F) -> F:
    """Mark a view as a management route (option.enable_management_api)."""
    setattr(view, MARK, True)
    return view
