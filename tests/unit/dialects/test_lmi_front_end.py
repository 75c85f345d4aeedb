"""dialects/lmi/front_end.py: what answers the built-in text handler's requests, built by the LMI
dialect from what the handler loaded (serving/front_end.py TextModel): the rolling-batch service on
its engine, or the dynamic batch's parser and renderer (here on a fake generator, no model)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from lmi_serve.config.sources import ModelConfig
from lmi_serve.dialects.lmi.front_end import DynamicBatchService, lmi_front_end
from lmi_serve.dialects.lmi.rolling import RollingBatchService
from lmi_serve.engine.types import TokenEvent
from lmi_serve.handler_api import Input
from lmi_serve.serving.front_end import TextModel


def tokenizer(text):
    return SimpleNamespace(input_ids=[ord(c) for c in text])


def echo(requests):
    """A static batch that generates "<n>!" for every request (n its prompt tokens), row by row."""
    for i, request in enumerate(requests):
        yield i, TokenEvent(token_id=1, text=f"{len(request.prompt_ids)}!", logprob=0.0, special=False)


def model(engine=None, **config) -> TextModel:
    return TextModel(ModelConfig(name="m", model_id="x", **config), tokenizer, max_input_len=8, max_model_len=16,
                     eos_token_ids=frozenset({2}), engine=engine, generate=echo)


def test_a_model_with_an_engine_gets_the_rolling_service_else_the_dynamic_one():
    engine = SimpleNamespace()
    rolling = lmi_front_end(model(engine, tgi_compat=True, output_formatter="jsonlines"))
    assert isinstance(rolling, RollingBatchService) and rolling.engine is engine
    assert rolling.tgi_compat and rolling.output_formatter == "jsonlines" and rolling.max_input_len == 8
    assert isinstance(lmi_front_end(model()), DynamicBatchService)


def test_the_dynamic_batch_answers_each_request_and_a_bad_one_fails_alone():
    service = lmi_front_end(model())
    good = Input.from_http(json.dumps({"inputs": "abc", "parameters": {"max_new_tokens": 4}}).encode(),
                           {"Content-Type": "application/json"}, [], "r1")
    out = service.inference(good)
    assert out.code == 200 and json.loads(out.body()) == [{"generated_text": "3!"}]
    too_long = Input.from_http(json.dumps({"inputs": "abcdefghijk"}).encode(),
                               {"Content-Type": "application/json"}, [], "r2")
    out = service.inference(too_long)
    assert out.code == 424 and "over the limit of 8" in out.body().decode()
    chat = Input.from_http(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                           {"Content-Type": "application/json"}, [], "r3")
    assert "need the rolling batch" in service.inference(chat).body().decode()
