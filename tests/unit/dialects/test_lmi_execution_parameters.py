"""GET /execution-parameters: SageMaker Batch Transform's defaults, from the configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmi_serve.config.sources import build_server_config
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry


def parameters(env: dict[str, str], model_store: Path | None = None) -> dict:
    config = build_server_config(env, model_store=model_store)
    app = create_app(config, ModelRegistry.from_config(config))  # not loaded: the configuration answers
    answer = app.test_client().get("/execution-parameters")
    assert answer.status_code == 200 and answer.mimetype == "application/json"
    return answer.get_json()


@pytest.mark.parametrize("env, expected", [
    ({}, {"MaxConcurrentTransforms": 32, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 64}),
    ({"OPTION_MAX_ROLLING_BATCH_SIZE": "8", "SAGEMAKER_MAX_PAYLOAD_IN_MB": "6"},
     {"MaxConcurrentTransforms": 8, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 6}),
    # option.max_request_bytes beats SageMaker's variable; whole MiB, at least 1, at most SageMaker's 100
    ({"SAGEMAKER_MAX_PAYLOAD_IN_MB": "6", "OPTION_MAX_REQUEST_BYTES": str(3 * 2**20 + 5)},
     {"MaxConcurrentTransforms": 32, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 3}),
    ({"SAGEMAKER_MAX_REQUEST_SIZE": "1000"}, {"MaxConcurrentTransforms": 32, "BatchStrategy": "MULTI_RECORD",
                                              "MaxPayloadInMB": 1}),
    ({"SAGEMAKER_MAX_PAYLOAD_IN_MB": "500"}, {"MaxConcurrentTransforms": 32, "BatchStrategy": "MULTI_RECORD",
                                              "MaxPayloadInMB": 100}),
    # dynamic batching: the batch size is what it takes at once
    ({"OPTION_ROLLING_BATCH": "disable", "OPTION_BATCH_SIZE": "4", "OPTION_MAX_BATCH_DELAY": "10"},
     {"MaxConcurrentTransforms": 4, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 64}),
])
def test_answers_from_the_configuration(env, expected):
    assert parameters({"HF_MODEL_ID": "org/tiny", **env}) == expected


def test_several_models_the_one_invocations_serves(tmp_path):
    for name, rows in (("a-embed", 2), ("b-gen", 6)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "serving.properties").write_text(
            f"option.model_id=org/{name}\noption.max_rolling_batch_size={rows}\n"
            + ("option.task=text-embedding\n" if name == "a-embed" else "option.task=text-generation\n"))
    assert parameters({}, model_store=tmp_path)["MaxConcurrentTransforms"] == 6


def test_no_model_at_all():
    app = create_app(build_server_config({"HF_MODEL_ID": "org/tiny"}), ModelRegistry([]))
    assert app.test_client().get("/execution-parameters").get_json()["MaxConcurrentTransforms"] == 1
