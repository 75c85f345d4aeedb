"""OpenAI routes on the model store: context limits and truncation on a short-context model,
429 with retry-after on a full queue, 500 only for a real fault, dynamic-batch models refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI
from server_process import wait_for
from server_probes import both_rows_busy, engine_stats

pytestmark = pytest.mark.integration

LONG_PROMPT = " ".join(f"word{i}" for i in range(120))  # ~240 tokens: over the 160-token context


@pytest.fixture(scope="module")
def client(store_server, openai_client) -> OpenAI:
    return openai_client(store_server)


def test_error_behavior_truncate_keeps_the_prompt_tail(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="short", prompt=LONG_PROMPT, max_tokens=10, temperature=0)
    assert "maximum context length is 160 tokens" in caught.value.message and caught.value.param == "prompt"
    truncated = client.completions.create(model="short", prompt=LONG_PROMPT, max_tokens=10, temperature=0,
                                          extra_body={"error_behavior": "truncate"})
    assert truncated.usage.prompt_tokens == 150 and truncated.usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="short", prompt=LONG_PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"error_behavior": "error"})
    with pytest.raises(openai.BadRequestError):  # nothing left to keep: max_tokens alone fills the context
        client.completions.create(model="short", prompt="Hi", max_tokens=160, extra_body={"error_behavior": "truncate"})


def test_chat_without_max_tokens_fills_what_is_left_of_the_context(client):
    response = client.chat.completions.create(model="short", messages=[{"role": "user", "content": "Count to 100."}],
                                              temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == 160


def test_full_queue_is_429_with_retry_after(store_server, client):
    with both_rows_busy(store_server) as running, ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(client.completions.create, model="faulty", prompt=p, max_tokens=2)
                   for p in ("Hi", "Hey")]
        wait_for(lambda: engine_stats(store_server, "faulty")["waiting"] == 2)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="faulty", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=2)
        assert caught.value.status_code == 429 and caught.value.response.headers["retry-after"] == "1"
        assert caught.value.code == "rate_limit_exceeded"
        for stream in running:
            stream.close()
        for future in waiting:  # admitted once the streams went away, or timed out cleanly
            try:
                assert future.result().choices
            except openai.APIStatusError as exc:
                assert exc.status_code == 504
    assert client.completions.create(model="faulty", prompt="Hello", max_tokens=2).choices


def test_a_real_fault_is_500_and_the_server_keeps_serving(client):
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="faulty", max_tokens=3,
                                       messages=[{"role": "user", "content": "Play the xylophone"}])
    assert caught.value.status_code == 500 and "injected fault" in caught.value.message
    assert client.chat.completions.create(model="faulty", max_tokens=3,
                                          messages=[{"role": "user", "content": "Hello"}]).choices


def test_dynamic_batch_models_are_refused_with_a_reason(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="dynamic", prompt="Hello", max_tokens=2)
    assert "rolling batch" in caught.value.message


def test_an_unknown_model_name_among_several_generation_models_is_a_404_listing_them(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="dummy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert caught.value.code == "model_not_found" and "`dummy` does not exist" in caught.value.message
    assert "`short`" in caught.value.message and "`tgi`" in caught.value.message
    assert "`fallback`" not in caught.value.message  # an embedding model
