"""Handler contract compatible with DJL ``djl_python`` ``Input``/``Output``.

A model's ``model.py`` defines ``handle(inputs: Input) -> Output | None``. The server builds
``Input`` objects from HTTP requests and turns ``Output`` objects into HTTP responses, so custom
handlers written for DJL LMI keep working unchanged. Pure stdlib; numpy is imported lazily.
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import re
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from lmi_serve import json_body

logger = logging.getLogger(__name__)

DATA_KEY = "data"
JSON_CONTENT_TYPE = "application/json"
CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
# Accepts both DJL's zero-padded request prefixes (batch_001.) and output prefixes (batch_1.).
_BATCH_KEY = re.compile(r"^batch_(\d+)\.(.+)$", re.DOTALL)


def _lookup_ci(mapping: Mapping[str, str], key: str) -> str | None:
    """Case-insensitive dict lookup: HTTP header names arrive in arbitrary case."""
    if key in mapping:
        return mapping[key]
    lowered = key.lower()
    for k, v in mapping.items():
        if k.lower() == lowered:
            return v
    return None


def _split_batch_key(key: str) -> tuple[int, str] | None:
    match = _BATCH_KEY.match(key)
    return (int(match.group(1)), match.group(2)) if match else None


def _json_default(obj: Any) -> Any:
    """JSON fallback for numpy scalars/arrays and datetimes returned by handlers."""
    if isinstance(obj, (datetime.datetime, datetime.date, datetime.time)):
        return obj.isoformat()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=_json_default).encode("utf-8")


class PairList:
    """Ordered (key, value) pairs; keys may repeat, mirroring DJL's PairList."""

    def __init__(self, pairs: Iterable[tuple[str, Any]] | None = None) -> None:
        self._pairs: list[tuple[str, Any]] = list(pairs) if pairs is not None else []

    def add(self, key: str, value: Any) -> None:
        self._pairs.append((key, value))

    def get(self, key: str) -> Any:
        """First value stored under ``key``, or None."""
        for k, v in self._pairs:
            if k == key:
                return v
        return None

    def key_at(self, index: int) -> str:
        return self._pairs[index][0]

    def value_at(self, index: int) -> Any:
        return self._pairs[index][1]

    def keys(self) -> list[str]:
        return [k for k, _ in self._pairs]

    def values(self) -> list[Any]:
        return [v for _, v in self._pairs]

    def items(self) -> list[tuple[str, Any]]:
        return list(self._pairs)

    def size(self) -> int:
        return len(self._pairs)

    def remove(self, key: str) -> None:
        """Drop every pair stored under ``key``."""
        self._pairs = [(k, v) for k, v in self._pairs if k != key]

    def is_empty(self) -> bool:
        return not self._pairs

    def __len__(self) -> int:
        return len(self._pairs)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(list(self._pairs))

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self._pairs)


class Input:
    """One request (or a batch of requests) handed to ``handle``."""

    def __init__(self, properties: dict[str, str] | None = None, content: PairList | None = None) -> None:
        self.properties: dict[str, str] = dict(properties) if properties else {}
        self.content: PairList = content if content is not None else PairList()
        self.function_name: str = "handle"

    @classmethod
    def from_http(
        cls,
        body: bytes,
        headers: Mapping[str, str],
        query: Mapping[str, str] | Sequence[tuple[str, str]],
        request_id: str,
    ) -> "Input":
        """Build an Input the way DJL does: headers become properties, body is ``data``."""
        inp = cls()
        for k, v in headers.items():
            inp.properties[k] = v
        custom = _lookup_ci(inp.properties, CUSTOM_ATTRIBUTES_HEADER)
        if custom:
            for piece in custom.split(";"):
                if "=" not in piece:
                    continue
                k, v = piece.split("=", 1)
                if k.strip():
                    inp.properties[k.strip()] = v.strip()
        inp.properties["requestId"] = request_id
        inp.content.add(DATA_KEY, bytes(body or b""))
        pairs = query.items() if isinstance(query, Mapping) else query
        for k, v in pairs:
            inp.content.add(k, v.encode("utf-8") if isinstance(v, str) else bytes(v))
        return inp

    @classmethod
    def batch_of(cls, members: Sequence["Input"]) -> "Input":
        """Pack requests into one batch Input with ``batch_NNN.`` prefixed keys."""
        batch = cls()
        for i, member in enumerate(members):
            prefix = f"batch_{i:03d}."
            for k, v in member.properties.items():
                batch.properties[prefix + k] = v
            for k, v in member.content:
                batch.content.add(prefix + k, v)
        batch.properties["batch_size"] = str(len(members))
        return batch

    def get_function_name(self) -> str:
        return self.function_name

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        return _lookup_ci(self.properties, key)

    def add_property(self, key: str, value: str) -> None:
        self.properties[key] = value

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batches(self) -> list["Input"]:
        """Unpack a batch Input into its member requests; a plain Input is its own batch."""
        if not self.is_batch():
            return [self]
        indexed_props: list[tuple[int, str, str]] = []
        global_props: dict[str, str] = {}
        for k, v in self.properties.items():
            split = _split_batch_key(k)
            if split is not None:
                indexed_props.append((split[0], split[1], v))
            elif k != "batch_size":
                global_props[k] = v
        indexed_content = [(s[0], s[1], v) for k, v in self.content if (s := _split_batch_key(k)) is not None]
        try:
            n = int(self.properties["batch_size"])
        except ValueError:
            n = 0
        highest = max([i for i, _, _ in indexed_props + indexed_content], default=-1)
        members = [Input(global_props) for _ in range(max(n, highest + 1))]
        for i, k, v in indexed_props:
            members[i].properties[k] = v
        for i, k, v in indexed_content:
            members[i].content.add(k, v)
        for m in members:
            m.function_name = self.function_name
        return members

    def get_as_bytes(self, key: str | None = None) -> bytes:
        """Raw bytes of ``key``; without a key the ``data`` entry, else the first entry."""
        if key is None:
            if self.content.is_empty():
                return b""
            value = self.content.get(DATA_KEY) if DATA_KEY in self.content else self.content.value_at(0)
        else:
            if key not in self.content:
                raise KeyError(f"key '{key}' not found in Input content")
            value = self.content.get(key)
        if isinstance(value, str):
            return value.encode("utf-8")
        return bytes(value) if value is not None else b""

    def get_as_string(self, key: str | None = None) -> str:
        return self.get_as_bytes(key).decode("utf-8")

    def get_as_json(self, key: str | None = None) -> Any:
        """The body decoded by the server's one JSON decoder (`json_body`): depth-bounded, valid
        Unicode only. Raises ValueError (`InvalidJson`) with a message for the client."""
        try:
            return json_body.loads(self.get_as_bytes(key))
        except json_body.InvalidJson as exc:
            raise json_body.InvalidJson(exc.reason, "Input is not valid JSON") from None

    def get_as_numpy(self, key: str | None = None) -> Any:
        import numpy as np  # lazy: numpy is optional for text-only handlers

        return np.load(io.BytesIO(self.get_as_bytes(key)), allow_pickle=False)

    def get_data(self, key: str | None = None) -> Any:
        """Decode by Content-Type, as DJL does; unknown types stay bytes."""
        content_type = (self.get_property("Content-Type") or "").strip().lower()
        if not content_type:
            try:
                return self.get_as_json(key)
            except ValueError:
                try:
                    return self.get_as_string(key)
                except UnicodeDecodeError:
                    return self.get_as_bytes(key)
        if content_type.startswith(JSON_CONTENT_TYPE):
            return self.get_as_json(key)
        if content_type.startswith("text/"):
            return self.get_as_string(key)
        return self.get_as_bytes(key)


def _default_stream_formatter(item: Any) -> str:
    return json.dumps({"outputs": item}, default=_json_default) + "\n"


class Output:
    """What ``handle`` returns: status, headers (properties), body pairs or a stream."""

    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code: int = code
        self.message: str = message
        self.properties: dict[str, str] = {}
        self.content: PairList = PairList()
        self.stream_content: Iterable[Any] | None = None
        self.stream_formatter: Callable[[Any], str | bytes] | None = None
        self._finalizers: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def set_code(self, code: int) -> "Output":
        self.code = code
        return self

    def set_message(self, message: str) -> "Output":
        self.message = message
        return self

    def add_property(self, key: str, value: str) -> "Output":
        self.properties[key] = value
        return self

    @property
    def failed(self) -> bool:
        """Whether the handler answered with an error status (4xx or 5xx)."""
        return self.code >= 400

    def content_type(self) -> str | None:
        return _lookup_ci(self.properties, "Content-Type")

    def _set_json_content_type(self) -> None:
        if self.content_type() is None:
            self.properties["Content-Type"] = JSON_CONTENT_TYPE

    @staticmethod
    def _key(key: str | None, batch_index: int | None) -> str:
        key = key if key is not None else DATA_KEY
        return key if batch_index is None else f"batch_{batch_index}.{key}"

    def add(self, value: Any, key: str | None = None, batch_index: int | None = None) -> "Output":
        """Append a body entry: str as utf-8, bytes as-is, anything else as JSON."""
        if isinstance(value, str):
            data = value.encode("utf-8")
        elif isinstance(value, (bytes, bytearray)):
            data = bytes(value)
        else:
            data = _dumps(value)
            self._set_json_content_type()
        self.content.add(self._key(key, batch_index), data)
        return self

    def add_as_json(self, value: Any, key: str | None = None, batch_index: int | None = None) -> "Output":
        """Append ``value`` JSON-encoded even when it is a string."""
        self.content.add(self._key(key, batch_index), _dumps(value))
        self._set_json_content_type()
        return self

    def error(self, error: str, code: int = 424, message: str = "invoke handler failure") -> "Output":
        """Turn this Output into a JSON error response (replaces any body)."""
        self.code, self.message = code, message
        for k in [k for k in self.properties if k.lower() == "content-type"]:
            del self.properties[k]
        self.properties["Content-Type"] = JSON_CONTENT_TYPE
        self.content = PairList([(DATA_KEY, _dumps({"code": code, "message": message, "error": error}))])
        return self

    def body(self) -> bytes:
        if DATA_KEY in self.content:
            return bytes(self.content.get(DATA_KEY))
        return bytes(self.content.value_at(0)) if not self.content.is_empty() else b""

    def _copy(self) -> "Output":
        out = Output(self.code, self.message)
        out.properties = dict(self.properties)
        out.content = PairList(self.content.items())
        return out

    def get_batch_outputs(self, n: int) -> list["Output"]:
        """Split the Output of a batched ``handle`` call into one Output per request."""
        indexed = [(s[0], s[1], v) for k, v in self.content if (s := _split_batch_key(k)) is not None]
        if not indexed and (self.code >= 400 or (n == 1 and not self.content.is_empty())):
            # Whole batch failed (or a single request answered without prefixes): share it.
            return [self._copy() for _ in range(n)]
        members = [Output() for _ in range(n)]
        shared = {k: v for k, v in self.properties.items() if _split_batch_key(k) is None}
        for m in members:
            m.properties.update(shared)
        for k, v in self.properties.items():
            split = _split_batch_key(k)
            if split is None:
                continue
            i, name = split
            if i >= n:
                logger.warning("handler set property %s for batch item %d of %d", k, i, n)
            elif name.lower() == "code":
                try:
                    members[i].code = int(v)
                except ValueError:
                    logger.warning("ignoring non-integer status %r for batch item %d", v, i)
            elif name.lower() == "message":
                members[i].message = v
            else:
                members[i].properties[name] = v
        for i, k, v in indexed:
            if i >= n:
                logger.warning("handler returned output %s for batch item %d of %d", k, i, n)
            else:
                members[i].content.add(k, v)
        for i, m in enumerate(members):
            if m.content.is_empty():
                if m.code >= 400:
                    m.error(m.message, code=m.code, message=m.message)
                else:
                    m.error(f"handler returned no output for batch item {i}", code=500,
                            message="missing batch output")
        return members

    def add_stream_content(
        self, stream: Iterable[Any], output_formatter: Callable[[Any], str | bytes] | None = None
    ) -> "Output":
        """Attach a token/chunk iterable; the server writes one formatted chunk per item."""
        self.stream_content = stream
        self.stream_formatter = output_formatter
        return self

    def is_stream(self) -> bool:
        return self.stream_content is not None

    def iter_stream_chunks(self) -> Iterator[bytes]:
        """Formatted chunks; a failing stream ends with a JSON error line instead of raising."""
        if self.stream_content is None:
            return
        formatter = self.stream_formatter or _default_stream_formatter
        try:
            for item in self.stream_content:
                chunk = formatter(item)
                if chunk is None:
                    continue
                yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)
        except Exception as exc:  # noqa: BLE001 - a stream must end cleanly once headers are sent
            logger.exception("streaming handler failed")
            yield (json.dumps({"code": 424, "error": str(exc)}) + "\n").encode("utf-8")

    def finalize(self, fn: Callable[..., Any], *args: Any) -> "Output":
        """Register cleanup that runs after the response (e.g. free a request slot)."""
        self._finalizers.append((fn, args))
        return self

    def run_finalizers(self) -> None:
        finalizers, self._finalizers = self._finalizers, []
        for fn, args in finalizers:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - cleanup must never break the response
                logger.exception("output finalizer %r failed", fn)


def input_formatter(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a model.py function as the custom request parser (DJL ``@input_formatter``)."""
    fn.is_input_formatter = True  # type: ignore[attr-defined]
    return fn


def output_formatter(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a model.py function as the custom response formatter (DJL ``@output_formatter``)."""
    fn.is_output_formatter = True  # type: ignore[attr-defined]
    return fn


def find_annotated(module: Any, attr: str) -> Callable[..., Any] | None:
    """First module-level callable (in definition order) flagged with ``attr``."""
    for obj in vars(module).values():
        if callable(obj) and not isinstance(obj, type) and getattr(obj, attr, False) is True:
            return obj
    return None
