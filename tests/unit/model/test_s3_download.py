"""s3:// models copied in-process (model/s3.py) from moto's S3 server on loopback with the real boto3
client: what is copied, where, the restart rule, and each failure never leaving a loadable copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from fake_s3 import CREDENTIALS, CuttingRelay, moto_s3, upload
from lmi_serve.model.remote_files import parse_s3_url
from lmi_serve.model.s3 import copy_folder, download_from_s3
from lmi_serve.model.source import ModelLoadError
from server_process import free_port
from tiny_hub_model import pickled_only, tiny_llama_files, with_extras

MODEL = "s3://models/tiny/v1"


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return tiny_llama_files()


@pytest.fixture(scope="module")
def s3(files):
    with moto_s3() as endpoint:
        upload(endpoint, "models", "tiny/v1", with_extras(files))
        upload(endpoint, "models", "pickled", pickled_only(files))
        yield endpoint


@pytest.fixture(autouse=True)
def aws(s3, monkeypatch):
    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": s3, "AWS_MAX_ATTEMPTS": "2"}.items():
        monkeypatch.setenv(name, value)


def fetch(cache: Path, url: str = MODEL, **options) -> Path:
    options = {"allow_pickled": False, "gguf_file": None, "trust_remote_code": False, "progress_every": 10.0,
               **options}
    return download_from_s3(parse_s3_url(url), cache_dir=str(cache), **options)


def test_the_files_the_model_needs_are_copied_then_renamed_into_place(files, tmp_path):
    folder = fetch(tmp_path)
    assert folder == copy_folder(str(tmp_path), parse_s3_url(MODEL))
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # no README, ONNX, Flax, TF, training_args
    assert all((folder / name).read_bytes() == content for name, content in files.items())
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left


def test_a_restart_serves_the_complete_copy_without_contacting_s3(tmp_path, monkeypatch):
    folder = fetch(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # S3 unreachable now
    assert fetch(tmp_path) == folder


@pytest.mark.parametrize("url, message", [
    ("s3://models/tiny/v2", r"s3://models/tiny/v2: no objects under this prefix"),
    ("s3://no-such-bucket/tiny", r"s3://no-such-bucket/tiny: no such bucket 'no-such-bucket'"),
    ("s3://models/pickled", r"s3://models/pickled has only pickled weights \(pytorch_model.bin\).*allow_pickled"),
])
def test_what_cannot_be_served_is_named(tmp_path, url, message):
    with pytest.raises(ModelLoadError, match=message):
        fetch(tmp_path, url)
    assert not (tmp_path / "s3").exists() or not any((tmp_path / "s3").rglob("*.safetensors"))


def test_pickled_weights_when_allowed(tmp_path):
    assert (fetch(tmp_path, "s3://models/pickled", allow_pickled=True) / "pytorch_model.bin").is_file()


def test_an_unreachable_endpoint_is_named(tmp_path, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    with pytest.raises(ModelLoadError, match=rf"{MODEL}: S3 at {dead} could not be reached"):
        fetch(tmp_path)


def test_credentials_s3_refuses_are_access_denied(s3, tmp_path, monkeypatch):
    requests.post(f"{s3}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()  # moto checks keys now
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
        with pytest.raises(ModelLoadError, match=rf"{MODEL}: access denied \(InvalidAccessKeyId\)"):
            fetch(tmp_path)
    finally:
        requests.post(f"{s3}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()


def test_a_copy_cut_mid_transfer_is_never_loaded(s3, files, tmp_path, monkeypatch):
    relay = CuttingRelay(s3, cut_after=2**20)  # listings pass; the 13 MB weights never arrive whole
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)
    try:
        with pytest.raises(ModelLoadError, match=rf"{MODEL}: the connection to S3 .* kept breaking"):
            fetch(tmp_path)
    finally:
        relay.close()
    assert relay.cuts > 0
    assert not copy_folder(str(tmp_path), parse_s3_url(MODEL)).exists()  # nothing a restart would load
    assert not any(tmp_path.rglob("*.partial"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3)
    assert (fetch(tmp_path) / "model.safetensors").read_bytes() == files["model.safetensors"]
