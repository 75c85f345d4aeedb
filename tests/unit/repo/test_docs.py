"""The docs/ site: it builds strictly (a warning fails), the strict build does catch a broken link, a
broken anchor and a page left out of the nav, and docs/configuration.md's option table is the one
lmi_serve.config.doc renders from the config models, every key and variable it lists working (and
docs/kernels.md's table the one lmi_serve.kernels.doc renders from kernels/registry.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from lmi_serve.config import doc as config_doc
from lmi_serve.kernels import doc as kernels_doc
from lmi_serve.config.models import ModelConfig
from lmi_serve.config.sources import load_model_config

ROOT = Path(__file__).resolve().parents[3]


def build(config_file: Path, site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
                           "--site-dir", str(site_dir)], capture_output=True, text=True, timeout=120)


def test_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
    assert (tmp_path / "site" / "repo" / "benchmarks" / "RESULTS" / "index.html").is_file()


def test_readme_links_reach_files_and_headings() -> None:
    """The site's build checks docs/; README's links into it are checked here, anchors by MkDocs' slugs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((?!https?:)([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert any(path.startswith("docs/") for path, _ in links)
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), path
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), flags=re.MULTILINE)
            assert anchor in {slugify(h, "-") for h in headings}, f"{path}#{anchor}"


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    """The files the site is built from, in a scratch tree that a test may break."""
    for path in ("mkdocs.yml", "docs", "benchmarks/README.md", "benchmarks/RESULTS.md", "benchmarks/journal",
                 "deploy/README.md"):
        source, target = ROOT / path, tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    return tmp_path


@pytest.mark.parametrize("page, addition, complaint", [
    ("lmi.md", "See [the moon](moon.md).", "'moon.md', but the target is not found"),
    ("lmi.md", "See [Errors](openai.md#no-such-heading).", "does not contain an anchor '#no-such-heading'"),
    ("deployment.md", "See [the bench](../benchmarks/bench.py).", "bench.py"),
])
def test_strict_build_fails_on_a_broken_link(docs_copy: Path, page: str, addition: str, complaint: str) -> None:
    with (docs_copy / "docs" / page).open("a") as out:
        out.write("\n" + addition + "\n")
    done = build(docs_copy / "mkdocs.yml", docs_copy / "site")
    assert done.returncode != 0
    assert complaint in done.stderr, done.stderr


def test_strict_build_fails_on_a_page_missing_from_the_nav(docs_copy: Path) -> None:
    (docs_copy / "docs" / "orphan.md").write_text("# Orphan\n")
    done = build(docs_copy / "mkdocs.yml", docs_copy / "site")
    assert done.returncode != 0
    assert "orphan.md" in done.stderr and "not included in the \"nav\"" in done.stderr, done.stderr


def test_configuration_page_is_the_generated_one() -> None:
    page = ROOT / "docs" / "configuration.md"
    current = page.read_text(encoding="utf-8")
    assert current == config_doc.render_page(current), (
        "docs/configuration.md differs from the config models: run `.venv/bin/python -m lmi_serve.config.doc`")


def test_kernels_page_is_the_generated_one() -> None:
    """docs/kernels.md's table is kernels/registry.py's, as the option table is the config models'."""
    page = ROOT / "docs" / "kernels.md"
    current = page.read_text(encoding="utf-8")
    assert current == kernels_doc.render_page(current), (
        "docs/kernels.md differs from kernels/registry.py: run `.venv/bin/python -m lmi_serve.kernels.doc`")


def test_every_option_field_has_a_description() -> None:
    missing = [f for f in config_doc.documented_fields() if not ModelConfig.model_fields[f].description]
    assert not missing, f"give these ModelConfig fields Field(description=...): {missing}"


# A value unlike the default that each field accepts alone (the rest are derived from the field).
SAMPLES = {"name": "renamed", "model_id": "/models/other", "min_workers": "0", "max_workers": "2",
           "tensor_parallel_degree": "max", "output_formatter": "sse", "entry_point": "custom.py", "handler": "run",
           "gguf_file": "other.gguf", "device_map": "auto", "revision": "v2", "max_rolling_batch_step_seconds": "0.3",
           "chat_template": "{{ messages[0].content }}", "generation_deadline": "2.5"}
# Fields that take effect only beside another option, which the config refuses to leave out: that option.
COMPANIONS = {"spec_length": ("draft_model_id", "ngram"), "quantize_lm_head": ("quantize", "q4")}


def sample(field: str) -> str:
    if field in SAMPLES:
        return SAMPLES[field]
    info = ModelConfig.model_fields[field]
    literals, others = config_doc._literals(info.annotation)
    if bool in others:
        return "false" if info.default else "true"
    if literals:
        return str(next(v for v in literals if v != info.default))
    if info.default is None:
        return "7"
    return str(info.default / 2 if isinstance(info.default, float) else info.default + 1)


@pytest.mark.parametrize("field", config_doc.documented_fields())
def test_every_listed_key_and_variable_sets_its_field(tmp_path: Path, field: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    default = load_model_config(folder, {})
    value = sample(field)
    other, other_value = COMPANIONS.get(field, (None, None))
    for name in config_doc.environment_names(field):
        env = {name: value, **({f"OPTION_{other.upper()}": other_value} if other else {})}
        got = getattr(load_model_config(folder, env), field)
        assert got != getattr(default, field) and str(got).lower() == value, (name, got)
    for key in config_doc.option_keys(field):
        for spelling in {key, key if key.startswith("option.") else f"option.{key}"}:
            companion = f"option.{other}={other_value}\n" if other else ""
            (folder / "serving.properties").write_text(f"{spelling}={value}\n{companion}")
            got = getattr(load_model_config(folder, {}), field)
            assert got != getattr(default, field) and str(got).lower() == value, (spelling, got)
    assert config_doc.option_keys(field) and config_doc.environment_names(field)
