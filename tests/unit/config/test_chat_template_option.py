"""option.chat_template's rule (config/chat_template.py): a value with `{`, `}` or a line break is the
template itself, any other names a file, looked up in the model folder and then the working directory;
a file that is not there fails the configuration, naming the key the user wrote and where it looked."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmi_serve.config.chat_template import is_inline, text_of
from lmi_serve.config.sources import ConfigError, ServerConfig, load_model_config

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


@pytest.mark.parametrize("value, inline", [
    ("{{ messages[0].content }}", True), ("{% for m in messages %}x{% endfor %}", True), ("line one\nline two", True),
    ("template.jinja", False), ("templates/chatml.j2", False), ("/etc/lmi/chat.txt", False), ("chatml", False)])
def test_braces_or_a_line_break_make_a_value_the_template_itself(value, inline):
    assert is_inline(value) is inline


def test_an_inline_template_is_kept_as_written(folder):
    config = load_model_config(folder, {"OPTION_CHAT_TEMPLATE": TEMPLATE})
    assert config.chat_template == TEMPLATE and text_of(config.chat_template) == TEMPLATE


def test_a_file_in_the_model_folder_is_kept_as_its_absolute_path(folder, tmp_path, monkeypatch):
    (folder / "chat.jinja").write_text(TEMPLATE)
    monkeypatch.chdir(tmp_path)  # not where the file is: the model folder is looked in first
    (folder / "serving.properties").write_text("option.chat_template=chat.jinja\n")
    config = load_model_config(folder, {})
    assert config.chat_template == str(folder / "chat.jinja") and text_of(config.chat_template) == TEMPLATE


def test_a_relative_file_outside_the_model_folder_is_found_in_the_working_directory(folder, tmp_path, monkeypatch):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.j2").write_text(TEMPLATE)
    monkeypatch.chdir(tmp_path)
    config = load_model_config(folder, {"OPTION_CHAT_TEMPLATE": "templates/chat.j2"})
    assert config.chat_template == str(tmp_path / "templates" / "chat.j2")


def test_an_absolute_path_is_read_as_given(folder, tmp_path):
    (tmp_path / "chat.txt").write_text(TEMPLATE)
    config = load_model_config(folder, {"OPTION_CHAT_TEMPLATE": str(tmp_path / "chat.txt")})
    assert text_of(config.chat_template) == TEMPLATE


@pytest.mark.parametrize("source, key", [("env", "OPTION_CHAT_TEMPLATE"), ("file", "option.chat_template")])
def test_a_file_that_is_not_there_fails_at_start_up_naming_the_key_and_where_it_looked(
        folder, tmp_path, monkeypatch, source, key):
    monkeypatch.chdir(tmp_path)
    env = {"OPTION_CHAT_TEMPLATE": "chatml.jinja"} if source == "env" else {}
    if source == "file":
        (folder / "serving.properties").write_text("option.chat_template=chatml.jinja\n")
    with pytest.raises(ConfigError) as caught:
        load_model_config(folder, env)
    message = str(caught.value)
    assert message.startswith(f"{key}: 'chatml.jinja' names no file") and "\n" not in message
    assert str(folder / "chatml.jinja") in message and str(tmp_path / "chatml.jinja") in message
    assert "{{" in message  # says how to give a template inline instead


def test_a_folder_is_not_a_template_file(folder):
    (folder / "templates").mkdir()
    with pytest.raises(ConfigError, match="names no file"):
        load_model_config(folder, {"OPTION_CHAT_TEMPLATE": "templates"})


def test_the_resolved_path_survives_the_trip_to_the_workers(folder):
    (folder / "chat.jinja").write_text(TEMPLATE)
    config = ServerConfig(models=(load_model_config(folder, {"OPTION_CHAT_TEMPLATE": "chat.jinja"}),))
    assert ServerConfig.from_json(config.to_json()).models[0].chat_template == str(folder / "chat.jinja")


def test_trust_request_chat_template_is_off_unless_set(folder):
    assert load_model_config(folder, {}).trust_request_chat_template is False
    assert load_model_config(folder, {"OPTION_TRUST_REQUEST_CHAT_TEMPLATE": "true"}).trust_request_chat_template
    with pytest.raises(ConfigError, match="OPTION_TRUST_REQUEST_CHAT_TEMPLATE: 'maybe' is not a boolean"):
        load_model_config(folder, {"OPTION_TRUST_REQUEST_CHAT_TEMPLATE": "maybe"})


@pytest.mark.parametrize("option", ["chat_template=" + "{{ x }}", "trust_request_chat_template=true"])
def test_an_embedding_model_refuses_the_chat_template_options(folder, option):
    (folder / "serving.properties").write_text(f"option.task=text-embedding\noption.{option}\n")
    with pytest.raises(ConfigError, match=rf"option\.{option.split('=')[0]}: not available for embedding models"):
        load_model_config(folder, {})
