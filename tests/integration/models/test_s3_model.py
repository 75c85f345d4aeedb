"""An s3:// model served by the real server: copied at start-up from moto's S3 on loopback through
AWS_ENDPOINT_URL_S3, then served from the copy after a restart with S3 gone. The failure cases one by
one are unit tests (tests/unit/model/test_s3_download.py)."""

from __future__ import annotations

import pytest
import requests

from fake_s3 import CREDENTIALS, moto_s3, upload
from server_process import free_port, serving
from tiny_hub_model import tiny_llama_files, with_extras

pytestmark = pytest.mark.integration

PROMPT = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}}


def server_env(endpoint: str, root) -> dict[str, str]:
    return {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": endpoint, "AWS_MAX_ATTEMPTS": "2",
            "LMI_SERVE_CACHE_DIR": str(root), "HF_MODEL_ID": "s3://models/tiny-model"}


def test_an_s3_model_is_copied_served_and_served_again_from_the_copy_without_s3(tmp_path):
    with moto_s3() as endpoint:
        upload(endpoint, "models", "tiny-model", with_extras(tiny_llama_files()))
        with serving(env=server_env(endpoint, tmp_path)) as server:
            answer = requests.post(server.url("/invocations"), json=PROMPT, timeout=60)
            assert answer.status_code == 200 and answer.json()["generated_text"]
            listed = requests.get(server.url("/models"), timeout=10).json()["models"]
            assert listed == [{"modelName": "tiny-model", "modelUrl": "s3://models/tiny-model", "status": "Healthy"}]
        assert "Downloading s3://models/tiny-model: 6 files" in server.output()
    with serving(env=server_env(f"http://127.0.0.1:{free_port()}", tmp_path)) as server:
        answer = requests.post(server.url("/invocations"), json=PROMPT, timeout=60)
        assert answer.status_code == 200 and answer.json()["generated_text"]
        assert "s3://models/tiny-model: serving the copy in" in server.output()
