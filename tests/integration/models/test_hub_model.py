"""A Hub id served by the real server, downloaded at start-up from a loopback Hub (tests/fake_hub.py)
through HF_ENDPOINT: once for two workers, the pinned revision, a restart from the cache with the Hub
gone, and a wrong token that fails the model without the token showing anywhere. The failure cases
one by one are unit tests (tests/unit/model/test_hub_download.py)."""

from __future__ import annotations

import json

import pytest
import requests

from fake_hub import FakeHub
from server_process import ServerProcess, serving, wait_for
from tiny_hub_model import as_mistral, tiny_llama_files, with_extras

pytestmark = pytest.mark.integration

TOKEN = "hf_valid_0123456789"
SECRET = "hf_wrong_secret_4242"
PROMPT = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}}


def server_env(hub_url: str, root, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub_url, "HF_HOME": str(root / "hf"), "LMI_SERVE_CACHE_DIR": str(root / "lmi"),
            "HF_MODEL_ID": "acme/tiny", "HF_HUB_OFFLINE": "0", **extra}


@pytest.fixture(scope="module")
def revisions() -> dict[str, dict[str, bytes]]:
    files = tiny_llama_files()
    return {"main": with_extras(files), "v1": {**as_mistral(files), "NOTES.txt": b"v1 only"}}


@pytest.fixture(scope="module")
def first_start(revisions, tmp_path_factory):
    """Two workers start against the Hub with revision v1 pinned; what they fetched and served."""
    root = tmp_path_factory.mktemp("hub-model")
    with FakeHub(tokens=(TOKEN,)) as hub:
        hub.add("acme/tiny", revisions)
        hub.seconds_per_mib = 0.5  # ~8 s of download: long enough to ask /ping in the middle of it
        env = server_env(hub.url, root, HF_REVISION="v1", HF_TOKEN=TOKEN, SAGEMAKER_NUM_MODEL_WORKERS="2")
        server = ServerProcess(env=env)
        try:
            wait_for(lambda: "Downloading Hub model" in server.output(), timeout=300)
            during = requests.get(server.url("/ping"), timeout=10)
            facts = {"ping_during": during, "ping_was_during": "Downloaded Hub model" not in server.output()}
            server.wait_for_ping()
            # /ping is 200 once one worker is ready; the other may still load (a request there is a 503)
            wait_for(lambda: server.output().count("Model tiny ready") == 2, timeout=300)
            facts.update({"root": root, "file_gets": hub.file_gets(),
                          "models": requests.get(server.url("/models/tiny"), timeout=10).json(),
                          "listed": requests.get(server.url("/models"), timeout=10).text,
                          "generated": [requests.post(server.url("/invocations"), json=PROMPT, timeout=60)
                                        for _ in range(4)]})  # 4 requests: both workers answer some
        finally:
            server.stop()
        facts["log"] = server.output()
    return facts


def test_two_workers_download_the_pinned_revision_once_and_serve_it(first_start, revisions):
    fetched = sorted(path.rsplit("/", 1)[-1] for path in first_start["file_gets"])
    assert fetched == sorted(revisions["v1"])  # each file once, for both workers; v1's, not main's
    assert first_start["log"].count("Downloading Hub model acme/tiny@v1 (commit") == 1
    (description,) = first_start["models"][0]["models"]
    assert description["architectures"] == ["MistralForCausalLM"]  # v1's config, not main's Llama
    generated = first_start["generated"]
    assert all(r.status_code == 200 and r.json()["generated_text"] for r in generated), [
        (r.status_code, r.text[:200]) for r in generated]
    assert TOKEN not in first_start["log"] and TOKEN not in first_start["listed"]


def test_ping_says_loading_while_the_model_downloads(first_start):
    assert first_start["ping_was_during"]
    assert first_start["ping_during"].status_code == 503
    assert first_start["ping_during"].json() == {"tiny": {"status": "Loading"}}


def test_a_restart_serves_the_cached_copy_with_the_hub_gone(first_start):
    with FakeHub() as gone:
        dead = gone.url
    with serving(env=server_env(dead, first_start["root"], HF_REVISION="v1")) as server:
        answer = requests.post(server.url("/invocations"), json=PROMPT, timeout=60)
        assert answer.status_code == 200 and answer.json()["generated_text"]
        assert "all 7 files are in the cache" in server.output()


def test_a_wrong_token_fails_the_model_naming_it_and_never_shows_the_token(tmp_path, revisions):
    with FakeHub(tokens=(TOKEN,)) as hub:
        hub.add("acme/tiny", revisions)
        server = ServerProcess("--log-format", "json", env=server_env(hub.url, tmp_path, HF_TOKEN=SECRET))
        try:
            ping = server.wait_for_ping(accept=(500,), timeout=300)
            listed = requests.get(server.url("/models"), timeout=10).text
        finally:
            server.stop()
    error = ping.json()["tiny"]["error"]
    assert "'acme/tiny'" in error and "401" in error and "HF_TOKEN" in error
    log = server.output()
    records = [json.loads(line) for line in log.splitlines() if line.strip()]  # every line a JSON object
    assert any("'acme/tiny'" in r["message"] and "401" in r["message"] for r in records if r["level"] == "ERROR")
    for text in (ping.text, listed, log):
        assert SECRET not in text
