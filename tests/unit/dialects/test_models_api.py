"""The model-management routes' shapes without a model (serving/multi_model.py's loader refuses before
loading anything): SageMaker's multi-model JSON, DJL's register query, pages, and who may call them."""

from __future__ import annotations

import pytest

from lmi_serve.config.sources import ConfigError, build_server_config
from lmi_serve.server.app import create_app
from lmi_serve.serving.registry import ModelRegistry


def app(**env: str):
    return create_app(build_server_config(env), ModelRegistry([])).test_client()


def mme(tmp_path, **env: str):
    return app(SAGEMAKER_MULTI_MODEL="true", OPTION_MODEL_URL_ROOT=str(tmp_path), **env)


def test_a_multi_model_endpoint_starts_with_no_model_and_one_worker():
    config = build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "OPTION_MME_MEMORY_LIMIT": "3GiB"})
    assert (config.multi_model, config.models, config.mme_memory_limit) == (True, (), 3 * 2**30)
    with pytest.raises(ConfigError, match="SAGEMAKER_NUM_MODEL_WORKERS: a multi-model endpoint .* single worker"):
        build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "SAGEMAKER_NUM_MODEL_WORKERS": "2"})
    with pytest.raises(ConfigError, match="OPTION_MME_MEMORY_LIMIT: 'plenty' is not a size"):
        build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "OPTION_MME_MEMORY_LIMIT": "plenty"})
    with pytest.raises(ConfigError, match="SAGEMAKER_MULTI_MODEL: 'maybe' is not true or false"):
        build_server_config({"SAGEMAKER_MULTI_MODEL": "maybe"})
    # the server-wide options are no model's unknown options
    (model,) = build_server_config({"HF_MODEL_ID": "org/m", "OPTION_MME_MEMORY_LIMIT": "1GiB"}).models
    assert model.unknown_options == ()


def test_sagemakers_load_body_is_checked_field_by_field(tmp_path):
    client = mme(tmp_path)
    cases = [({"model_name": "m"}, "url is required"), ({"url": str(tmp_path)}, "model_name is required"),
             ({"model_name": "m", "url": str(tmp_path), "gpus": 1}, "Unsupported field(s) ['gpus']"),
             ({"model_name": "a/b", "url": str(tmp_path)}, "must be letters"),
             ({"model_name": "m", "url": "s3://b/m"}, "local folder"),
             ({"model_name": "m", "url": str(tmp_path / "absent")}, "is not a folder"), ([1], "JSON object")]
    for body, message in cases:
        answer = client.post("/models", json=body)
        assert answer.status_code == 400 and message in answer.get_json()["message"], (body, answer.get_json())
        assert answer.get_json()["type"] == "BadRequestException"
    outside = client.post("/models", json={"model_name": "m", "url": "/etc"})
    assert outside.status_code == 403 and "outside the models root" in outside.get_json()["message"]
    assert client.post("/models", data=b"{not json").status_code == 400
    djl = client.post(f"/models?url={tmp_path}")
    assert djl.status_code == 400 and "SageMaker's JSON body" in djl.get_json()["message"]


def test_unknown_models_are_404_in_lmis_shape(tmp_path):
    client = mme(tmp_path)
    for answer in (client.delete("/models/nope"), client.get("/models/nope"), client.post("/models/nope/invoke")):
        assert answer.status_code == 404 and answer.get_json()["type"] == "ModelNotFoundException"
    assert client.get("/models").get_json() == {"models": []}
    assert client.get("/ping").status_code == 200  # healthy with no model


def test_page_arguments_are_checked(tmp_path):
    client = mme(tmp_path)
    for query in ("limit=0", "limit=x", "next_page_token=-1", "limit=1001"):
        assert client.get(f"/models?{query}").status_code == 400, query


def test_djls_register_api_is_a_management_route_with_the_same_checks(tmp_path):
    off = app(HF_MODEL_ID="org/m")
    assert off.post(f"/models?url={tmp_path}").status_code == 403  # the management API is off
    assert off.delete("/models/m").status_code == 403
    on = app(HF_MODEL_ID="org/m", OPTION_ENABLE_MANAGEMENT_API="true", OPTION_MODEL_URL_ROOT=str(tmp_path))
    assert on.post("/models?url=/etc&model_name=x").status_code == 403  # outside the root
    unknown = on.post(f"/models?url={tmp_path}&engine=Python")
    assert unknown.status_code == 400 and "serving.properties" in unknown.get_json()["message"]
    assert on.post(f"/models?url={tmp_path}&synchronous=false").status_code == 400
    assert on.delete("/models/m").status_code == 404  # allowed, and m is not served by this empty registry
