"""engine/adapters.check_source: which folders the adapters API may make the server read."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmi_serve.engine.adapters import SourceRefused, check_source, model_adapters_folder
from lmi_serve.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError


def adapter_folder(parent: Path, name: str, weights: str = ADAPTER_WEIGHTS) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    (folder / ADAPTER_CONFIG).write_text("{}")
    (folder / weights).write_bytes(b"")
    return folder


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    return {"root": root, "inside": adapter_folder(root, "a1"), "outside": adapter_folder(outside, "evil")}


def test_a_folder_inside_the_root_is_read_from_its_resolved_path(tree) -> None:
    assert check_source(str(tree["inside"]), tree["root"]) == tree["inside"].resolve()
    assert check_source("a1", tree["root"]) == tree["inside"].resolve()  # relative: inside the root
    assert check_source("a1/../a1", tree["root"]) == tree["inside"].resolve()  # '..' that stays inside


@pytest.mark.parametrize("src", ["../outside/evil", "a1/../../outside/evil", "/etc", "/"])
def test_traversal_and_absolute_paths_out_of_the_root_are_refused(tree, src: str) -> None:
    with pytest.raises(SourceRefused, match="outside the adapters root"):
        check_source(src, tree["root"])


def test_an_absolute_path_outside_is_refused(tree) -> None:
    with pytest.raises(SourceRefused, match="outside the adapters root"):
        check_source(str(tree["outside"]), tree["root"])


def test_a_symlink_out_of_the_root_is_refused(tree) -> None:
    (tree["root"] / "link").symlink_to(tree["outside"], target_is_directory=True)
    with pytest.raises(SourceRefused, match="outside the adapters root"):
        check_source("link", tree["root"])


def test_a_weights_file_linked_out_of_the_root_is_refused(tree) -> None:
    folder = tree["root"] / "sneaky"
    folder.mkdir()
    (folder / ADAPTER_CONFIG).write_text("{}")
    (folder / ADAPTER_WEIGHTS).symlink_to(tree["outside"] / ADAPTER_WEIGHTS)
    with pytest.raises(SourceRefused, match=f"{ADAPTER_WEIGHTS} is a link to"):
        check_source("sneaky", tree["root"])


def test_a_root_that_is_itself_a_symlink_still_confines(tree, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(tree["root"], target_is_directory=True)
    assert check_source(str(alias / "a1"), alias) == tree["inside"].resolve()
    with pytest.raises(SourceRefused):
        check_source(str(tree["outside"]), alias)


def test_pickled_weights_are_never_read(tree) -> None:
    adapter_folder(tree["root"], "pickled", weights="adapter_model.bin")
    with pytest.raises(AdapterError, match="pickled weights") as caught:
        check_source("pickled", tree["root"])
    assert not isinstance(caught.value, SourceRefused)  # a 400, not a 403: the folder may be read, not used


def test_no_root_no_registration_and_missing_folders(tree) -> None:
    with pytest.raises(SourceRefused, match="option.adapters_root"):
        check_source(str(tree["inside"]), None)
    with pytest.raises(AdapterError, match="is not a folder"):
        check_source("missing", tree["root"])


def test_the_default_root_is_the_models_adapters_folder(tmp_path: Path) -> None:
    assert model_adapters_folder(str(tmp_path), None) == tmp_path / "adapters"
    assert model_adapters_folder(None, str(tmp_path)) == tmp_path / "adapters"  # a local model_id folder
    assert model_adapters_folder(None, "org/hub-model") is None


def test_paths_that_cannot_be_resolved_are_a_clear_400(tree) -> None:
    (tree["root"] / "loop").symlink_to(tree["root"] / "loop")
    for src in ("loop", "x" * 5000, "a1/" + "y" * 300, "bad\x00name"):
        with pytest.raises(AdapterError) as caught:
            check_source(src, tree["root"])
        assert not isinstance(caught.value, SourceRefused), src
