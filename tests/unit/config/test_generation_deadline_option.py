"""option.generation_deadline: where SageMaker's environment sets its default (config/sagemaker.py), and how
a user's value wins or switches it off (tests/unit/server/test_deadline_records.py: what records a cut)."""

from __future__ import annotations

import pytest
from lmi_serve.config import sagemaker
from lmi_serve.config.sagemaker import REALTIME_DEADLINE, Hosting, hosting
from lmi_serve.config.sources import ConfigError, load_model_config

MODEL = {"HF_MODEL_ID": "org/model"}


@pytest.fixture
def endpoint_file(tmp_path, monkeypatch):
    """Where this test's endpoint metadata would be: absent until the test writes it."""
    path = tmp_path / "endpoint-metadata.json"
    monkeypatch.setattr(sagemaker, "ENDPOINT_METADATA", path)
    return path


@pytest.mark.parametrize("env, where", [
    ({}, Hosting.ELSEWHERE),
    ({"SAGEMAKER_MULTI_MODEL": "true"}, Hosting.ENDPOINT),  # multi-model endpoints are real-time only
    ({"SAGEMAKER_MULTI_MODEL": "false"}, Hosting.ELSEWHERE),
    ({"SAGEMAKER_BIND_TO_PORT": "8081"}, Hosting.ENDPOINT),  # a multi-container endpoint
    ({"SAGEMAKER_SAFE_PORT_RANGE": "9000-9100"}, Hosting.ENDPOINT),
    ({"SAGEMAKER_BATCH": "true"}, Hosting.BATCH_TRANSFORM),
    ({"SAGEMAKER_BATCH": "true", "SAGEMAKER_BIND_TO_PORT": "8081"}, Hosting.BATCH_TRANSFORM),  # a batch pipeline
    ({"SAGEMAKER_BATCH": "false"}, Hosting.ELSEWHERE),
])
def test_hosting_from_the_variables(endpoint_file, env, where):
    assert hosting(env) is where


def test_an_endpoint_instance_is_told_by_its_metadata_file_unless_batch_transform_runs(endpoint_file):
    endpoint_file.write_text("{}")
    assert hosting({}) is Hosting.ENDPOINT
    assert hosting({"SAGEMAKER_BATCH": "true"}) is Hosting.BATCH_TRANSFORM


def test_default_is_55_seconds_on_an_endpoint_and_off_elsewhere(endpoint_file):
    assert load_model_config(None, MODEL).generation_deadline is None
    assert load_model_config(None, {**MODEL, "SAGEMAKER_BATCH": "true"}).generation_deadline is None
    endpoint_file.write_text("{}")
    assert load_model_config(None, MODEL).generation_deadline == REALTIME_DEADLINE == 55
    assert load_model_config(None, {**MODEL, "SAGEMAKER_BATCH": "true"}).generation_deadline is None


@pytest.mark.parametrize("value, seconds", [("off", None), ("OFF", None), ("none", None), ("0", None),
                                            ("2.5", 2.5), ("120", 120.0)])
def test_a_set_value_wins_even_on_an_endpoint(endpoint_file, value, seconds):
    endpoint_file.write_text("{}")  # an asynchronous endpoint looks like this: it sets `off`
    assert load_model_config(None, {**MODEL, "OPTION_GENERATION_DEADLINE": value}).generation_deadline == seconds


def test_serving_properties_beat_the_environment(endpoint_file, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "serving.properties").write_text("option.model_id=org/model\noption.generation_deadline=off\n")
    endpoint_file.write_text("{}")
    assert load_model_config(folder, {"OPTION_GENERATION_DEADLINE": "9"}).generation_deadline is None


@pytest.mark.parametrize("value, message", [("-1", "must be > 0"), ("soon", "is not a number")])
def test_a_bad_value_names_the_variable(endpoint_file, value, message):
    with pytest.raises(ConfigError, match=f"^OPTION_GENERATION_DEADLINE: .*{message}"):
        load_model_config(None, {**MODEL, "OPTION_GENERATION_DEADLINE": value})
