"""The kinds of failure the core (engine, registry, service, shared parsers) raises.

They carry a message and, for a bad request, the field at fault; never an HTTP status or a
dialect's vocabulary. Each dialect maps kinds to its own status code and body shape in one table
(`render_kind` below walks a class's MRO, so a subclass such as ContextOverflow finds its own row
or its parent's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar


class ServingError(Exception):
    """Base of every kind. `param`: the request field at fault, when one is (OpenAI reports it);
    `code`: a machine-readable reason within the kind (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class InvalidRequest(ServingError):
    """The request itself is wrong (a field out of range, a prompt that does not fit): the client
    must change it; retrying the same request fails the same way."""


class ContextOverflow(InvalidRequest):
    """The prompt (and the output asked for) does not fit the model's context."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="context_length_exceeded")


class NotFound(ServingError):
    """The model (or another named thing) the request names is not served here."""


class NotReady(ServingError):
    """The model is still loading, or failed to load."""


class Overloaded(ServingError):
    """No room to queue the request now; the same request may succeed later."""


class AlreadyExists(InvalidRequest):
    """The name a request would create (a model to load) is taken. Dialects without a row of their
    own answer it as the InvalidRequest it is."""


class OutOfResources(Overloaded):
    """Loading what the request asks for would not fit the memory (or another resource) left; after
    something is unloaded the same request may succeed (SageMaker's 507 contract)."""


class Forbidden(InvalidRequest):
    """The request names something the server may not read (a path outside its allowed root)."""


class Timeout(ServingError):
    """The request waited longer than predict_timeout for the model."""


class GenerationFailed(ServingError):
    """The model failed while working on this request (the request was valid)."""


class ClientGone(ServingError):
    """The client closed its connection before its whole response was ready: nobody reads the
    answer, but the access log still gets a status."""


KINDS: tuple[type[ServingError], ...] = (InvalidRequest, ContextOverflow, NotFound, NotReady, Overloaded, Timeout,
                                         GenerationFailed, ClientGone)
#: Kinds only the model-management routes raise (LMI / SageMaker's, which give them statuses of their
#: own); every other dialect renders them as the kind they subclass.
MANAGEMENT_KINDS: tuple[type[ServingError], ...] = (AlreadyExists, OutOfResources, Forbidden)

Row = TypeVar("Row")


def lookup(table: Mapping[type[ServingError], Row], error: ServingError) -> Row:
    """`table`'s row for `error`'s kind: its own class's, else the nearest base class's. A table
    must have a row for ServingError itself, the fallback for a kind it does not list."""
    for cls in type(error).__mro__:
        if cls in table:
            return table[cls]
    raise KeyError(f"no row for {type(error).__name__} and no ServingError fallback")
