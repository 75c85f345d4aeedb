"""Hypothesis strategies for tests/integration/ops/test_fuzz.py: HTTP requests built from each POST
route's real schema, then mutated.

A `Route` holds one or more valid seed bodies (real field names, valid-ish values, tiny generation
budgets). `requests_for(route)` draws a `Case`: usually a seed with one or two of its fields
replaced by a hostile value (wrong type, huge or negative number, NaN/Infinity literal, lone
surrogate escape, invalid UTF-8, deep nesting), deleted, or joined by an unknown field, so most
requests get past JSON decoding and reach validation; sometimes a whole hostile body (empty,
not JSON, deeply nested, oversized, another encoding). Headers are drawn too: Content-Type,
Content-Encoding (real gzip/deflate or garbage), Accept, and for Triton's /infer the
Inference-Header-Content-Length.

Bodies are rendered by `render`, not json.dumps, because the point is to send what json.dumps
refuses to write: `Raw` values are spliced in as bytes.
"""

from __future__ import annotations

import copy
import gzip
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

TEXT_MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
TENSOR_MODEL = "simple"
MAX_REQUEST_SIZE = 100_000  # SAGEMAKER_MAX_REQUEST_SIZE of the default_server fixture


@dataclass(frozen=True)
class Raw:
    """Bytes spliced into the body as they are: what json.dumps would never write."""

    data: bytes

    def __repr__(self) -> str:  # keep falsifying examples short and readable
        shown = self.data if len(self.data) <= 60 else self.data[:30] + b"..." + self.data[-10:]
        return f"Raw({shown!r}, {len(self.data)} bytes)"


def render(value: Any) -> bytes:
    """JSON text of `value`, with `Raw` pieces spliced in verbatim."""
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, dict):
        items = (json.dumps(str(k)).encode() + b": " + render(v) for k, v in value.items())
        return b"{" + b", ".join(items) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b", ".join(render(v) for v in value) + b"]"
    return json.dumps(value).encode()


def _nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a": ' * depth + b"1" + b"}" * depth


# --- hostile values ----------------------------------------------------------------------------

WRONG_TYPES = [None, True, False, 0, 1, -1, 1.5, -0.0, "", "x", "1", "true", "null", [], {}, [1, "a"], ["x"],
               [[]], {"k": "v"}, {"": None}, "\x00", "🙂" * 3, "a" * 3000]
HUGE_NUMBERS = [2**31, -2**31 - 1, 2**53 + 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30, -10**30,
                1e308, -1e308, 5e-324, -1e-300]
RAW_LITERALS = [Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"), Raw(b"1e309"), Raw(b"-1e309"), Raw(b"1E400"),
                Raw(b"1" + b"0" * 400), Raw(b"9" * 5000),  # Python refuses ints over 4,300 digits
                Raw(b'"\\ud800"'), Raw(b'"a\\udfffb"'), Raw(b'"\\ud83d"'), Raw(b'["\\udc00"]'),
                Raw(b'{"\\ud800": 1}'), Raw(b'"\\u0000"'),
                Raw(b'"\xff\xfe"'), Raw(b'"\xc3\x28"'), Raw(b'"\xc0\xaf"'), Raw(b'"\xed\xa0\x80"'), Raw(b'"\x80"')]
DEEP = [Raw(_nested(n, kind)) for n in (1000, 5000) for kind in ("list", "dict")] + [Raw(_nested(129, "list"))]
HOSTILE_VALUES = WRONG_TYPES + HUGE_NUMBERS + RAW_LITERALS + DEEP


def hostile_values() -> st.SearchStrategy[Any]:
    listed = st.sampled_from(HOSTILE_VALUES).map(copy.deepcopy)  # a later mutation may edit it in place
    return st.one_of(
        listed,
        listed,  # twice: half of the values come from the list
        st.integers(min_value=-2**64, max_value=2**64),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
    )


EXTRA_KEYS = ["extra", "", "inputs", "parameters", "stream", "model", "messages", "prompt", "input", "text_input",
              "max_tokens", "max_new_tokens", "id", "triton_x", "__proto__", "\u00e9", "n", "binary_data_size"]


# --- routes and their seeds --------------------------------------------------------------------

@dataclass(frozen=True)
class Route:
    path: str
    dialect: str  # "lmi", "openai", "tgi", "triton" or "anthropic"
    seeds: tuple[Any, ...]
    # Generation length and stop fields: a case mutates at most one path of each group, so an
    # accepted request always keeps a small budget or a stop string (no context-long generation).
    guards: tuple[tuple[str, ...], ...] = ()
    binary: bool = False  # Triton /infer: binary tensor data and Inference-Header-Content-Length
    streams: bool = False
    # Paths into seeds[0] for the catalog (`catalog`): a string field, a number field, and a
    # nested object where deep nesting goes (a missing last key is created).
    text: str = ""
    number: str = ""
    nest: str = "parameters"

    @property
    def id(self) -> str:
        return self.path


# Every printable ASCII character is a stop string: an accepted request ends at its first token
# with one in it, so a mutated length (2**63 is capped to the context, not refused) stays cheap.
STOPS = ["\n"] + [chr(c) for c in range(32, 127)]
LMI_PARAMS = {"max_new_tokens": 2, "stop_sequences": STOPS, "do_sample": True, "temperature": 0.5, "top_k": 5,
              "top_p": 0.9, "seed": 1, "details": True}
LMI_OPTIONAL = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "typical_p": 0.9, "min_p": 0.05,
                "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "seed": 7,
                "stop_token_ids": [2], "ignore_eos_token": False, "details": True, "decoder_input_details": True,
                "top_n_tokens": 2, "return_full_text": True, "n": 1, "best_of": 1, "num_beams": 1, "truncate": 8,
                "include_stop_str_in_output": False, "watermark": True, "output_formatter": "jsonlines",
                "grammar": {"type": "regex", "value": "[a-z ]{1,8}"}}
LMI_GUARDS = (("parameters.max_new_tokens", "parameters.stop_sequences"),)

OPENAI_SAMPLING = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                   "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"42": 5}, "n": 1, "seed": 3,
                   "stop_token_ids": [2], "ignore_eos": False, "include_stop_str_in_output": False, "user": "u",
                   "stream": True, "stream_options": {"include_usage": True}}
CHAT = {"model": TEXT_MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 2, "stop": STOPS, "temperature": 0.5, "top_p": 0.9, "seed": 1, "n": 1, "logprobs": False}
CHAT_OPTIONAL = {**OPENAI_SAMPLING, "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 2,
                 "response_format": {"type": "json_object", "value": {}}, "parallel_tool_calls": True, "metadata": {"a": "b"},
                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                 "tool_choice": "none", "modalities": ["text"], "store": False}
COMPLETION = {"model": TEXT_MODEL, "prompt": "Hello", "max_tokens": 2, "stop": STOPS, "temperature": 0.5, "seed": 1,
              "echo": False, "logprobs": 1}
COMPLETION_OPTIONAL = {**OPENAI_SAMPLING, "suffix": "!", "echo": True, "logprobs": 2, "best_of": 1,
                       "error_behavior": "truncate", "use_raw_prompt": False}
OPENAI_GUARDS = (("max_tokens", "max_completion_tokens", "stop"),)
RESPONSES = {"model": TEXT_MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
             "instructions": "Be brief.", "max_output_tokens": 2, "stop": STOPS, "temperature": 0.5, "top_p": 0.9,
             "stream": True, "store": False, "text": {"format": {"type": "text"}}}
# A tool round trip: drawn by hypothesis only (the catalog mutates the first seed, where no tools make it cheap).
RESPONSES_TURN = {"model": TEXT_MODEL, "max_output_tokens": 2, "stop": STOPS, "tool_choice": "none",
                  "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}],
                  "input": [{"role": "user", "content": "Add 1"},
                            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
                            {"type": "function_call_output", "call_id": "c1", "output": "1"}]}
RESPONSES_GUARDS = (("max_output_tokens", "stop"),)

MESSAGES = {"model": TEXT_MODEL, "max_tokens": 2, "system": "Be brief.", "stop_sequences": STOPS, "temperature": 0.5,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "stream": False}
TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 5}}}}
MESSAGES_OPTIONAL = {"top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"}, "service_tier": "auto",
                     "tools": [TOOL], "tool_choice": {"type": "none"}, "thinking": {"type": "disabled"},
                     "cache_control": {"type": "ephemeral"}, "stream": True}
MESSAGES_GUARDS = (("max_tokens", "stop_sequences"),)
COUNT_TOKENS = {"model": TEXT_MODEL, "system": [{"type": "text", "text": "Be brief."}], "tools": [TOOL],
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]}]}

SIMPLE_JSON = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                          {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}],
               "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}],
               "id": "7", "parameters": {"binary_data_output": False, "priority": 0}}
SIMPLE_BINARY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
                             "parameters": {"binary_data_size": 64}},
                            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}],
                 "parameters": {"binary_data_output": True}}
LLM_INFER = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]},
                        {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [2]},
                        {"name": "stop_words", "shape": [len(STOPS)], "datatype": "BYTES", "data": STOPS},
                        {"name": "temperature", "shape": [1], "datatype": "FP32", "data": [0.5]},
                        {"name": "return_finish_reason", "shape": [1], "datatype": "BOOL", "data": [True]}],
             "parameters": {"seed": 1}}
EMBED_INFER = {"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["a cat", "a dog"]}]}
INFER_GUARDS = (("inputs.1", "inputs.2"),)  # max_tokens and stop_words (their sub-paths too)
LLM_GENERATE = {"text_input": "Hi", "max_tokens": 2, "stop_words": STOPS, "temperature": 0.5, "top_k": 5, "seed": 4,
                "id": "g1", "parameters": {"top_p": 0.9, "return_num_output_tokens": True, "pad_id": 0}}
LLM_GENERATE_SAMPLING = {"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": "2", "stop": STOPS}),
                         "stream": True, "exclude_input_in_output": True}
GENERATE_GUARDS = (("max_tokens", "stop_words", "sampling_parameters"),)
SIMPLE_GENERATE = {"INPUT0": list(range(16)), "INPUT1": [1] * 16, "id": "s1", "parameters": {"priority": 1}}

V2 = "/v2/models"
ROUTES = [
    Route("/invocations", "lmi", ({"inputs": "Hello", "parameters": LMI_PARAMS, "stream": False},
                                  {"messages": CHAT["messages"], "max_tokens": 2, "stop": STOPS, "stream": True}),
          guards=LMI_GUARDS + OPENAI_GUARDS, streams=True, text="inputs", number="parameters.max_new_tokens"),
    Route(f"/predictions/{TEXT_MODEL}", "lmi", ({"inputs": "Hello", "parameters": LMI_PARAMS, "stream": True},),
          guards=LMI_GUARDS, streams=True, text="inputs", number="parameters.top_k"),
    Route(f"/predictions/{EMBEDDING_MODEL}", "lmi", ({"inputs": ["a cat", "a kitten"]}, {"inputs": "a cat"}),
          text="inputs.0", number="inputs.1", nest="inputs"),
    Route(f"/predictions/{TENSOR_MODEL}", "lmi", (SIMPLE_GENERATE,), text="id", number="INPUT0.0"),
    Route("/", "tgi", ({"inputs": "Hello", "parameters": LMI_PARAMS, "stream": False},), guards=LMI_GUARDS,
          streams=True, text="inputs", number="parameters.max_new_tokens"),
    Route("/generate", "tgi", ({"inputs": "Hello", "parameters": LMI_PARAMS},), guards=LMI_GUARDS, streams=True,
          text="parameters.stop_sequences.0", number="parameters.temperature"),
    Route("/generate_stream", "tgi", ({"inputs": "Hello", "parameters": LMI_PARAMS},), guards=LMI_GUARDS,
          streams=True, text="inputs", number="parameters.seed"),
    Route("/v1/chat/completions", "openai", (CHAT,), guards=OPENAI_GUARDS, streams=True,
          text="messages.0.content", number="max_tokens", nest="tools"),
    Route("/v1/completions", "openai", (COMPLETION, {**COMPLETION, "prompt": [[9906, 11], "Hi"]}),
          guards=OPENAI_GUARDS, streams=True, text="prompt", number="temperature", nest="logit_bias"),
    Route("/v1/responses", "openai", (RESPONSES, RESPONSES_TURN), guards=RESPONSES_GUARDS, streams=True,
          text="input.0.content.0.text", number="max_output_tokens", nest="text"),
    # vLLM's tokenizer routes (TGI's /tokenize shares the path: a body with `inputs` goes there).
    Route("/tokenize", "openai", ({"model": TEXT_MODEL, "prompt": "Hello", "add_special_tokens": True},
                                  {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                   "add_generation_prompt": True, "return_token_strs": True}),
          text="prompt", number="add_special_tokens", nest="chat_template_kwargs"),
    Route("/detokenize", "openai", ({"model": TEXT_MODEL, "tokens": [9906, 11]},),
          text="model", number="tokens.0", nest="tokens"),
    Route("/v1/embeddings", "openai", ({"model": EMBEDDING_MODEL, "input": ["a cat", "a dog"],
                                        "encoding_format": "base64", "instruction": "Embed:", "user": "u"},
                                       {"input": [[101, 102], [2003]], "dimensions": 384}),
          text="input.0", number="dimensions", nest="input"),
    Route("/v1/messages", "anthropic", (MESSAGES,), guards=MESSAGES_GUARDS, streams=True,
          text="messages.0.content.0.text", number="max_tokens", nest="metadata"),
    Route("/v1/messages/count_tokens", "anthropic", (COUNT_TOKENS,), text="messages.0.content",
          number="tools.0.input_schema.properties.x.maximum", nest="tools.0.input_schema"),
    Route(f"{V2}/{TENSOR_MODEL}/infer", "triton", (SIMPLE_JSON, SIMPLE_BINARY), binary=True,
          text="inputs.0.datatype", number="inputs.0.data.0"),
    Route(f"{V2}/{TEXT_MODEL}/versions/1/infer", "triton", (LLM_INFER,), guards=INFER_GUARDS, binary=True,
          text="inputs.0.data.0", number="inputs.3.data.0"),
    Route(f"{V2}/{EMBEDDING_MODEL}/infer", "triton", (EMBED_INFER,), binary=True, text="inputs.0.data.0",
          number="inputs.0.shape.0", nest="inputs.0.data"),
    Route(f"{V2}/{TEXT_MODEL}/generate", "triton", (LLM_GENERATE, LLM_GENERATE_SAMPLING), guards=GENERATE_GUARDS,
          text="text_input", number="temperature"),
    Route(f"{V2}/{TEXT_MODEL}/generate_stream", "triton", (LLM_GENERATE, LLM_GENERATE_SAMPLING),
          guards=GENERATE_GUARDS, streams=True, text="stop_words.0", number="parameters.top_p"),
    Route(f"{V2}/{TENSOR_MODEL}/versions/1/generate", "triton", (SIMPLE_GENERATE,), text="id", number="INPUT0.0"),
    Route(f"{V2}/{TENSOR_MODEL}/generate_stream", "triton", (SIMPLE_GENERATE,), streams=True, text="id",
          number="INPUT1.15"),
    Route("/v2/repository/index", "triton", ({"ready": True}, {}), text="ready", number="ready", nest="ready"),
    Route(f"/v2/repository/models/{TENSOR_MODEL}/load", "triton", ({"parameters": {"config": "{}"}},),
          text="parameters.config", number="parameters.config"),
    Route(f"/v2/repository/models/{TENSOR_MODEL}/unload", "triton", ({"parameters": {"unload_dependents": True}},),
          text="parameters.unload_dependents", number="parameters.unload_dependents"),
]
TEXT_ROUTES = {"/invocations", f"/predictions/{TEXT_MODEL}", "/", "/generate", "/generate_stream",
               "/v1/chat/completions", "/v1/completions", "/v1/messages"}


def _add_optional(draw, route: Route, doc: Any) -> None:
    """Valid optional fields on top of a text seed's required ones (at most four, drawn per case)."""
    if route.path not in TEXT_ROUTES or not isinstance(doc, dict):
        return
    if route.dialect == "anthropic":
        optional, target = MESSAGES_OPTIONAL, doc
    elif "messages" in doc:
        optional, target = CHAT_OPTIONAL, doc
    elif "prompt" in doc:
        optional, target = COMPLETION_OPTIONAL, doc
    else:
        optional, target = LMI_OPTIONAL, doc["parameters"]
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        target[key] = _copy(optional[key])


# --- cases -------------------------------------------------------------------------------------

@dataclass
class Case:
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    note: str = ""  # what was done to the seed, for the failure report

    def __repr__(self) -> str:
        shown = self.body if len(self.body) <= 300 else self.body[:200] + b"..." + self.body[-60:]
        return f"Case(note={self.note!r}, headers={self.headers!r}, body={shown!r} ({len(self.body)} bytes))"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints falsifying examples with this
        printer.text(repr(self))


def paths(value: Any, prefix: str = "") -> list[str]:
    """Every dotted path into dicts and lists of `value` (list items by index; not into long lists
    such as STOPS, which are mutated as a whole)."""
    found = []
    children = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) and len(value) <= 32 else ()
    for key, child in children:
        path = f"{prefix}.{key}" if prefix else str(key)
        found.append(path)
        found.extend(paths(child, path))
    return found


def _parent(doc: Any, path: str) -> tuple[Any, Any]:
    *head, last = path.split(".")
    node = doc
    for part in head:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, (int(last) if isinstance(node, list) else last)


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _guarded_out(chosen: list[str], candidates: list[str], guards: tuple[tuple[str, ...], ...]) -> list[str]:
    """Candidates still allowed once `chosen` are mutated: one path per guard group."""
    taken = {g for g in guards if any(p in g or any(p.startswith(x + ".") for x in g) for p in chosen)}
    return [c for c in candidates
            if not any(c in g or any(c.startswith(x + ".") for x in g) for g in taken)]


@st.composite
def mutated_body(draw, route: Route) -> tuple[Any, str]:
    doc = _copy(draw(st.sampled_from(route.seeds)))
    _add_optional(draw, route, doc)
    notes = []
    chosen: list[str] = []
    for _ in range(draw(st.integers(min_value=1, max_value=2))):
        candidates = _guarded_out(chosen, paths(doc), route.guards)
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
        if action == "add" or not candidates:
            containers = [""] + [p for p in paths(doc) if isinstance(_get(doc, p), dict)]
            where = draw(st.sampled_from(containers))
            container = _get(doc, where) if where else doc
            fresh = [k for k in EXTRA_KEYS if k not in container]  # never overwrite: that would dodge the guards
            key, value = draw(st.sampled_from(fresh)), draw(hostile_values())
            container[key] = value
            notes.append(f"add {where or '<top>'}.{key}")
            continue
        path = draw(st.sampled_from(candidates))
        chosen.append(path)
        parent, key = _parent(doc, path)
        if action == "delete":
            del parent[key]
            notes.append(f"delete {path}")
        else:
            parent[key] = draw(hostile_values())
            notes.append(f"replace {path}")
    return doc, "; ".join(notes)


def _get(doc: Any, path: str) -> Any:
    parent, key = _parent(doc, path)
    return parent[key]


def whole_bodies(route: Route) -> st.SearchStrategy[tuple[bytes, str]]:
    """Hostile bodies as a whole: empty, not JSON, the wrong JSON type, deep, oversized, re-encoded."""
    seed = render(route.seeds[0])
    fixed = [b"", b" ", b"\n", b"null", b"[]", b"{}", b'"text"', b"1", b"true", b"{", b"}", b"{]", b"[1,]",
             b'{"a":1,}', b"\x00", b"NaN", b"Infinity", b"-Infinity", b'"\\ud800"', b"\xff\xfe\xfd",
             b"\xef\xbb\xbf" + seed, seed.decode().encode("utf-16"), seed + b" trailing", seed + b"\x00",
             seed[:-1], b"[" + seed + b"]", seed.replace(b"{", b'{"dup": 1, "dup": 2, ', 1),
             _nested(1000, "list"), _nested(5000, "list"), _nested(1000, "dict"), _nested(5000, "dict"),
             b'{"parameters": ' + _nested(1000, "dict") + b"}", b'{"parameters": ' + _nested(5000, "list") + b"}",
             b'{"inputs": "' + b"a" * (MAX_REQUEST_SIZE + 10) + b'"}',
             seed.replace(b'"', b"'")]
    return st.one_of(st.sampled_from(fixed).map(lambda b: (b, "whole body")),
                     st.binary(max_size=200).map(lambda b: (b, "random bytes")),
                     st.text(max_size=100).map(lambda t: (t.encode("utf-8", "surrogatepass"), "random text")))


CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "application/json; charset=latin-1",
                 "text/plain", "text/plain; charset=utf-16", "application/x-www-form-urlencoded",
                 "multipart/form-data", "multipart/form-data; boundary=xyz", "application/octet-stream", "text/csv",
                 "tensor/npz", "tensor/ndlist", "application/x-npy", "image/png", "audio/wav", "garbage",
                 "application/jsonlines", "text/html"]
ENCODINGS = [None, "gzip", "deflate", "deflate-raw", "gzip-bogus", "br", "garbage", "identity",
             "gzip, deflate", "GZIP"]


def _encode(body: bytes, encoding: str | None) -> tuple[bytes, str | None]:
    if encoding == "gzip" or encoding == "GZIP":
        return gzip.compress(body), encoding
    if encoding == "deflate":
        return zlib.compress(body), encoding
    if encoding == "deflate-raw":
        raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return raw.compress(body) + raw.flush(), "deflate"
    if encoding == "gzip-bogus":
        return body, "gzip"
    return body, encoding


@st.composite
def requests_for(draw, route: Route) -> Case:
    if draw(st.integers(min_value=0, max_value=4)) == 0:
        body, note = draw(whole_bodies(route))
        json_header = None
    else:
        doc, note = draw(mutated_body(route))
        body = json_header = render(doc)
        if route.binary and b"binary_data_size" in body:
            body = body + b"\x01\x00\x00\x00" * 16  # the 64 bytes SIMPLE_BINARY announces
    headers: dict[str, str] = {}
    if draw(st.integers(min_value=0, max_value=9)) < 3:  # hostile headers; else the body alone is the test
        content_type = draw(st.sampled_from(CONTENT_TYPES))
        body, encoding = _encode(body, draw(st.sampled_from(ENCODINGS)))
        accept = draw(st.sampled_from([None, "text/event-stream", "application/jsonlines", "*/*"]))
        for name, value in (("Content-Type", content_type), ("Content-Encoding", encoding), ("Accept", accept)):
            if value:
                headers[name] = value
    elif draw(st.booleans()):
        headers["Content-Type"] = "application/json"
    if route.binary:
        length = len(json_header) if json_header is not None else len(body)
        valid = str(length) if json_header is not None and len(body) > length else None  # binary data follows
        ihcl = valid if draw(st.integers(min_value=0, max_value=9)) < 6 else draw(st.sampled_from(
            [None, str(length), "0", "-1", str(length + 1000), str(len(body) + 1), "abc", "", "1.5", "+12",
             str(2**63), "9" * 30, "-0"]))
        if ihcl is not None:
            headers["Inference-Header-Content-Length"] = ihcl
    if route.dialect == "lmi" and draw(st.booleans()):
        headers["X-Amzn-SageMaker-Custom-Attributes"] = draw(st.sampled_from(
            ["a=b;c=d", "=", ";;", "no-equals", "k=" + "v" * 500, "handler=handle", "Content-Type=application/json"]))
    return Case(body, headers, note)


# --- the catalog: the cases every route gets, whatever hypothesis draws -------------------------

def _wrong_type(value: Any) -> Any:
    """A value of another JSON type than `value`."""
    if isinstance(value, bool):
        return "true"
    if isinstance(value, (int, float)):
        return "1"
    if isinstance(value, str):
        return 1
    if isinstance(value, list):
        return {"0": value[0]} if value else {}
    if isinstance(value, dict):
        return [value]
    return []


def _with(doc: Any, path: str, value: Any) -> Any:
    doc = _copy(doc)
    parent, key = _parent(doc, path)
    parent[key] = value
    return doc


def catalog(route: Route) -> list[Case]:
    """The hostile inputs the fuzz test must always cover on `route`: NaN/Infinity/1e309 and
    numbers beyond 64 bits in a number field, lone surrogates and invalid UTF-8 in a string field,
    1,000 and 5,000 levels of nesting inside the body and as the body, empty, non-JSON and
    oversized bodies, wrong Content-Type, Content-Encoding, and Inference-Header-Content-Length."""
    seed = route.seeds[0]
    cases = [Case(b"", note="empty body"), Case(b"not json", note="not JSON"), Case(b"NaN", note="NaN body"),
             Case(_nested(1000, "list"), note="1,000 levels"), Case(_nested(5000, "list"), note="5,000 levels"),
             Case(_nested(5000, "dict"), note="5,000 levels of objects"),
             Case(b'{"inputs": "' + b"a" * (MAX_REQUEST_SIZE + 10) + b'"}', note="over the max request size")]
    for literal in (b"NaN", b"Infinity", b"1e309", b"9223372036854775808", b"-9223372036854775809"):
        cases.append(Case(render(_with(seed, route.number, Raw(literal))), note=f"{route.number} = {literal.decode()}"))
    for literal in (b'"\\ud800"', b'"\xff\xfe"', b'"\xed\xa0\x80"'):
        cases.append(Case(render(_with(seed, route.text, Raw(literal))), note=f"{route.text} = {literal!r}"))
    for depth in (1000, 5000):
        for kind in ("list", "dict"):
            cases.append(Case(render(_with(seed, route.nest, Raw(_nested(depth, kind)))),
                              note=f"{route.nest} nested {depth} levels of {kind}s"))
    for path in paths(seed):
        if any(part.isdigit() and int(part) > 1 for part in path.split(".")):
            continue  # the first two items of a list stand for the rest
        cases.append(Case(render(_with(seed, path, _wrong_type(_get(seed, path)))), note=f"{path}: wrong type"))
        if "." not in path:
            missing = _copy(seed)
            del missing[path]
            cases.append(Case(render(missing), note=f"{path}: missing"))
    cases.append(Case(render({**seed, "unknown_field": 1}), note="an unknown field"))
    body = render(seed)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        # On LMI routes a text/plain body is the prompt (docs/lmi.md): send a prompt, not 500 bytes of JSON.
        plain = route.dialect == "lmi" and content_type == "text/plain"
        cases.append(Case(b"Hello" if plain else body, {"Content-Type": content_type},
                          note=f"Content-Type: {content_type}"))
    for encoding in ("gzip", "deflate", "gzip-bogus", "garbage"):
        encoded, header = _encode(body, encoding)
        cases.append(Case(encoded, {"Content-Encoding": header}, note=f"Content-Encoding: {encoding}"))
    if route.binary:
        for length in ("-1", str(len(body) + 1000), "abc", str(2**63), "0"):
            cases.append(Case(body, {"Inference-Header-Content-Length": length},
                              note=f"Inference-Header-Content-Length: {length}"))
    return cases
