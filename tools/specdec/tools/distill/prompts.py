"""Distillation prompts built offline from the Python standard library's own source.

No dataset hub is reachable, and the drafter must not be trained on the bench's prompts.
The standard library ships with every Python, under the PSF license, and holds code and
prose written by many hands:

- ``code``: a public function's signature and docstring, as the start of its definition
  ("write this function");
- ``chat``: the same as a user's request ("Write a Python function ... that ...");
- ``prose``: a paragraph of prose from a module's or a class's docstring, cut after its
  first sentence for the model to go on.

Written in the bench's prompt-file format (one JSON object a line, ``kind`` and ``prompt``
or ``messages``), so `specdec distill --prompts` and `specdec bench --prompts` read it.
Prompts equal to, or containing, one of the bench's shipped prompts are left out.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import warnings
from pathlib import Path

# Parts of the standard library that are tests, tools or generated tables, not its prose.
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "site-packages",
    "__pycache__",
    "ensurepip",
    "tkinter",
    "pydoc_data",
    "encodings",
}
MAX_DOC_CHARS = 600
KINDS = ("code", "prose", "chat")


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("_")
    )


def _first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n")[0].strip()


def _prose_start(paragraph: str) -> str | None:
    """The first sentence of a paragraph of prose (two sentences at least, mostly words,
    no code), with the space after it; None for anything else."""
    text = " ".join(paragraph.split())
    first, dot, rest = text.partition(". ")
    if not (dot and rest and 40 <= len(first) <= MAX_DOC_CHARS):
        return None
    last_word = first.rsplit(" ", 1)[-1]
    if len(last_word) < 3 or "." in last_word:  # "i.e.", "J.": not a sentence's end
        return None
    if any(c in text for c in (">>>", "::", "{", "}", "==", "()")):
        return None
    if sum(c.isalpha() or c == " " for c in text) < 0.9 * len(text):
        return None
    return first + ". "


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def prompts_of(path: Path) -> list[dict]:
    """The prompts one module gives (none when it does not parse)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in old modules
            tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    docs = [ast.get_docstring(tree)]
    docs += [ast.get_docstring(n) for n in tree.body if isinstance(n, ast.ClassDef)]
    for doc in filter(None, docs):
        for para in doc.split("\n\n"):
            if prose := _prose_start(para):
                out.append({"kind": "prose", "prompt": prose})
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if node.name.startswith("_") or not doc or len(doc) > MAX_DOC_CHARS:
            continue
        sig = _signature(node)
        body = "\n".join("    " + line if line else "" for line in doc.strip().splitlines())
        out.append({"kind": "code", "prompt": f'{sig}\n    """{body.lstrip()}\n    """\n'})
        request = " ".join(_first_paragraph(doc).split())
        out.append(
            {
                "kind": "chat",
                "messages": [
                    {
                        "role": "user",
                        "content": f"Write a Python function `{sig.split('def ', 1)[1][:-1]}`. {request}",
                    }
                ],
            }
        )
    return out


def _text(row: dict) -> str:
    return row.get("prompt") or json.dumps(row.get("messages"), sort_keys=True)


def build_prompts(count: int, seed: int = 0, exclude: list[dict] = (), root=None) -> list[dict]:
    """`count` prompts, the kinds in turn (code, prose, chat), each kind a seeded sample;
    none equal to or containing a prompt of `exclude` (the bench's)."""
    if count < 1:
        raise ValueError(f"--count must be >= 1, got {count}")
    by_kind: dict[str, list[dict]] = {k: [] for k in KINDS}
    for path in stdlib_files(root):
        for row in prompts_of(path):
            by_kind[row["kind"]].append(row)
    banned = [_text(r) for r in exclude]
    rng = random.Random(seed)
    for rows in by_kind.values():
        rows[:] = [r for r in rows if not any(b in _text(r) or _text(r) in b for b in banned)]
        rng.shuffle(rows)
    out: list[dict] = []
    while len(out) < count and any(by_kind.values()):
        for kind in KINDS:
            if by_kind[kind] and len(out) < count:
                out.append(by_kind[kind].pop())
    return out


def bench_prompts() -> list[dict]:
    """The bench's shipped prompts (specdec.sdk.loadtest's prompts.jsonl), as rows."""
    from importlib import resources

    text = resources.files("specdec.sdk.loadtest").joinpath("prompts.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def write_prompts(path: str | Path, rows: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
