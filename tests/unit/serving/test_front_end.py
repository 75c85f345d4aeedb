"""serving/front_end.py: the built-in text handler's requests are answered by the front end a dialect
builds, installed by the composition root (the server, or this test suite's conftest)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmi_serve.serving import front_end


def text_model(**fields) -> front_end.TextModel:
    return front_end.TextModel(config=None, tokenizer=None, max_input_len=9, max_model_len=10,
                               eos_token_ids=frozenset({2}), engine=None, generate=lambda requests: iter(()),
                               **fields)


def test_the_installed_builder_gets_what_the_handler_loaded(monkeypatch):
    built = []
    monkeypatch.setattr(front_end, "_builder", None)
    front_end.install(lambda model: built.append(model) or "the front end")
    model = text_model()
    assert front_end.build_front_end(model) == "the front end" and built == [model]


def test_a_process_without_one_installed_fails_the_load_saying_how_to_fix_it(monkeypatch):
    monkeypatch.setattr(front_end, "_builder", None)
    with pytest.raises(RuntimeError, match=r"server installs the LMI dialect's.*install it too"):
        front_end.build_front_end(text_model())


def test_the_server_installs_the_lmi_dialects_builder(monkeypatch):
    from lmi_serve.config.sources import ServerConfig
    from lmi_serve.dialects.lmi.front_end import lmi_front_end
    from lmi_serve.server.app import create_app

    monkeypatch.setattr(front_end, "_builder", None)
    config = ServerConfig.model_construct(max_request_size=100_000, request_id_header="x-request-id",
                                          triton_server_name="triton", models=())
    create_app(config, SimpleNamespace(services={}))
    assert front_end._builder is lmi_front_end
