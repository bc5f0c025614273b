"""One name, one meaning: a class or a type alias defined at the top level of a module under
sdk/ or services/ is defined there once, so `Session` or `Speculation` means one thing
whichever file a reader opens. An alias that re-exports the same class under the same name
(`Name = module.Name`) is not a second meaning; those are listed in REEXPORTS. A type
parameter (`RequestT = TypeVar("RequestT")`) is each module's own, so it may repeat, but it
never takes the name of a class. The glossary of docs/development.md ("One name, one
meaning") says where each name it lists lives."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The package roots of the SDK and of every service (not their build/ copies).
ROOTS = ("sdk/specdec", "services/*/specdec")

# "path::Name" of the aliases that re-export a class of the same name defined elsewhere
# (`Name = module.Name`): the same meaning under a second address.
REEXPORTS: frozenset[str] = frozenset()

TYPE_PARAMETERS = ("TypeVar", "ParamSpec", "TypeVarTuple")


def _is_type_name(name: str) -> bool:
    """A CapWords name: a class or a type alias (not a CONSTANT, not a one-letter TypeVar)."""
    return name[:1].isupper() and not name.isupper()


def _is_type_parameter(value: ast.expr) -> bool:
    """`TypeVar(...)`, `typing.TypeVar(...)` (or ParamSpec, TypeVarTuple)."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in TYPE_PARAMETERS


def definitions(tree: ast.Module) -> list[tuple[str, int, ast.expr | None]]:
    """The module's top-level classes (value None) and CapWords aliases and type
    parameters (their value)."""
    out: list[tuple[str, int, ast.expr | None]] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out.append((node.name, node.lineno, None))
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and _is_type_name(target.id):
                    out.append((target.id, node.lineno, node.value))
    return out


def is_reexport(name: str, value: ast.expr | None) -> bool:
    """`Name = Name`-shaped: an alias whose value is the same name (`module.Name`)."""
    if isinstance(value, ast.Attribute):
        return value.attr == name
    return isinstance(value, ast.Name) and value.id == name


def clashes(root: Path, folders: tuple[str, ...], reexports: frozenset[str]) -> dict[str, set[str]]:
    """Each name defined in more than one place under root/folders (glob patterns; files
    relative to root), re-exports in `reexports` left out; an entry there that is not a
    re-export of the same name raises. A type parameter named as a class or alias counts as one more
    place of that name."""
    where: dict[str, set[str]] = defaultdict(set)
    parameters: dict[str, set[str]] = defaultdict(set)
    for path in sorted({p for folder in folders for p in root.glob(f"{folder}/**/*.py")}):
        rel = path.relative_to(root).as_posix()
        for name, line, value in definitions(ast.parse(path.read_text(), rel)):
            if value is not None and _is_type_parameter(value):
                parameters[name].add(rel)
                continue
            if f"{rel}::{name}" in reexports:
                if not is_reexport(name, value):
                    raise AssertionError(f"{rel}:{line}: {name} is not `{name} = x.{name}`")
                continue
            where[name].add(rel)
    for name, files in parameters.items():
        if name in where:
            where[name] |= files
    return {name: files for name, files in where.items() if len(files) > 1}


def test_one_name_one_meaning():
    found = {name: sorted(files) for name, files in clashes(ROOT, ROOTS, REEXPORTS).items()}
    assert not found, (
        f"names defined more than once: {found}; name each after what it is "
        "(docs/development.md, 'One name, one meaning'), or list a re-export of the same "
        "class in REEXPORTS"
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_second_meaning_is_found(tmp_path):
    _write(
        tmp_path,
        {
            "a/x.py": "class Session:\n    pass\n",
            "a/y.py": "from typing import TypeVar\nT = TypeVar('T')\nMAX = 3\nSession = int\n",
            "b/z.py": "import a.x\nclass Other:\n    pass\nOther2: type = Other\n",
        },
    )
    assert clashes(tmp_path, ("a", "b"), frozenset()) == {"Session": {"a/x.py", "a/y.py"}}
    # an alias of another class is a second meaning even when listed as a re-export
    with pytest.raises(AssertionError, match="Session is not"):
        clashes(tmp_path, ("a", "b"), frozenset({"a/y.py::Session"}))


def test_a_reexport_is_the_same_meaning(tmp_path):
    _write(
        tmp_path,
        {
            "a/x.py": "class Session:\n    pass\n",
            "a/y.py": "from a import x\nSession = x.Session\n",
        },
    )
    assert clashes(tmp_path, ("a",), frozenset()) == {"Session": {"a/x.py", "a/y.py"}}
    assert clashes(tmp_path, ("a",), frozenset({"a/y.py::Session"})) == {}


def test_a_type_parameter_never_takes_a_class_name(tmp_path):
    _write(
        tmp_path,
        {
            "a/x.py": "class Request:\n    pass\n",
            "a/y.py": "import typing\nRequest = typing.TypeVar('Request')\n",
            "a/z.py": "from typing import TypeVar\nResponseT = TypeVar('ResponseT')\n",
            "a/w.py": "from typing import TypeVar\nResponseT = TypeVar('ResponseT')\n",
        },
    )
    assert clashes(tmp_path, ("a",), frozenset()) == {"Request": {"a/x.py", "a/y.py"}}


GLOSSARY_ROW = re.compile(r"^\| `(\w+)` \| [^|]+ \| `(specdec(?:\.\w+)+)` \|$")


def _glossary() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "development.md").read_text()
    section = text.split("## One name, one meaning", 1)[1].split("\n## ", 1)[0]
    return [m.groups() for line in section.splitlines() if (m := GLOSSARY_ROW.match(line))]


def _module_file(module: str) -> Path:
    parts = module.split(".")
    if parts[1] == "sdk":
        base = ROOT / "sdk"
    else:
        base = ROOT / "services" / ("common" if parts[1] in ("common", "serve") else parts[1])
    path = base.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_the_glossary_says_where_each_name_lives():
    rows = _glossary()
    assert len(rows) >= 10, "the glossary table of docs/development.md was not found"
    for name, module in rows:
        path = _module_file(module)
        assert path.is_file(), f"glossary: {name}: no module {module}"
        defined = {n for n, _, _ in definitions(ast.parse(path.read_text()))}
        assert name in defined, f"glossary: {name} is not defined in {module}"
