"""benchmarks/: one package whose scripts run as `python -m benchmarks.<script>` from the repository root with no
sys.path edits, each listed in benchmarks/README.md; the current results, the journal and README.md link only to
files (and headings) that exist; the journal's index lists every section."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "benchmarks"
LINK = re.compile(r"\]\((?!https?:|mailto:)([^)\s#]*)(?:#([^)\s]+))?\)")


def sys_path_uses(source: str) -> list[int]:
    """Lines that touch `sys.path` (insert, append, slice assignment or any other use)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys"]


def scripts() -> list[str]:
    """Every runnable module of the package: the top-level scripts and any helper with a __main__ guard."""
    found = [p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py"]
    found += [p for p in (BENCHMARKS / "benchmark").glob("*.py") if '__name__ == "__main__"' in p.read_text()]
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in found)


def headings(path: Path) -> set[str]:
    return {slugify(h, "-") for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)}


def test_the_check_sees_a_sys_path_edit() -> None:
    assert sys_path_uses("import sys\nsys.path.insert(0, 'x')\n") == [2]
    assert sys_path_uses("import sys\nsys.path[:0] = ['x']\n") == [2]
    assert sys_path_uses("import sys\nprint(sys.argv)\n") == []


@pytest.mark.parametrize("path", sorted(BENCHMARKS.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_benchmark_file_edits_sys_path(path: Path) -> None:
    assert sys_path_uses(path.read_text(encoding="utf-8")) == [], (
        f"{path.relative_to(ROOT)} edits sys.path: import siblings as benchmarks.<x>, test helpers through "
        "benchmarks.benchmark.suite.helper()")


def test_benchmarks_is_a_package() -> None:
    assert (BENCHMARKS / "__init__.py").is_file() and (BENCHMARKS / "benchmark" / "__init__.py").is_file()


def test_every_script_is_in_the_readme() -> None:
    readme = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"python -m (benchmarks(?:\.\w+)+)", readme))
    assert len(scripts()) > 25
    missing = [module for module in scripts() if module not in listed]
    assert not missing, f"add a row to benchmarks/README.md for: {missing}"


@pytest.mark.parametrize("entry, module", [("scripts/bench", "benchmarks.bench"), ("scripts/soak", "benchmarks.soak"),
                                           ("scripts/device_check.py", "benchmarks.bench_gpu"),
                                           ("scripts/device_check.py", "benchmarks.bench_cpu_scaling")])
def test_entry_points_run_the_modules(entry: str, module: str) -> None:
    text = (ROOT / entry).read_text(encoding="utf-8")
    assert re.search(rf'-m"?,? "?{re.escape(module)}\b', text), f"{entry} does not run python -m {module}"
    script = re.escape(module.replace(".", "/") + ".py")
    assert not re.search(rf'(\$ROOT/|sys\.executable, "){script}', text), f"{entry} still runs the file"


@pytest.mark.parametrize("module", ["benchmarks.bench", "benchmarks.soak"])
def test_a_script_runs_as_a_module_from_the_root(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout


LINKED = ["README.md", "benchmarks/README.md", "benchmarks/RESULTS.md",
          *sorted(p.relative_to(ROOT).as_posix() for p in (BENCHMARKS / "journal").glob("*.md"))]


@pytest.mark.parametrize("page", LINKED)
def test_links_reach_files_and_headings(page: str) -> None:
    source = ROOT / page
    links = LINK.findall(source.read_text(encoding="utf-8"))
    assert links or page.startswith("benchmarks/journal/2"), f"{page} links nowhere"
    for path, anchor in links:
        target = (source.parent / path).resolve() if path else source
        assert target.exists(), f"{page}: {path} does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in headings(target), f"{page}: no heading #{anchor} in {path or page}"


def test_results_link_the_journal_and_the_howto() -> None:
    results = (BENCHMARKS / "RESULTS.md").read_text(encoding="utf-8")
    targets = {path for path, _ in LINK.findall(results)}
    assert "README.md" in targets and "journal/README.md" in targets
    assert any(t.startswith("journal/20") for t in targets)


def test_journal_index_lists_every_section() -> None:
    index = (BENCHMARKS / "journal" / "README.md").read_text(encoding="utf-8")
    listed = set(LINK.findall(index))
    for month in sorted((BENCHMARKS / "journal").glob("20*.md")):
        sections = re.findall(r"^## (.+)$", month.read_text(encoding="utf-8"), flags=re.MULTILINE)
        assert sections, month.name
        missing = [s for s in sections if (month.name, slugify(s, "-")) not in listed]
        assert not missing, f"journal/README.md does not list these sections of {month.name}: {missing}"
