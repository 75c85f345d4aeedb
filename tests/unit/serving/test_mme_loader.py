"""serving/multi_model.py's ModelLoader without a real model: a second load of a name still loading is a
409 (not a second copy), a load that fails is the request's 400 and gives its budget back, and an unload
takes the name out of the registry before the model stops. The services are stand-ins whose load waits
on an event, so the race is forced rather than hoped for."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from lmi_serve.config.sources import build_server_config
from lmi_serve.errors import AlreadyExists, InvalidRequest, NotFound
from lmi_serve.serving.multi_model import ModelLoader
from lmi_serve.serving.registry import ModelRegistry
from lmi_serve.serving.service import ModelStatus


class StandIn:
    """A ModelService's surface as the loader uses it; `load` blocks until `release` is set."""

    def __init__(self, config, release: threading.Event, fails: bool, registry: ModelRegistry):
        self.name, self.config, self.release, self.fails, self.registry = config.name, config, release, fails, registry
        self.error, self.unloaded_while_listed, self.started = None, None, threading.Event()

    def load(self):
        self.started.set()
        assert self.release.wait(30)
        self.error = "no weights here" if self.fails else None

    def current_status(self):
        return ModelStatus.FAILED if self.fails else ModelStatus.READY

    def unload(self, grace):
        self.unloaded_while_listed = self.name in self.registry.services


@pytest.fixture
def loader(tmp_path):
    for name in ("a", "bad"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
             "num_attention_heads": 2, "hidden_size": 16}))
    registry, release, made = ModelRegistry([]), threading.Event(), []

    def make_service(config):
        made.append(StandIn(config, release, fails=config.name == "bad", registry=registry))
        return made[-1]

    config = build_server_config({"SAGEMAKER_MULTI_MODEL": "true", "OPTION_MODEL_URL_ROOT": str(tmp_path),
                                  "OPTION_MME_MEMORY_LIMIT": "1GiB"})
    return SimpleNamespace(loader=ModelLoader(registry, config, make_service, env={}), registry=registry,
                           release=release, made=made, root=tmp_path)


def test_a_second_load_of_a_name_still_loading_is_refused(loader):
    first = threading.Thread(target=loader.loader.load, args=("a", str(loader.root / "a")))
    first.start()
    for _ in range(3000):  # until the first has made its service
        if loader.made:
            break
        threading.Event().wait(0.01)
    assert loader.made and loader.made[0].started.wait(30)  # the first is inside service.load()
    with pytest.raises(AlreadyExists, match="Model a is already loaded"):
        loader.loader.load("a", str(loader.root / "a"))
    loader.release.set()
    first.join(30)
    assert list(loader.registry.services) == ["a"] and len(loader.made) == 1  # one copy, served
    with pytest.raises(AlreadyExists):
        loader.loader.load("a", str(loader.root / "a"))


def test_a_failed_load_is_the_requests_error_and_keeps_nothing(loader):
    loader.release.set()
    with pytest.raises(InvalidRequest, match="Model bad failed to load from .*: no weights here"):
        loader.loader.load("bad", str(loader.root / "bad"))
    assert "bad" not in loader.registry.services
    assert loader.loader.budget.in_use == 0  # its reservation was given back
    loader.loader.load("a", str(loader.root / "a"))  # the loader still works
    assert "a" in loader.registry.services


def test_unload_delists_before_stopping_and_then_is_404(loader):
    loader.release.set()
    loader.loader.load("a", str(loader.root / "a"))
    loader.loader.unload("a", grace=0)
    assert loader.made[0].unloaded_while_listed is False  # new requests could no longer reach it
    assert "a" not in loader.registry.services and loader.loader.budget.in_use == 0
    with pytest.raises(NotFound):
        loader.loader.unload("a", grace=0)


def test_a_loaded_models_row_kernel_copies_count_against_the_limit(loader, monkeypatch):
    """What the estimate before loading cannot know (the copies depend on the host) is held once they exist."""
    from lmi_serve.kernels.footprint import WeightFootprint
    from lmi_serve.serving.multi_model import estimate

    loader.release.set()
    service = loader.loader.load("a", str(loader.root / "a"))
    before = loader.loader.budget.held("a")
    assert before == estimate(service.config) > 0  # a stand-in without a kernel plan: the estimate alone
    loader.loader.unload("a", 0)
    original = StandIn.load

    def planned(self):  # the handler's kernel plan made 3 MiB of row-kernel copies
        original(self)
        self.kernels = SimpleNamespace(memory=WeightFootprint(weights=1, row_copies=3 * 2**20))

    monkeypatch.setattr(StandIn, "load", planned)
    loader.loader.load("a", str(loader.root / "a"))
    assert loader.loader.budget.held("a") == before + 3 * 2**20

