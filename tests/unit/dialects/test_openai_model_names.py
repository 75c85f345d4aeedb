"""Which served model an OpenAI request's `model` field selects (`routes.choose_service`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lmi_serve.config.sources import build_server_config
from lmi_serve.dialects.openai.routes import choose_service
from lmi_serve.errors import InvalidRequest, NotFound, NotReady

GEN, EMB = "text-generation", "text-embedding"


@dataclass
class FakeService:
    name: str
    task: str

    @property
    def generates_text(self) -> bool:
        return self.task in ("text-generation", "text2text-generation")

    def require_ready(self) -> None:
        raise NotReady(f"Model {self.name} is loading")  # a fake has no engine: stop here, past the name


def served(*pairs: tuple[str, str]) -> dict[str, FakeService]:
    return {name: FakeService(name, task) for name, task in pairs}


DEFAULTS = served(("smollm2", GEN), ("minilm", EMB), ("simple", "tensor"))


def test_a_served_name_selects_its_model():
    two = served(("a", GEN), ("b", GEN))
    assert choose_service(two, "b", GEN, strict=False).name == "b"
    assert choose_service(two, "b", GEN, strict=True).name == "b"


def test_no_name_selects_the_first_model_of_the_task():
    assert choose_service(DEFAULTS, None, GEN, strict=True).name == "smollm2"
    assert choose_service(DEFAULTS, None, EMB, strict=True).name == "minilm"


@pytest.mark.parametrize("name", ["dummy", "tgi", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_an_unknown_name_selects_the_only_text_generation_model(name):
    # huggingface_hub's InferenceClient(base_url=...) sends "dummy"; TGI reads no name
    assert choose_service(DEFAULTS, name, GEN, strict=False).name == "smollm2"


def test_an_unknown_name_with_several_generation_models_is_a_404_listing_them():
    two = served(("a", GEN), ("b", "text2text-generation"), ("e", EMB))
    with pytest.raises(NotFound) as info:
        choose_service(two, "dummy", GEN, strict=False)
    assert "`dummy` does not exist" in info.value.message
    assert "`a`" in info.value.message and "`b`" in info.value.message and "`e`" not in info.value.message
    assert info.value.param == "model"


def test_strict_names_keep_the_404():
    with pytest.raises(NotFound) as info:
        choose_service(DEFAULTS, "dummy", GEN, strict=True)
    assert "`smollm2`" in info.value.message


def test_embeddings_keep_strict_names():
    with pytest.raises(NotFound):
        choose_service(DEFAULTS, "dummy", EMB, strict=False)


def test_a_name_of_another_task_is_refused():
    with pytest.raises(InvalidRequest) as info:
        choose_service(DEFAULTS, "minilm", GEN, strict=False)
    assert "serves text-embedding" in info.value.message


def test_strict_model_names_comes_from_env():
    assert build_server_config({"HF_MODEL_ID": "x"}).strict_model_names is False
    assert build_server_config({"HF_MODEL_ID": "x", "LMI_SERVE_STRICT_MODEL_NAMES": "true"}).strict_model_names is True


class FakeRegistry:
    def __init__(self, services):
        self.services = services


def chat_status(strict: bool) -> tuple[int, dict]:
    from lmi_serve.server.app import create_app
    from lmi_serve.config.sources import ServerConfig

    config = ServerConfig.model_construct(max_request_size=10_000, request_id_header="x-request-id",
                                          triton_server_name="triton", strict_model_names=strict, models=())
    client = create_app(config, FakeRegistry(served(("smollm2", GEN), ("minilm", EMB)))).test_client()
    response = client.post("/v1/chat/completions", json={"model": "dummy", "messages": [{"role": "user", "content": "x"}]})
    return response.status_code, response.get_json()


def test_the_app_passes_the_strict_option_to_the_routes():
    status, body = chat_status(strict=True)
    assert status == 404 and body["error"]["code"] == "model_not_found" and "`smollm2`" in body["error"]["message"]
    status, body = chat_status(strict=False)
    assert status == 503 and "smollm2 is loading" in body["error"]["message"]  # `dummy` selected smollm2
