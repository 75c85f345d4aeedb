"""The task comes from the model's own config.json, end to end: a tiny random GPT-2
(`GPT2LMHeadModel`, once served as an embedding model because its name ends with "Model") is
served as text generation. (Encoder-decoder checkpoints, text2text-generation, are served end to
end in test_encoder_decoder.py.)

The checkpoint is saved in a tmp dir with SmolLM2's tokenizer.
"""

from __future__ import annotations

import pytest
import requests

from server_process import ServerProcess

pytestmark = pytest.mark.integration

GPT2 = "tiny-gpt2"  # the folder name is the served name
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("task-decision")
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=256, vocab_size=len(tokenizer),
                                      **special))
    gpt2.save_pretrained(root / GPT2)
    tokenizer.save_pretrained(root / GPT2)
    return root


@pytest.fixture(scope="module")
def gpt2_server(checkpoints):
    """GPT-2 by HF_MODEL_ID."""
    server = ServerProcess(env={"HF_MODEL_ID": str(checkpoints / GPT2)})
    try:
        server.wait_for_ping(timeout=240)
        yield server
    finally:
        server.stop()


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
