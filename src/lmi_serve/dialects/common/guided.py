"""Grammars clients send -> the engine's GuidedDecoding: the one place every dialect turns a JSON
schema or a regular expression into a row constraint, and an invalid one into a refusal naming
the client's field.

- `json_schema(value, param)`: a schema (an object, or JSON text holding one); a bare `{}` means
  any JSON object (TGI's reading), not any JSON value.
- `regex(value, param)`: a pattern the whole output must match (llguidance's syntax).
- `any_object()`: OpenAI's `json_object`.
- `generate(engine, requests, param)`: `engine.generate`, with the engine's GrammarError (the
  compiler refusing a schema or pattern) as an InvalidRequest naming `param`.
"""

from __future__ import annotations

import json
from typing import Any

from lmi_serve import json_body
from lmi_serve.engine.sampling.grammar import GrammarError
from lmi_serve.engine.types import GenerationRequest, GuidedDecoding
from lmi_serve.errors import InvalidRequest

ANY_OBJECT = {"type": "object"}


def any_object() -> GuidedDecoding:
    return GuidedDecoding(json_schema=json.dumps(ANY_OBJECT))


def json_schema(value: Any, param: str) -> GuidedDecoding:
    """A JSON Schema sent as an object or as JSON text; `{}` is any object."""
    if isinstance(value, str):
        try:
            value = json_body.loads(value.encode("utf-8", "surrogatepass"))
        except (json_body.InvalidJson, UnicodeError) as exc:
            raise InvalidRequest(f"{param}: the schema is not valid JSON: {exc}", param=param) from None
    if isinstance(value, bool):  # JSON Schema's `true` / `false` schemas: any value / nothing
        raise InvalidRequest(f"{param}: a boolean schema is not supported; send a JSON object schema",
                             param=param)
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param}: a JSON schema must be an object, not {type(value).__name__}", param=param)
    return GuidedDecoding(json_schema=json.dumps(value or ANY_OBJECT))


def regex(value: Any, param: str) -> GuidedDecoding:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param}: a regular expression must be a non-empty string", param=param)
    return GuidedDecoding(regex=value)


def generate(engine, requests: list[GenerationRequest], param: str):
    """Queue `requests` (all or none); a grammar the compiler refuses is the client's `param`."""
    try:
        return engine.generate(requests)
    except GrammarError as exc:  # a ValueError from the grammar compiler, not yet a kind
        raise InvalidRequest(f"{param}: invalid or unsupported schema, pattern or grammar: {exc}", param=param) from None
