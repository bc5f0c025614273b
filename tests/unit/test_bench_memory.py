"""`specdec bench` prices its memory before it loads anything (tools/specdec/tools/bench/memory.py): the
in-process rows run after the stack's where both do not fit together, and the fastest-step
row is left out, saying why, where even that has no room."""

import argparse

import pytest
import torch
from safetensors.torch import save_file

from specdec.tools.bench import memory
from specdec.tools.bench.cli import plan_memory

GIB = 1 << 30


@pytest.fixture
def pair(tmp_path):
    """Two checkpoint folders: a 'target' of 3000 weights and a 'draft' of 1000 (bf16)."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir(), draft.mkdir()
    weights = {"a": torch.zeros(10, 200, dtype=torch.bfloat16), "b": torch.zeros(1000)}
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    save_file({"c": torch.zeros(10, 100)}, draft / "model.safetensors")
    return str(target), str(draft)


def test_parameters_are_read_from_the_headers(pair, tmp_path):
    target, draft = pair
    assert memory.parameters(target) == 3000
    assert memory.parameters(draft) == 1000
    assert memory.parameters(tmp_path) is None  # no safetensors (a GGUF folder)


def test_plan_counts_each_copy_in_its_dtype(pair):
    target, draft = pair
    stack, in_process, step = memory.plan(target, draft, "float32", "bfloat16+packed")
    assert in_process == 4000 * 4 + memory.PROCESS_BYTES
    assert stack == int(4000 * 4 * memory.REPLICA_FACTOR + 2 * memory.PROCESS_BYTES)
    assert step == 3000 * 2
    assert memory.plan(target, draft, "bfloat16", None)[2] is None


def _args(target, draft, rows="auto"):
    return argparse.Namespace(
        target_model=target, draft_model=draft, dtype="float32", in_process_rows=rows
    )


def test_interleaved_where_everything_fits(pair):
    left_out: dict[str, str] = {}
    step, after = plan_memory(_args(*pair), "bfloat16+packed", left_out, free=64 * GIB)
    assert (step, after, left_out) == ("bfloat16+packed", False, {})


def test_in_process_rows_after_the_stack_where_both_do_not_fit(pair):
    stack, in_process, extra = memory.plan(*pair, "float32", "bfloat16+packed")
    free = stack + in_process + extra - 1  # one byte short of holding everything
    left_out: dict[str, str] = {}
    step, after = plan_memory(_args(*pair), "bfloat16+packed", left_out, free=free)
    assert (step, after, left_out) == ("bfloat16+packed", True, {})
    # Asked for interleaved: kept, and the fastest-step row goes (the stack's share is taken).
    step, after = plan_memory(_args(*pair, "interleaved"), "bfloat16+packed", left_out, free)
    assert (step, after) == (None, False)
    assert "does not fit" in left_out["target, fastest step [bfloat16+packed]"]


def test_fastest_step_row_left_out_where_its_own_phase_has_no_room(pair):
    _, in_process, extra = memory.plan(*pair, "float32", "bfloat16+packed")
    left_out: dict[str, str] = {}
    step, after = plan_memory(
        _args(*pair, "after"), "bfloat16+packed", left_out, free=in_process + extra - 1
    )
    assert (step, after) == (None, True)
    assert list(left_out) == ["target, fastest step [bfloat16+packed]"]


def test_all_prompt_sets_are_taken_kind_by_kind():
    """--prompt-set all: both shipped sets, every kind of each in turn, so --num-prompts 7
    draws the first prompt of each of the seven (set, kind) groups."""
    from specdec.tools.bench.modes import load_prompts

    default, grounded = load_prompts(None, "default"), load_prompts(None, "grounded")
    both = load_prompts(None, "all")
    assert len(both) == len(default) + len(grounded)
    assert {(p.kind, p.text, str(p.messages)) for p in both} == {
        (p.kind, p.text, str(p.messages)) for p in default + grounded
    }
    firsts = {}
    for name, prompts in (("default", default), ("grounded", grounded)):
        for p in prompts:
            firsts.setdefault((name, p.kind), p)
    assert both[: len(firsts)] == list(firsts.values())
