"""option.otlp_traces_endpoint / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: the server-wide switch of tracing
(server/tracing.py), validated at start and named by the key the user wrote."""

from __future__ import annotations

import pytest

from lmi_serve.config.sources import ConfigError, build_server_config

URL = "http://collector:4318/v1/traces"


def test_the_endpoint_comes_from_the_option_else_opentelemetrys_variable(tmp_path):
    (tmp_path / "serving.properties").write_text(f"option.model_id=org/m\noption.otlp_traces_endpoint={URL}\n")
    config = build_server_config({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:4318/v1/traces"},
                                 model_dir=tmp_path)
    assert config.otlp_traces_endpoint == URL  # our option beats OpenTelemetry's variable
    assert config.models[0].unknown_options == ()  # an lmi-serve option, not a handler's
    model = {"HF_MODEL_ID": "org/m"}
    assert build_server_config({**model, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL}).otlp_traces_endpoint == URL
    assert build_server_config({**model, "LMI_SERVE_OTLP_TRACES_ENDPOINT": URL}).otlp_traces_endpoint == URL
    assert build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "OPTION_OTLP_TRACES_ENDPOINT": URL}
                               ).otlp_traces_endpoint == URL  # a multi-model endpoint may start with no model
    assert build_server_config(model).otlp_traces_endpoint is None  # unset: no tracing
    assert f"otlp_traces_endpoint = {URL}" in build_server_config({**model, "OPTION_OTLP_TRACES_ENDPOINT": URL}
                                                                  ).describe()


@pytest.mark.parametrize(("env", "message"), [
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4318"},
     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'collector:4318' is not an http\\(s\\) URL"),
    ({"OPTION_OTLP_TRACES_ENDPOINT": "grpc://collector:4317"}, "option.otlp_traces_endpoint: 'grpc://collector:4317'"),
    ({"LMI_SERVE_OTLP_TRACES_ENDPOINT": "http:///v1/traces"}, "LMI_SERVE_OTLP_TRACES_ENDPOINT: "),
])
def test_a_bad_endpoint_fails_at_start_naming_its_key(env, message):
    with pytest.raises(ConfigError, match=message):
        build_server_config({"HF_MODEL_ID": "org/m", **env})
