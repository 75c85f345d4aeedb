"""A table in a docs page, generated from the code between two marker comments: the one mechanism behind
`python -m lmi_serve.config.doc` (the option table) and `python -m lmi_serve.kernels.doc` (the kernel table).
Stdlib only: the ground floor, below every layer."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GeneratedTable:
    begin: str  # the marker comment before the table
    end: str  # the marker comment after it
    default_page: Path
    command: str  # what regenerates it, for the out-of-date message: `python -m ...`
    description: str  # the command line's description
    render_table: Callable[[], str]

    def render_page(self, page: str) -> str:
        """`page` with the text between its markers replaced by the current table."""
        start, end = page.find(self.begin), page.find(self.end)
        if start < 0 or end < start:
            raise ValueError(f"the page has no {self.begin!r} ... {self.end!r} markers")
        return page[:start] + self.begin + "\n\n" + self.render_table() + "\n" + page[end:]

    def main(self, argv: list[str] | None = None) -> int:
        """Rewrite the page's table (or with --check, exit 1 where the page is out of date)."""
        parser = argparse.ArgumentParser(description=self.description)
        parser.add_argument("--page", type=Path, default=self.default_page,
                            help="the page to update (default: %(default)s)")
        parser.add_argument("--check", action="store_true", help="only compare; exit status 1 when out of date")
        args = parser.parse_args(argv)
        current = args.page.read_text(encoding="utf-8")
        wanted = self.render_page(current)
        if args.check:
            if current != wanted:
                print(f"{args.page} is out of date: run {self.command}", file=sys.stderr)
                return 1
            return 0
        if current != wanted:
            args.page.write_text(wanted, encoding="utf-8")
            print(f"updated {args.page}")
        return 0
