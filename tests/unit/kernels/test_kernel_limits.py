"""Every kernel's row or element limit is stated once, in kernels/registry.py.

Read from the source with `ast`: outside the registry, no module gives a limit a number, neither as a
constant (`MAX_ROWS = 64`, `Q8_MAX_ROWS = 2`, `max_elements = 1 << 15`) nor inline in a comparison of a
row or element count (`rows <= 64`, `x.numel() > 32768`). Those sites read the registry instead
(`max_rows("row")`). `limit_literals(root)` takes any source tree, so the same check can be pointed at an
older checkout (it finds the seven limits the tree had before kernels/registry.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "src" / "lmi_serve"
REGISTRY = Path("kernels") / "registry.py"
LIMIT_NAME = re.compile(r"(^|_)max_(rows|elements)$", re.IGNORECASE)
COUNT_NAME = re.compile(r"rows|numel|elements", re.IGNORECASE)
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _numeric(node: ast.expr) -> bool:
    """A number written in the source: 64, 1 << 15, 32 * 1024."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    return isinstance(node, ast.BinOp) and _numeric(node.left) and _numeric(node.right)


def _value(node: ast.expr) -> int:
    return eval(compile(ast.Expression(node), "<limit>", "eval"))  # only ever a literal expression (_numeric)


def _names(node: ast.expr) -> str:
    return " ".join(n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                    if isinstance(n, (ast.Name, ast.Attribute)))


def _limits_in(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        for target in targets:
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if LIMIT_NAME.search(name) and _numeric(node.value):
                found.append((node.lineno, f"{name} = {ast.unparse(node.value)}"))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ORDERINGS):
            left, right = node.left, node.comparators[0]
            for count, literal in ((left, right), (right, left)):
                if _numeric(literal) and _value(literal) > 2 and COUNT_NAME.search(_names(count)):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def limit_literals(root: Path) -> list[str]:
    """`path:line: source` of every numeric kernel limit under `root` (a package's source) outside the registry."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root) == REGISTRY:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found += [f"{path.relative_to(root)}:{line}: {text}" for line, text in _limits_in(tree)]
    return found


def test_no_kernel_limit_is_stated_outside_the_registry():
    found = limit_literals(ROOT)
    assert not found, "state these limits in kernels/registry.py and read them from there:\n" + "\n".join(found)


def test_the_check_finds_each_form_of_a_stated_limit(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "registry.py").write_text("MAX_ROWS = 64\n")  # the one place it may be
    (tmp_path / "a.py").write_text("MAX_ROWS = 64\nQ8_MAX_ROWS = 2\nMAX_ELEMENTS = 1 << 15\n"
                                   "class L:\n    max_rows = 8\n"
                                   "def f(x, rows):\n    return rows <= 64 or x.numel() > 32768 or rows > 1\n")
    assert [line.split(": ", 1)[1] for line in limit_literals(tmp_path)] == [
        "MAX_ROWS = 64", "Q8_MAX_ROWS = 2", "MAX_ELEMENTS = 1 << 15", "max_rows = 8", "rows <= 64", "x.numel() > 32768"]
