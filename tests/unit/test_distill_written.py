"""Prompts written by a model (`specdec distill prompts --writer`): what a reply must be
to become a prompt, and a writer that cannot write is an error, not a short file."""

from __future__ import annotations

import random

from specdec.cli import main as specdec
from specdec.tools.distill.written import AREAS, FORMS, asks, chat_prompt, prose_prompt

OPENING = (
    "The history of the bicycle begins in the early nineteenth century in Germany. Karl "
    "Drais built a two-wheeled running machine that riders pushed along with their feet. "
    "It was called the draisine."
)


def test_prose_is_the_first_sentence_and_the_start_of_the_second():
    got = prose_prompt(OPENING, random.Random(0))
    first = "The history of the bicycle begins in the early nineteenth century in Germany."
    assert got.startswith(first + " Karl Drais")
    rest = got[len(first) + 1 :].split()
    second = OPENING.split(". ")[1].split()
    assert 3 <= len(rest) <= len(second) - 2 and rest == second[: len(rest)]
    assert "draisine" not in got  # never the third sentence


def test_replies_that_are_not_a_clean_paragraph_are_refused():
    rng = random.Random(0)
    assert prose_prompt("Too short. Really.", rng) is None
    assert prose_prompt("One long sentence with no second one at all in sight here", rng) is None
    assert prose_prompt("Here is the opening paragraph you asked for. " + OPENING, rng) is None
    assert prose_prompt("```python\nprint(1)\n```", rng) is None
    assert prose_prompt("# Title\n\n" + OPENING, rng) is None
    assert chat_prompt('"How do I keep basil alive on a windowsill in winter?"') == (
        "How do I keep basil alive on a windowsill in winter?"
    )
    assert chat_prompt("Sure:\n- one\n- two\n- three things to ask") is None
    assert chat_prompt("Hi!") is None


def test_asks_draw_areas_and_forms_from_the_seed():
    a, b = asks("prose", 20, random.Random(3)), asks("prose", 20, random.Random(3))
    assert a == b and len(set(a)) > 10
    assert all(any(f in x for f in FORMS) and any(r in x for r in AREAS) for x in a)
    assert all(any(r in x for r in AREAS) for x in asks("chat", 5, random.Random(3)))


def test_a_writer_that_cannot_write_is_an_error(test_models, tmp_path, capsys):
    """The tiny random target writes noise: no reply cleans up, so the command fails
    naming the shortfall and writes no file."""
    out = tmp_path / "p.jsonl"
    argv = ["distill", "prompts", "--out", str(out), "--count", "3", "--no-progress"]
    argv += ["--writer", str(test_models.target), "--dtype", "float32", "--threads", "1"]
    assert specdec(argv) == 2
    assert "too few usable prompts" in capsys.readouterr().err
    assert not out.exists()
