"""OpenAI parameters -> neutral GenerationRequests -> engine handles, and events back per choice.

Shared by chat and completions. Seeds and context follow engine.policy: choice i of a prompt
uses seed + i modulo 2**63 (a given seed reproduces every choice; choices still differ), and
prompt + max_tokens beyond the context is refused (a 400 with OpenAI's wording), unless
completions ask for `error_behavior: truncate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lmi_serve.dialects.common import guided
from lmi_serve.dialects.openai.schema import SamplingFields
from lmi_serve.dialects.openai.vllm import extend
from lmi_serve.engine import policy
from lmi_serve.engine.engine import Engine
from lmi_serve.engine.generation import Generation
from lmi_serve.engine.types import GenerationRequest, GenerationResult, GuidedDecoding, SamplingParams, StopParams
from lmi_serve.errors import InvalidRequest


def sampling_params(fields: SamplingFields, seed: int | None, vocab_size: int) -> SamplingParams:
    temperature = 1.0 if fields.temperature is None else fields.temperature
    bias = []
    for key, value in (fields.logit_bias or {}).items():
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"logit_bias: token id {token_id} is outside the vocabulary of {vocab_size}",
                                 param="logit_bias")
        bias.append((token_id, float(value)))
    return SamplingParams(
        do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0,
        top_k=max(fields.top_k or 0, 0), top_p=1.0 if fields.top_p is None else fields.top_p,
        min_p=fields.min_p or 0.0, repetition_penalty=fields.repetition_penalty or 1.0,
        presence_penalty=fields.presence_penalty, frequency_penalty=fields.frequency_penalty,
        seed=seed, logit_bias=tuple(bias))


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """A 400 naming the first id that is not in the model's vocabulary."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{param}: token id {bad} is outside the vocabulary of {vocab_size}", param=param)


def fit_to_context(prompt: Sequence[int], max_tokens: int | None, max_model_len: int, *, where: str,
                   param: str, truncate: bool = False,
                   over: Literal["refuse", "cap"] = "refuse") -> tuple[tuple[int, ...], int]:
    """(prompt ids, max new tokens) within the context; max_tokens None means all that is left.
    More than fits is refused (OpenAI's ContextOverflow), unless `truncate` (completions'
    `error_behavior: truncate`) may drop the prompt's first tokens to make room for max_tokens, or
    `over="cap"` (Anthropic's rule) gives what is left."""
    prompt = tuple(prompt)
    if truncate and max_tokens is not None and len(prompt) + max_tokens > max_model_len and max_tokens < max_model_len:
        prompt = prompt[len(prompt) + max_tokens - max_model_len:]
    return policy.fit_to_context(prompt, max_tokens, max_model_len, over=over, where=where, param=param)


def build_requests(engine: Engine, fields: SamplingFields, prompt: tuple[int, ...], max_new_tokens: int, *,
                   count: int, top_n: int = 0, prompt_logprobs: bool = False,
                   guided: GuidedDecoding | None = None, adapter: str | None = None) -> list[GenerationRequest]:
    do_sample = fields.temperature is None or fields.temperature > 0
    seeds = policy.sequence_seeds(fields.seed, count, sampled=do_sample)
    stop = StopParams(max_new_tokens=max_new_tokens, stop_sequences=fields.stops,
                      stop_token_ids=frozenset(fields.stop_token_ids or ()), eos_token_ids=engine.eos_token_ids,
                      ignore_eos=fields.ignore_eos, include_stop_str_in_output=fields.include_stop_str_in_output)
    vocab = engine.vocab_size
    check_token_ids(fields.stop_token_ids or (), vocab, "stop_token_ids")
    return extend(engine, fields, [
        GenerationRequest(prompt, sampling_params(fields, seed, vocab), stop,
                          top_n_tokens=top_n, prompt_logprobs=prompt_logprobs, guided=guided, adapter=adapter)
        for seed in seeds])


def submit(engine: Engine, requests: list[GenerationRequest]) -> Generation:
    """Queue every sequence (all or none). The engine's refusals are kinds (Overloaded: a 429) and
    pass through; an invalid grammar is the client's `response_format`."""
    return guided.generate(engine, requests, "response_format")


@dataclass
class ChoiceState(GenerationResult):
    """One choice's output so far (formatters read it), with its index in the response."""

    index: int = 0

    @property
    def generated(self) -> int:
        return self.generated_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
