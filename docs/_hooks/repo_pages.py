"""MkDocs hook: a few Markdown files that live elsewhere in the repository become pages of the site.

benchmarks/README.md, RESULTS.md and the journal sit beside the benchmark scripts and deploy/README.md beside
the recipes, and the docs link to them by their repository paths (`../benchmarks/RESULTS.md`), which also work
on a forge.
MkDocs only knows files under docs/, so this hook adds each as a page under `repo/<path>` and rewrites
the relative links that cross between docs/ and those files, leaving every link checked by the strict
build (a link to any other file outside docs/ still fails it).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

#: repository paths or globs (relative to mkdocs.yml) served as pages under repo/; each needs a nav entry
REPO_PAGES = ("benchmarks/README.md", "benchmarks/RESULTS.md", "benchmarks/journal/*.md", "deploy/README.md")
_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s]+)\)")


def _repo_root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def repo_pages(root: Path) -> list[str]:
    """REPO_PAGES with each glob expanded to the files it matches, as repository paths."""
    return sorted({p.relative_to(root).as_posix() for pattern in REPO_PAGES for p in root.glob(pattern)})


def _docs_prefix(config) -> str:
    return Path(config.docs_dir).resolve().relative_to(_repo_root(config)).as_posix()


def _rewrite(markdown: str, repo_path: str, site_path: str, docs_prefix: str, pages: list[str]) -> str:
    """Point each relative link of the file at `repo_path` (served at `site_path`) at its page in the site."""
    def fix(match: re.Match) -> str:
        link = match.group(1)
        path, _, anchor = link.partition("#")
        target = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path)) if path else repo_path
        if target in pages:
            site_target = f"repo/{target}"
        elif target.startswith(docs_prefix + "/"):
            site_target = target[len(docs_prefix) + 1:]
        else:
            return match.group(0)  # left for the strict build to judge
        relative = posixpath.relpath(site_target, posixpath.dirname(site_path) or ".")
        return f"]({relative}{'#' + anchor if anchor else ''})"
    return _LINK.sub(fix, markdown)


def on_files(files, config):
    root = _repo_root(config)
    pages = repo_pages(root)
    for repo_path in pages:
        site_path = f"repo/{repo_path}"
        text = (root / repo_path).read_text(encoding="utf-8")
        files.append(File.generated(config, site_path,
                                    content=_rewrite(text, repo_path, site_path, _docs_prefix(config), pages)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("repo/"):
        return markdown  # rewritten when it was added
    prefix = _docs_prefix(config)
    return _rewrite(markdown, f"{prefix}/{page.file.src_uri}", page.file.src_uri, prefix, repo_pages(_repo_root(config)))
