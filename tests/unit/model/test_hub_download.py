"""Hub models downloaded in-process (model/hub.py) from a loopback Hub speaking the real HTTP API
(tests/fake_hub.py) with the real huggingface_hub client: what is fetched, from where, and each failure."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import huggingface_hub
import pytest

from fake_hub import FakeHub
from lmi_serve.config.sources import ModelConfig
from lmi_serve.model.hub import HubSettings, download_from_hub
from lmi_serve.model.source import ModelLoadError
from lmi_serve.server import logs
from lmi_serve.serving.service import ModelService, ModelStatus
from server_process import free_port
from tiny_hub_model import as_mistral, pickled_only, tiny_llama_files, with_extras

TOKEN = "hf_valid_0123456789"
SECRET = "hf_wrong_secret_4242"  # a token the Hub does not know: it must never be shown
ACCEPTED = "hf_accepted_conditions_77"  # an account that accepted the gated repo's conditions


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return tiny_llama_files()


@pytest.fixture
def hub(files):
    with FakeHub(tokens=(TOKEN, ACCEPTED)) as hub:
        hub.add("acme/tiny", {"main": with_extras(files), "v1": {**as_mistral(files), "NOTES.txt": b"v1 only"}})
        hub.add("acme/pickled", {"main": pickled_only(files)})
        hub.add("acme/private", {"main": files}, private=True)
        hub.add("acme/gated", {"main": files}, gated=(ACCEPTED,))
        yield hub


@pytest.fixture(autouse=True)
def online(monkeypatch):
    # tests/unit/conftest.py turns the Hub off for every unit test; these reach only the loopback Hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def fetch(hub_url: str, cache: Path, repo: str = "acme/tiny", *, token: str | None = None, **options) -> Path:
    options = {"revision": None, "allow_pickled": False, "gguf_file": None, "trust_remote_code": False,
               "progress_every": 10.0, **options}
    return download_from_hub(repo, hub=HubSettings(hub_url, cache, token), **options)


def test_downloads_only_the_files_the_model_needs_and_once(hub, files, tmp_path):
    folder = fetch(hub.url, tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # no README, ONNX, Flax, TF, training_args
    assert all((folder / name).read_bytes() == content for name, content in files.items())
    assert sorted(Path(p).name for p in hub.file_gets()) == sorted(files)
    downloads = len(hub.file_gets())
    assert fetch(hub.url, tmp_path) == folder
    assert len(hub.file_gets()) == downloads  # the second start downloads nothing


def test_the_pinned_revision_is_fetched(hub, tmp_path):
    folder = fetch(hub.url, tmp_path, revision="v1")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "mistral"
    assert (folder / "NOTES.txt").read_bytes() == b"v1 only"
    assert folder.name == hub.repos["acme/tiny"].commits["v1"]


def test_a_complete_cached_copy_is_served_when_the_hub_is_gone(hub, files, tmp_path):
    folder = fetch(hub.url, tmp_path, revision="v1")
    hub.stop()
    assert fetch(hub.url, tmp_path, revision="v1") == folder
    assert fetch(f"http://127.0.0.1:{free_port()}", tmp_path, revision="v1") == folder


def test_hf_hub_offline_serves_the_cache_and_refuses_what_is_not_there(hub, tmp_path, monkeypatch):
    folder = fetch(hub.url, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    requests_before = len(hub.requests)
    assert fetch(hub.url, tmp_path) == folder
    with pytest.raises(ModelLoadError, match=r"'acme/private'.*HF_HUB_OFFLINE=1"):
        fetch(hub.url, tmp_path, "acme/private")
    assert len(hub.requests) == requests_before  # offline means no request at all


def test_an_unreachable_hub_with_nothing_cached_names_the_model(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ModelLoadError, match=r"'acme/tiny'.*could not be reached \(ConnectError\)"):
        fetch(dead, tmp_path)


def test_a_wrong_token_is_a_clear_error_that_never_shows_the_token(hub, tmp_path, caplog):
    with pytest.raises(ModelLoadError) as refused:
        fetch(hub.url, tmp_path, token=SECRET)
    message = str(refused.value)
    assert "'acme/tiny'" in message and "401" in message and "HF_TOKEN" in message
    assert SECRET not in message and SECRET not in caplog.text


@pytest.mark.parametrize("token, status, who", [(None, 401, "HF_TOKEN is not set"),
                                                (TOKEN, 404, "HF_TOKEN has no access to it")])
def test_a_missing_repo_says_so_like_the_hub(hub, tmp_path, token, status, who):
    """The Hub answers 401 to an anonymous caller and 404 to an authenticated one (it will not say
    whether a private repo exists): either way the error names the id and the token's part."""
    with pytest.raises(ModelLoadError, match=rf"'acme/nope': no such repository .*\(HTTP {status}\).*{who}"):
        fetch(hub.url, tmp_path, "acme/nope", token=token)


def test_a_private_repo_needs_its_token(hub, files, tmp_path):
    with pytest.raises(ModelLoadError, match="'acme/private'.*HF_TOKEN is not set"):
        fetch(hub.url, tmp_path, "acme/private")
    assert (fetch(hub.url, tmp_path, "acme/private", token=TOKEN) / "model.safetensors").read_bytes() \
        == files["model.safetensors"]


@pytest.mark.parametrize("token, status", [(None, 401), (TOKEN, 403)])
def test_a_gated_repo_says_what_to_do(hub, tmp_path, token, status):
    with pytest.raises(ModelLoadError, match=rf"'acme/gated' is gated \(HTTP {status}\): accept its conditions"):
        fetch(hub.url, tmp_path, "acme/gated", token=token)
    assert (fetch(hub.url, tmp_path, "acme/gated", token=ACCEPTED) / "config.json").is_file()


def test_a_missing_revision_is_named(hub, tmp_path):
    with pytest.raises(ModelLoadError, match=r"'acme/tiny' at revision 'v9': no such revision \(HTTP 404"):
        fetch(hub.url, tmp_path, revision="v9")


def test_pickled_weights_are_refused_unless_allowed(hub, tmp_path):
    with pytest.raises(ModelLoadError, match=r"'acme/pickled' has only pickled weights \(pytorch_model.bin\).*"
                                             r"option.allow_pickled_weights=true"):
        fetch(hub.url, tmp_path, "acme/pickled")
    assert hub.file_gets() == []  # refused before any download
    folder = fetch(hub.url, tmp_path, "acme/pickled", allow_pickled=True)
    assert (folder / "pytorch_model.bin").is_file()


def test_a_connection_dropped_mid_file_is_resumed(hub, files, tmp_path):
    hub.break_once.add("model.safetensors")
    folder = fetch(hub.url, tmp_path)
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert sum(p.endswith("/model.safetensors") for p in hub.file_gets()) == 2  # cut, then resumed
    # huggingface_hub's "resuming" warning went through the server's handler alone (a JSON line in JSON mode)
    library = logging.getLogger("huggingface_hub")
    assert library.handlers == [] and library.propagate


def test_a_download_cut_for_good_never_leaves_a_model_that_loads(hub, files, tmp_path):
    cut = "model.safetensors"
    hub.break_once.add(cut)
    hub.stop_after_break = True  # the Hub goes away with the file half sent
    with pytest.raises(ModelLoadError, match="'acme/tiny'"):
        fetch(hub.url, tmp_path)
    # a restart without the Hub finds the snapshot incomplete and refuses it
    # (files sent alongside the cut one may be missing too: the Hub went away under all of them)
    with pytest.raises(ModelLoadError, match=r"'acme/tiny': the Hub could not be reached .* lacks \d+ of its files"):
        fetch(hub.url, tmp_path)
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / hub.repos["acme/tiny"].commits["main"]
    assert not (snapshot / cut).exists()


def test_progress_is_logged_as_lines_in_either_format(files, tmp_path, caplog):
    with FakeHub() as hub:
        hub.add("acme/slow", {"main": {"config.json": files["config.json"], "model.safetensors": b"\0" * 2**20}})
        hub.seconds_per_mib = 1.5
        with caplog.at_level(logging.INFO, logger="lmi_serve.model.download"):
            fetch(hub.url, tmp_path, "acme/slow", progress_every=0.25)
    lines = [r for r in caplog.records if r.name == "lmi_serve.model.download"]
    progress = [r.getMessage() for r in lines if " of 1.0 MiB (" in r.getMessage()]
    assert len(progress) >= 2, [r.getMessage() for r in lines]
    assert lines[0].getMessage().startswith("Downloading Hub model acme/slow (commit ")
    assert lines[-1].getMessage().startswith("Downloaded Hub model acme/slow")
    as_json = json.loads(logs.formatter("json").format(lines[1]))
    assert as_json["logger"] == "lmi_serve.model.download" and "MiB" in as_json["message"]


def test_the_service_hands_its_handler_the_downloaded_folder_and_keeps_the_id(hub, tmp_path, monkeypatch):
    """What a handler (and a tensor-parallel follower, given the handler's config) loads is the local
    copy; /models still shows the configured id."""
    # the settings a server reads from HF_ENDPOINT / HF_HOME (read once, at import, by huggingface_hub)
    settings = HubSettings(hub.url, tmp_path / "hub", None)
    monkeypatch.setattr(HubSettings, "from_environment", classmethod(lambda cls: settings))
    (tmp_path / "model.py").write_text("SEEN = []\n"
                                       "def handle(inputs):\n"
                                       "    SEEN.append(inputs.get_properties()['model_id'])\n")
    config = ModelConfig(name="m", model_dir=str(tmp_path), model_id="acme/tiny", revision="v1",
                         task="text-generation", rolling_batch="disable")
    service = ModelService(config, str(tmp_path / "lmi"))
    service.load()
    assert service.current_status() is ModelStatus.READY, service.error
    (seen,) = service.capabilities.handle.__globals__["SEEN"]
    assert Path(seen).is_dir() and Path(seen).name == hub.repos["acme/tiny"].commits["v1"]
    assert service.model_source == seen and service.config.model_id == "acme/tiny"
