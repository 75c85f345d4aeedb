"""The task comes from the model's own config.json, end to end: a tiny random GPT-2
(`GPT2LMHeadModel`, once served as an embedding model because its name ends with "Model") is
served as text generation, and a tiny T5 (encoder-decoder, not served yet) fails at start-up with
a message instead of loading as a causal LM.

Both checkpoints are saved in a tmp dir with SmolLM2's tokenizer; both servers start at once.
"""

from __future__ import annotations

import pytest
import requests

from server_process import ServerProcess

pytestmark = pytest.mark.integration

GPT2 = "tiny-gpt2"  # the folder names are the served names
T5 = "tiny-t5"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    root = tmp_path_factory.mktemp("task-decision")
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=256, vocab_size=len(tokenizer),
                                      **special))
    gpt2.save_pretrained(root / GPT2)
    tokenizer.save_pretrained(root / GPT2)
    t5 = T5ForConditionalGeneration(T5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2,
                                             d_kv=16, vocab_size=len(tokenizer), decoder_start_token_id=0, **special))
    t5.save_pretrained(root / T5)
    tokenizer.save_pretrained(root / T5)
    return root


@pytest.fixture(scope="module")
def servers(checkpoints):
    """(GPT-2 by HF_MODEL_ID, T5 by --model-dir), started together so their start-ups overlap."""
    gpt2 = ServerProcess(env={"HF_MODEL_ID": str(checkpoints / GPT2)})
    t5 = ServerProcess("--model-dir", str(checkpoints / T5))
    try:
        yield gpt2, t5
    finally:
        gpt2.stop()
        t5.stop()


@pytest.fixture(scope="module")
def gpt2_server(servers):
    servers[0].wait_for_ping(timeout=120)
    return servers[0]


@pytest.fixture(scope="module")
def expected(checkpoints, tokenizer) -> tuple[str, list[int]]:
    """(text, token ids) transformers' own greedy generate() answers for PROMPT (5 new tokens)."""
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(checkpoints / GPT2).eval()
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    new_ids = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new_ids, skip_special_tokens=True), new_ids


def describe(server, name) -> dict:
    response = requests.get(server.url(f"/models/{name}"), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()[0]["models"][0]


def test_an_lm_head_model_is_described_as_text_generation(gpt2_server):
    model = describe(gpt2_server, GPT2)
    assert model["task"] == "text-generation" and model["architectures"] == ["GPT2LMHeadModel"]
    assert model["status"] == "Healthy" and model["rollingBatch"] is True


def test_the_start_up_log_has_the_decision_and_its_reason(gpt2_server):
    line = (f"Model {GPT2}: task text-generation (architectures ['GPT2LMHeadModel'] are in transformers' "
            "causal-LM mapping)")
    assert gpt2_server.output().count(line) == 1


def test_invocations_generates_what_transformers_generates(gpt2_server, expected):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "do_sample": False}}
    response = requests.post(gpt2_server.url("/invocations"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] == expected[0]


def test_tgi_generate_works(gpt2_server, expected):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}}
    response = requests.post(gpt2_server.url("/generate"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] == expected[0]
    assert [t["id"] for t in response.json()["details"]["tokens"]] == expected[1]


def test_an_encoder_decoder_fails_at_start_up_with_the_message(servers):
    t5 = servers[1]
    ping = t5.wait_for_ping(accept=(500,), timeout=120)
    status = ping.json()[T5]
    assert status["status"] == "Failed"
    assert status["error"].startswith("ModelTaskError: encoder-decoder models (T5, BART: text2text-generation) "
                                      "are not served yet")
    assert "T5ForConditionalGeneration" in status["error"] and "model_type 't5'" in status["error"]
    model = describe(t5, T5)
    assert model["task"] == "text2text-generation" and model["architectures"] == ["T5ForConditionalGeneration"]
    assert model["status"] == "Failed" and model["error"] == status["error"]
    refused = requests.post(t5.url("/invocations"), json={"inputs": PROMPT}, timeout=10)
    assert refused.status_code == 503  # never text from a decoder without its encoder
    assert f"Model {T5}: task text2text-generation (architectures ['T5ForConditionalGeneration']" in t5.output()
