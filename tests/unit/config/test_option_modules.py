"""config/ stays split by concern and its option descriptions stay short: each says what the option does
in about three lines and links to the figures (docs pages, benchmarks/RESULTS.md, the journal) instead of
carrying them; every such link reaches a file and a heading; no config module grows past the size guide."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from lmi_serve.config import (adapter_options, doc, engine_options, kernel_options, model_options, request_options,
                              server_options)
from lmi_serve.config.models import ModelConfig

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "src" / "lmi_serve" / "config"
DOCS = ROOT / "docs"  # the descriptions are rendered into docs/configuration.md: links are relative to it
MAX_WORDS = 60  # about three lines of the option table
MAX_CHARACTERS = 400
MAX_MODULE_LINES = 400  # the size guide (docs: style.md, "Growth without splitting again")
CONCERNS = {module.__name__: cls for module, cls in [
    (model_options, model_options.ModelOptions), (engine_options, engine_options.EngineOptions),
    (kernel_options, kernel_options.KernelOptions), (adapter_options, adapter_options.AdapterOptions),
    (request_options, request_options.RequestOptions), (server_options, server_options.ServerOptions)]}
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#([^)\s]+))?\)")
# A measured figure: a speed-up or ratio (1.4x, 0.70x), a rate or latency, a percentile, the lab's machines
FIGURE = re.compile(r"\d(?:\.\d+)?x\b|\d ?(?:tok/s|ms)\b|\bp\d\d\b|EPYC|Xeon|perplexity \d")


def shown(description: str) -> str:
    """The text a reader sees: a link counts as its label."""
    return LINK.sub(lambda m: m.group(0)[:m.group(0).index("](") + 1], description)


def described(linked_only: bool = False) -> list:
    cases = [(field, ModelConfig.model_fields[field].description or "") for field in doc.documented_fields()]
    return [pytest.param(f, d, id=f) for f, d in cases if LINK.search(d) or not linked_only]


@pytest.mark.parametrize("field, description", described())
def test_a_description_says_what_the_option_does_in_about_three_lines(field: str, description: str) -> None:
    text = shown(description)
    assert len(text.split()) <= MAX_WORDS, f"{field}: {len(text.split())} words; say what it does, link the figures"
    assert len(text) <= MAX_CHARACTERS, f"{field}: {len(text)} characters"


@pytest.mark.parametrize("field, description", described())
def test_a_description_links_to_figures_instead_of_carrying_them(field: str, description: str) -> None:
    found = FIGURE.findall(shown(description))
    assert not found, f"{field} states measured figures {found}: link to docs/ or benchmarks/RESULTS.md instead"


@pytest.mark.parametrize("field, description", described(linked_only=True))
def test_a_description_link_reaches_a_file_and_heading(field: str, description: str) -> None:
    for path, anchor in LINK.findall(description):
        target = (DOCS / path).resolve()
        assert target.is_file(), f"{field} links to {path}, which is not there"
        if anchor:
            source = target.read_text(encoding="utf-8")
            headings = {slugify(h.replace("`", ""), "-") for h in re.findall(r"^#+ (.+)$", source, re.MULTILINE)}
            assert anchor in headings, f"{field} links to {path}#{anchor}, which has no such heading"


def test_the_check_counts_a_link_as_its_label_and_finds_a_figure() -> None:
    assert shown("see [Faster on a CPU](models.md#faster-on-a-cpu-bf16-and-lighter-weights) too") == (
        "see [Faster on a CPU] too")
    assert FIGURE.findall("a step 0.70x its time, TPOT 20.9 ms, 1.40-1.54x, TTFT p50 (2-core EPYC)") == [
        "0.70x", "9 ms", "1.54x", "p50", "EPYC"]
    assert not FIGURE.findall("`max_rolling_batch_size` × `max_model_len` tokens, 0 < x ≤ 1; ms to wait; tok/s")


def test_every_option_is_declared_by_exactly_one_concern() -> None:
    owners: dict[str, list[str]] = {}
    for module, cls in CONCERNS.items():
        for field in cls.model_fields:
            owners.setdefault(field, []).append(module)
    assert {f: m for f, m in owners.items() if len(m) > 1} == {}
    assert set(doc.documented_fields()) <= set(owners), set(doc.documented_fields()) - set(owners)
    assert all(issubclass(ModelConfig, cls) for cls in CONCERNS.values())


@pytest.mark.parametrize("path", sorted(CONFIG.glob("*.py")), ids=lambda p: p.name)
def test_no_config_module_is_over_the_size_guide(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name} has {lines} lines: split it by concern"
