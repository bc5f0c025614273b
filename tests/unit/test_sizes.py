"""The gateway reads on a screen (docs/development.md, "The gateway's wings"): its top
level holds at most 12 modules besides its wings, no function or method runs over 80
lines, and no class over 300. Read from the source with `ast`; a change that crosses a
limit splits the code, it does not raise the limit."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "services" / "gateway" / "specdec" / "gateway"
MAX_TOP_MODULES = 12
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def _definitions() -> list[tuple[int, str, ast.AST]]:
    found = []
    for path in sorted(GATEWAY.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                found.append((lines, f"{path.relative_to(GATEWAY)}:{node.name}", node))
    return found


def test_the_gateways_top_level_is_short():
    modules = [p.name for p in GATEWAY.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= MAX_TOP_MODULES, sorted(modules)


def test_no_function_or_class_runs_past_a_screen():
    found = _definitions()
    assert len(found) > 100  # the walk read the gateway
    long_functions = [
        (n, name) for n, name, node in found
        if not isinstance(node, ast.ClassDef) and n > MAX_FUNCTION_LINES
    ]  # fmt: skip
    large_classes = [
        (n, name)
        for n, name, node in found
        if isinstance(node, ast.ClassDef) and n > MAX_CLASS_LINES
    ]
    assert not long_functions, long_functions
    assert not large_classes, large_classes
