"""Encoder-decoder models end to end: a tiny random T5 on the rolling batch and a tiny random BART
on dynamic batching, one model store, one server. Every dialect's text route answers what
transformers' own `generate()` answers for the same prompt (greedy), streamed and not; what an
encoder-decoder model cannot do (a chat without a chat template, prompt logprobs) is refused by
name, in the route's dialect.

The checkpoints are built here (no download) with SmolLM2's tokenizer; T5's has its chat template
removed, as real T5 tokenizers have none.
"""

from __future__ import annotations

import json

import pytest
import requests
from openai import BadRequestError
from text_generation import Client
from text_generation.errors import ValidationError

from server_process import ServerProcess

pytestmark = pytest.mark.integration

T5, BART = "t5", "bart"  # the store's folder names are the served names
PROMPTS = ["The capital of France is", "Translate to German: the house is small and the garden is green"]
NEW_TOKENS = 8


def _redraw(model, std: float):
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:  # a tiny random model needs larger weights to depend on its input
                parameter.normal_(0.0, std)
    model.generation_config.forced_eos_token_id = None
    return model


@pytest.fixture(scope="module")
def store(tmp_path_factory, tokenizer):
    import torch
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    root = tmp_path_factory.mktemp("seq2seq-store")
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    t5 = _redraw(T5ForConditionalGeneration(T5Config(
        num_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8, vocab_size=len(tokenizer),
        decoder_start_token_id=tokenizer.pad_token_id, architectures=["T5ForConditionalGeneration"], **special)),
        0.5)
    t5.save_pretrained(root / T5)
    templated = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        tokenizer.save_pretrained(root / T5)
    finally:
        tokenizer.chat_template = templated
    bart = _redraw(BartForConditionalGeneration(BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256, vocab_size=len(tokenizer),
        decoder_start_token_id=tokenizer.eos_token_id, architectures=["BartForConditionalGeneration"], **special)),
        0.2)
    bart.generation_config.forced_bos_token_id = tokenizer.bos_token_id  # as BART checkpoints do
    bart.save_pretrained(root / BART)
    tokenizer.save_pretrained(root / BART)
    (root / BART / "serving.properties").write_text("option.rolling_batch=disable\nbatch_size=4\n"
                                                     "max_batch_delay=200\n")
    return root


@pytest.fixture(scope="module")
def server(store):
    server = ServerProcess("--model-store", str(store))
    try:
        server.wait_for_ping(timeout=240)
        yield server
    finally:
        server.stop()


def reference(folder, tokenizer, prompt: str) -> tuple[str, list[int]]:
    """(text, ids) of transformers' greedy generate() of NEW_TOKENS for `prompt`, from the saved folder."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    from lmi_serve.engine.kv.encdec import decoder_prompt

    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    start = decoder_prompt(model)
    ids = torch.tensor([tokenizer(prompt).input_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), decoder_input_ids=torch.tensor([start]),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    new = out[0, len(start):].tolist()
    # Random weights pick byte tokens too: the server holds back the tokens of a character cut off
    # at the end, so the text is that of the longest prefix that decodes whole.
    whole = len(new)
    while whole and tokenizer.decode(new[:whole], skip_special_tokens=True).endswith("\ufffd"):
        whole -= 1
    return tokenizer.decode(new[:whole], skip_special_tokens=True), new


@pytest.fixture(scope="module")
def expected(store, tokenizer) -> dict[str, list[tuple[str, list[int]]]]:
    found = {name: [reference(store / name, tokenizer, p) for p in PROMPTS] for name in (T5, BART)}
    for name, answers in found.items():  # premise: the tiny models answer text that depends on the prompt
        assert all(text.strip() for text, _ in answers) and answers[0] != answers[1], (name, answers)
    return found


def post(server, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(server.url(path), json=body, timeout=120, **kwargs)


def test_the_models_load_as_text2text_with_their_engines(server):
    described = {name: requests.get(server.url(f"/models/{name}"), timeout=10).json()[0]["models"][0]
                 for name in (T5, BART)}
    assert described[T5]["task"] == "text2text-generation"
    assert described[T5]["architectures"] == ["T5ForConditionalGeneration"] and described[T5]["rollingBatch"] is True
    assert described[BART]["architectures"] == ["BartForConditionalGeneration"]
    assert described[BART]["rollingBatch"] is False
    assert (f"Model {T5}: task text2text-generation (architectures ['T5ForConditionalGeneration'] are in "
            "transformers' seq2seq-LM mapping)") in server.output()


def test_lmi_rolling_streamed_and_not(server, expected):
    for prompt, (text, _) in zip(PROMPTS, expected[T5]):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False}}
        whole = post(server, f"/predictions/{T5}", body)
        assert whole.status_code == 200, whole.text
        assert whole.json()["generated_text"] == text
        stream = post(server, f"/predictions/{T5}", {**body, "stream": True}, stream=True)
        lines = [json.loads(line) for line in stream.iter_lines() if line]
        assert "".join(line["token"]["text"] for line in lines if "token" in line) == text


def test_lmi_dynamic_batch_answers_each_prompt_as_alone(server, expected):
    body = {"inputs": PROMPTS, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False}}
    response = post(server, f"/predictions/{BART}", body)
    assert response.status_code == 200, response.text
    assert [r["generated_text"] for r in response.json()] == [text for text, _ in expected[BART]]


def test_tgi_generate_and_stream(server, expected):
    client = Client(server.base, headers={"model_name": T5}, timeout=120)
    for prompt, (text, ids) in zip(PROMPTS, expected[T5]):
        response = client.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert response.generated_text == text
        assert [t.id for t in response.details.tokens] == ids
        streamed = list(client.generate_stream(prompt, max_new_tokens=NEW_TOKENS))
        assert [frame.token.id for frame in streamed] == ids and streamed[-1].generated_text == text
    info = requests.get(server.url("/info"), params={"model_name": T5}, timeout=10).json()
    assert info["model_pipeline_tag"] == "text2text-generation"


def test_a_stop_sequence_ends_the_text(server, expected):
    text = expected[T5][1][0]
    stop = text.split()[1]  # a word inside the answer
    client = Client(server.base, headers={"model_name": T5}, timeout=120)
    response = client.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS, stop_sequences=[stop])
    assert response.details.finish_reason.value == "stop_sequence"
    assert response.generated_text == text[:text.index(stop)]  # as for every model here: without the stop


def test_prompt_logprobs_are_refused_by_name(server, openai_client):
    client = Client(server.base, headers={"model_name": T5}, timeout=120)
    with pytest.raises(ValidationError, match="encoder-decoder"):
        client.generate(PROMPTS[0], max_new_tokens=2, decoder_input_details=True)
    openai = openai_client(server, strict=False)
    with pytest.raises(BadRequestError, match="encoder-decoder"):
        openai.completions.create(model=T5, prompt=PROMPTS[0], max_tokens=2, echo=True, logprobs=1)


def test_openai_completions_streamed_and_not(server, expected, openai_client):
    client = openai_client(server)
    # The client's chunk type has a non-nullable finish_reason, which OpenAI's own streams send as
    # null until the last chunk: streams are read without strict validation (as in
    # test_openai_completions.py).
    lenient = openai_client(server, strict=False)
    for prompt, (text, _) in zip(PROMPTS, expected[T5]):
        whole = client.completions.create(model=T5, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert whole.choices[0].text == text
        chunks = lenient.completions.create(model=T5, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == text


def test_openai_chat_without_a_chat_template_is_refused(server, openai_client):
    client = openai_client(server)
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=T5, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 400
    assert "no chat template" in refused.value.body["message"] and refused.value.body["param"] == "messages"


def test_triton_generate_streamed_and_not(server, expected):
    for prompt, (text, _) in zip(PROMPTS, expected[T5]):
        body = {"text_input": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        whole = post(server, f"/v2/models/{T5}/generate", body)
        assert whole.status_code == 200, whole.text
        assert whole.json()["text_output"] == text
        stream = post(server, f"/v2/models/{T5}/generate_stream", body, stream=True)
        frames = [json.loads(line[len("data: "):]) for line in stream.iter_lines(decode_unicode=True) if line]
        assert "".join(frame["text_output"] for frame in frames) == text


def test_concurrent_requests_of_every_dialect_share_the_batch_and_stay_exact(server, expected):
    """Requests of different lengths in flight together (the rows join the batch at different steps)."""
    from concurrent.futures import ThreadPoolExecutor

    def lmi(prompt):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False}}
        return post(server, f"/predictions/{T5}", body).json()["generated_text"]

    def triton(prompt):
        body = {"text_input": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        return post(server, f"/v2/models/{T5}/generate", body).json()["text_output"]

    jobs = [(call, i) for _ in range(3) for call in (lmi, triton) for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: job[0](PROMPTS[job[1]]), jobs))
    assert answers == [expected[T5][i][0] for _, i in jobs]
