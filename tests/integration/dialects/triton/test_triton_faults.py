"""Triton routes on the model store's `faulty` model (a prompt with "xylophone" fails its prefill):
a failure before the first streamed response keeps a real status code, and the server goes on."""

from __future__ import annotations

import json

import pytest
import requests

pytestmark = pytest.mark.integration


def test_a_failure_before_the_first_response(store_server):
    body = {"text_input": "Play the xylophone", "max_tokens": 3}
    streamed = requests.post(store_server.url("/v2/models/faulty/generate_stream"), json=body, timeout=60)
    assert streamed.status_code == 500
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    assert "injected fault" in json.loads(streamed.text.removeprefix("data: "))["error"]
    whole = requests.post(store_server.url("/v2/models/faulty/generate"), json=body, timeout=60)
    assert whole.status_code == 500 and "injected fault" in whole.json()["error"]
    fine = requests.post(store_server.url("/v2/models/faulty/generate"), timeout=60,
                         json={"text_input": "Hello", "max_tokens": 3})
    assert fine.status_code == 200 and fine.json()["text_output"]
