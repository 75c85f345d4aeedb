"""option.cpu_threads: a server-wide option (the CPU budget's, lmi_serve/cpu_budget.py), validated with
the configuration and named by the key the user wrote."""

from __future__ import annotations

import pytest

from lmi_serve.config.sources import ConfigError, build_server_config


def test_cpu_threads_is_read_from_the_models_options_else_the_environment(tmp_path):
    (tmp_path / "serving.properties").write_text("option.model_id=org/m\noption.cpu_threads=6\n")
    config = build_server_config({}, model_dir=tmp_path)
    assert config.cpu_threads == 6
    assert config.models[0].unknown_options == ()  # an lmi-serve option, not a handler's
    assert build_server_config({"HF_MODEL_ID": "org/m", "OPTION_CPU_THREADS": "2"}).cpu_threads == 2
    assert build_server_config({"HF_MODEL_ID": "org/m", "LMI_SERVE_CPU_THREADS": "3"}).cpu_threads == 3
    # a multi-model endpoint starts with no model to carry it
    assert build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "OPTION_CPU_THREADS": "4"}).cpu_threads == 4
    assert build_server_config({"HF_MODEL_ID": "org/m"}).cpu_threads is None  # unset: the machine decides
    assert "cpu_threads = 2" in build_server_config({"HF_MODEL_ID": "org/m", "OPTION_CPU_THREADS": "2"}).describe()


@pytest.mark.parametrize(("env", "message"), [
    ({"OPTION_CPU_THREADS": "0"}, "option.cpu_threads: '0' must be >= 1"),
    ({"OPTION_CPU_THREADS": "many"}, "option.cpu_threads: 'many' is not an integer"),
    ({"LMI_SERVE_CPU_THREADS": "2.5"}, "LMI_SERVE_CPU_THREADS: '2.5' is not an integer"),
])
def test_a_bad_cpu_threads_fails_at_start_naming_its_key(env, message):
    with pytest.raises(ConfigError, match=message):
        build_server_config({"HF_MODEL_ID": "org/m", **env})
