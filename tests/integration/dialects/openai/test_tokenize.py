"""POST /tokenize and /detokenize on the real server and model: vLLM's shapes (prompt or messages)
and TGI's (`inputs`), checked against the model's own tokenizer and against what generation counts."""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
TEXT = "The café's naïve owner said: ¿qué tal? 你好"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def post(server, path: str, body: dict, **params) -> requests.Response:
    return requests.post(server.url(path), json=body, params=params, timeout=60)


def test_a_prompt_tokenizes_as_the_model_does(default_server, tokenizer):
    reply = post(default_server, "/tokenize", {"model": MODEL, "prompt": TEXT, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = tokenizer(TEXT).input_ids
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    info = requests.get(default_server.url("/info"), timeout=30).json()
    assert body["max_model_len"] == info["max_total_tokens"]


def test_token_strs_only_when_asked(default_server):
    body = post(default_server, "/tokenize", {"model": MODEL, "prompt": "hi"}).json()
    assert set(body) == {"count", "max_model_len", "tokens"}


def test_messages_count_what_a_chat_completion_reads(default_server, tokenizer):
    tokenized = post(default_server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    chat = post(default_server, "/v1/chat/completions",
                {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}).json()
    assert tokenized["count"] == chat["usage"]["prompt_tokens"]
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenized["tokens"] == tokenizer(text, add_special_tokens=False).input_ids


def test_template_switches_change_the_ids(default_server, tokenizer):
    with_turn = post(default_server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    without = post(default_server, "/tokenize",
                   {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert len(without) < len(with_turn) and with_turn[:len(without)] == without
    partial = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    continued = post(default_server, "/tokenize", {"model": MODEL, "messages": partial, "add_generation_prompt": False,
                                                   "continue_final_message": True}).json()["tokens"]
    assert tokenizer.decode(continued).endswith("The answer is")


def test_detokenize_inverts_tokenize(default_server):
    ids = post(default_server, "/tokenize", {"model": MODEL, "prompt": TEXT}).json()["tokens"]
    reply = post(default_server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert reply.status_code == 200 and reply.json() == {"prompt": TEXT}


def test_an_id_outside_the_vocabulary_is_a_400(default_server, tokenizer):
    reply = post(default_server, "/detokenize", {"model": MODEL, "tokens": [1, len(tokenizer)]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"


def test_an_embedding_model_is_refused_for_tokenize(default_server):
    reply = post(default_server, "/tokenize", {"model": "all-minilm-l6-v2", "prompt": "hi"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


def test_tgi_tokenize_gives_offsets_into_the_input(default_server, tokenizer):
    reply = post(default_server, "/tokenize", {"inputs": TEXT, "parameters": {"max_new_tokens": 4}})
    assert reply.status_code == 200, reply.text
    tokens = reply.json()
    assert [t["id"] for t in tokens] == tokenizer(TEXT).input_ids
    for token in tokens:
        assert set(token) == {"id", "text", "start", "stop"}
        assert token["text"] == TEXT[token["start"]:token["stop"]]
    # Byte-level BPE splits a character over several tokens: each of them covers the whole character.
    assert tokens[0]["start"] == 0 and tokens[-1]["stop"] == len(TEXT)
    assert all(a["start"] <= b["start"] <= a["stop"] for a, b in zip(tokens, tokens[1:]))


def test_tgi_tokenize_applies_truncate(default_server, tokenizer):
    tokens = post(default_server, "/tokenize", {"inputs": TEXT, "parameters": {"truncate": 3}}).json()
    assert [t["id"] for t in tokens] == tokenizer(TEXT).input_ids[-3:]


def test_tgi_errors_keep_tgi_shape(default_server):
    reply = post(default_server, "/tokenize", {"inputs": "hi", "parameters": {"temperature": 0}})
    assert reply.status_code == 422 and set(reply.json()) == {"error", "error_type"}
    reply = post(default_server, "/tokenize", {"inputs": "hi"}, model_name="no-such-model")
    assert reply.status_code == 404 and reply.json()["error_type"] == "not_found"
