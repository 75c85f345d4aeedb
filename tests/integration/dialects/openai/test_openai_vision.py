"""Vision-language chat over HTTP with the official `openai` client: a store of two tiny random VLMs
(Idefics3 as `smolvlm`, LLaVA as `llava` with option.limit_mm_per_prompt=2; tests/tiny_vlm.py) and a
tiny text model. An `image_url` data URI (PNG or JPEG) answers what transformers' greedy `generate()`
makes from the same chat template, processor and pixels; other pixels answer otherwise. Refusals are
400s in OpenAI's shape naming the part: a loopback URL under option.image_fetch=public, bytes that are not an
image, more images than the limit, and any image to a text model. The store is the package's
(integration/conftest.py); its text model is the reasoner (tests/tiny_store.py)."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

import tiny_vlm
from tiny_store import REASONER as TEXT_MODEL

pytestmark = pytest.mark.integration

TOKENS = 6
QUESTION = "What is in the picture?"


def data_uri(seed: int, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    tiny_vlm.image(seed).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def user(*urls: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def store(tiny_store):
    return tiny_store  # the shared tiny store (integration/conftest.py): `smolvlm`, `llava`, the reasoner among it


@pytest.fixture(scope="module")
def server(tiny_models_server):
    return tiny_models_server  # one start for the tiny-model modules (integration/conftest.py)


def reference(folder, messages_for_template, images) -> str:
    """transformers' greedy answer from the checkpoint's own processor and chat template."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    text = processor.apply_chat_template(messages_for_template, add_generation_prompt=True)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=TOKENS, min_new_tokens=TOKENS, pad_token_id=0)
    return processor.tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)


def ask(client, model: str, messages: list[dict]) -> str:
    completion = client.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == TOKENS
    return completion.choices[0].message.content


@pytest.mark.parametrize("model, fmt", [("smolvlm", "PNG"), ("llava", "JPEG")])
def test_an_image_answers_as_generate_does(server, store, openai_client, model, fmt):
    client = openai_client(server)
    from PIL import Image

    pictures = []
    for seed in (1, 2):
        raw = base64.b64decode(data_uri(seed, fmt).split(",", 1)[1])
        pictures.append(Image.open(io.BytesIO(raw)).convert("RGB"))  # what the server decodes (JPEG is lossy)
    template_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    expected = [reference(store / model, template_messages, [p]) for p in pictures]
    assert expected[0] != expected[1]  # premise: the pixels matter
    assert [ask(client, model, user(data_uri(seed, fmt))) for seed in (1, 2)] == expected


def refusal(client, model: str, messages: list[dict]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    return caught.value


def test_bad_images_are_400s_naming_the_part(server, openai_client):
    client = openai_client(server)
    error = refusal(client, "llava", user("http://127.0.0.1:9/cat.png"))  # option.image_fetch=public
    assert error.param == "messages[0].content[0]" and "private or local address" in error.message
    detail = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(1), "detail": "high"}}]}]
    error = refusal(client, "smolvlm", detail)
    assert error.param == "messages[0].content[0].image_url.detail" and "'high'" in error.message
    not_image = "data:image/png;base64," + base64.b64encode(b"plain text, not a PNG").decode()
    error = refusal(client, "smolvlm", [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}, *user(data_uri(1), not_image)])
    assert error.param == "messages[2].content[1]" and "not an image" in error.message
    error = refusal(client, "smolvlm", user("data:image/png;base64,@@@"))
    assert error.param == "messages[0].content[0]" and "base64" in error.message
    error = refusal(client, "llava", user(data_uri(1), data_uri(2), data_uri(3)))
    assert error.param == "messages[0].content[2]" and "limit of 2" in error.message


def test_a_text_model_refuses_images_as_before(server, openai_client):
    error = refusal(openai_client(server), TEXT_MODEL, user(data_uri(1)))
    assert error.param == "messages[0].content[0]" and "text parts only" in error.message


def test_two_images_within_the_limit_and_text_turns_are_served(server, openai_client):
    client = openai_client(server)
    messages = [{"role": "system", "content": "Be brief."}, *user(data_uri(3), data_uri(4), text="Compare them.")]
    assert ask(client, "llava", messages)
    assert ask(client, "smolvlm", [{"role": "user", "content": "no image at all"}])


def test_streamed_equals_whole_and_lmi_chat_answers_the_same(server, openai_client):
    import requests

    client = openai_client(server, strict=False)
    messages = user(data_uri(5))
    whole = ask(client, "smolvlm", messages)
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="smolvlm", messages=messages, max_tokens=TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices]
    assert "".join(pieces) == whole
    # LMI's schema takes the same chat body (dialects/lmi/rolling.py): the same images, the same answer
    reply = requests.post(server.url("/predictions/smolvlm"), json={
        "messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == whole


@pytest.fixture(scope="module")
def image_server():
    """A loopback HTTP server with one PNG, data_uri(1)'s bytes, at /cat.png."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    png = base64.b64decode(data_uri(1).split(",", 1)[1])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(png)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def test_an_image_url_is_fetched_where_the_option_allows(server, openai_client, image_server):
    client = openai_client(server)
    assert ask(client, "smolvlm", user(f"{image_server}/cat.png")) == ask(client, "smolvlm", user(data_uri(1)))
    error = refusal(client, "smolvlm", user(f"{image_server}/missing.png"))
    assert error.param == "messages[0].content[0]" and "HTTP 404" in error.message


def tgi_generate(server, model: str, inputs: str, **parameters):
    import requests

    return requests.post(server.url(f"/generate?model_name={model}"), timeout=300, json={
        "inputs": inputs, "parameters": {"max_new_tokens": TOKENS, "do_sample": False, "ignore_eos_token": True,
                                         **parameters}})


def test_tgi_markdown_images_answer_as_generate_does(server, store, image_server):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = store / "smolvlm"
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    expected = []
    for seed in (1, 2):  # TGI: the markdown image is the processor's placeholder, where it stands in the text
        picture = Image.open(io.BytesIO(base64.b64decode(data_uri(seed).split(",", 1)[1]))).convert("RGB")
        inputs = processor(text=[f"<image>{QUESTION}"], images=[picture], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=TOKENS, min_new_tokens=TOKENS, pad_token_id=0)
        expected.append(processor.tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True))
    assert expected[0] != expected[1]  # premise: the pixels matter
    for seed in (1, 2):
        answer = tgi_generate(server, "smolvlm", f"![]({data_uri(seed)}){QUESTION}")
        assert answer.status_code == 200, answer.text
        assert answer.json()["generated_text"] == expected[seed - 1]
    fetched = tgi_generate(server, "smolvlm", f"![a cat]({image_server}/cat.png){QUESTION}")
    assert fetched.status_code == 200 and fetched.json()["generated_text"] == expected[0], fetched.text
    bad = tgi_generate(server, "smolvlm", f"![]({data_uri(1)})![](data:image/png;base64,@@@){QUESTION}")
    assert bad.status_code == 422 and "inputs, image 2" in bad.json()["error"], bad.text
    # a text model keeps the markdown as text, as TGI does
    as_text = tgi_generate(server, TEXT_MODEL, "![a cat](http://127.0.0.1:9/cat.png) hi", max_new_tokens=2)
    assert as_text.status_code == 200, as_text.text
