"""What the reference generators share: Markdown escaping and the banner of a generated page."""

from __future__ import annotations

import re


def banner(source: str) -> str:
    """The note at the top of every generated page (the test compares the whole page)."""
    return (
        f"<!-- Generated from {source} by `make docs-gen` (specdec.tools.docs). "
        "Do not edit: edit the source and run `make docs-gen`; "
        "tests/unit/test_docs_reference.py fails while this page is stale. -->\n"
    )


def cell(text: str) -> str:
    """Text made safe for one Markdown table cell: one line, no pipes, no raw HTML, no
    emphasis from stray asterisks; `code spans` are kept as they are."""
    text = " ".join(text.split())
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # a code span: only the pipe needs escaping inside a table
            out.append(part.replace("|", "\\|"))
        else:
            out.append(prose(part).replace("|", "\\|"))
    return "".join(out)


def prose(text: str) -> str:
    """Plain text made safe for Markdown outside code spans."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def code(value: str) -> str:
    """`value` as a code span (backticks inside doubled delimiters)."""
    return f"`` {value} ``" if "`" in value else f"`{value}`"
