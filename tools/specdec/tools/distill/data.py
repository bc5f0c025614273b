"""What `specdec distill` trains on: (prompt ids, target output ids) sequences.

Two sources, one format. A gateway's recordings (`--data DIR`: the rows of
specdec.gateway.observe.recorder, schema ``specdec.record/1``) already hold what the target said.
A prompt file (`--prompts FILE`, the bench's JSONL format: ``{"kind", "prompt"}`` or
``{"kind", "messages"}``) is first run through the target (greedy), and the result is
written as recording rows to ``OUT/distill/data.jsonl``, so a resumed run reads it back
instead of generating again.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

SCHEMA = "specdec.record/1"  # the recorder's (specdec.gateway.observe.recorder.SCHEMA)


@dataclass(frozen=True)
class Sequence:
    prompt_ids: tuple[int, ...]  # everything the target saw before its output
    output_ids: tuple[int, ...]  # what the target produced (the drafter, when on_policy)
    # The target's recorded top-m at each output position (--record-top-logprobs), ids and
    # log-probabilities, likeliest first: [len(output_ids)][m]; None when not recorded.
    top_ids: tuple[tuple[int, ...], ...] | None = None
    top_logprobs: tuple[tuple[float, ...], ...] | None = None
    # The output is the drafter's own (`--on-policy`): the target's labels for it come
    # from a teacher forward (its greedy token at each position), not from output_ids.
    on_policy: bool = False

    @property
    def ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]


def read_rows(path: Path) -> list[dict]:
    """The rows of one JSONL recording file. A last line without its newline (a gateway
    stopped mid-write) is skipped; any other malformed line is an error naming it."""
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # no trailing newline: cut short
                break
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if row.get("schema") != SCHEMA:
            raise ValueError(f"{path}:{n}: schema {row.get('schema')!r}, expected {SCHEMA!r}")
        rows.append(row)
    return rows


def load_recordings(directory: str | Path, vocab_size: int) -> list[Sequence]:
    """Every row of the record-*.jsonl files (and data.jsonl) under `directory`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--data {directory}: not a directory")
    files = sorted(directory.glob("record-*.jsonl")) or sorted(directory.glob("*.jsonl"))
    if not files:
        raise ValueError(f"--data {directory}: no record-*.jsonl files")
    out = []
    for path in files:
        for row in read_rows(path):
            top_ids, top_logprobs = recorded_scores(row, path)
            seq = Sequence(
                tuple(row["prompt_ids"]),
                tuple(row["output_ids"]),
                top_ids=top_ids,
                top_logprobs=top_logprobs,
                on_policy=row.get("output_source", "target") == "drafter",
            )
            bad = [t for t in seq.ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{path}: token id {bad[0]} outside the target's vocabulary of "
                    f"{vocab_size}: recorded with another model?"
                )
            if seq.prompt_ids and seq.output_ids:
                out.append(seq)
    if not out:
        raise ValueError(f"--data {directory}: no row with a prompt and an output")
    return out


def recorded_scores(row: dict, path: Path) -> tuple:
    """(top_ids, top_logprobs) of a row recorded with --record-top-logprobs, else (None,
    None); a row whose scores do not match its output is an error naming the file."""
    ids, logprobs = row.get("target_top_ids"), row.get("target_top_logprobs")
    if ids is None and logprobs is None:
        return None, None
    n = len(row["output_ids"])
    shapes = {len(r) for r in [*(ids or []), *(logprobs or [])]}
    if ids is None or logprobs is None or len(ids) != n or len(logprobs) != n or len(shapes) > 1:
        raise ValueError(
            f"{path}: target_top_ids / target_top_logprobs do not hold one row of the same "
            f"width per output token ({n})"
        )
    if shapes == {0}:
        return None, None
    return tuple(map(tuple, ids)), tuple(map(tuple, logprobs))


def write_rows(path: Path, sequences: list[Sequence], target_model: str) -> None:
    """Sequences as recording rows (what a gateway with --record would have written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for s in sequences:
            row = {
                "schema": SCHEMA,
                "target_model": target_model,
                "drafter_version": "",
                "temperature": 0.0,
                "history_tokens": 0,
                "prompt_ids": list(s.prompt_ids),
                "output_ids": list(s.output_ids),
                "round_k": [],
                "round_accepted": [],
                "round_source": [],
                "round_extended": [],
                "finish_reason": "",
                # who wrote output_ids: "target" (as in a recording) or "drafter" (on-policy)
                "output_source": "drafter" if s.on_policy else "target",
            }
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    tmp.replace(path)


def split(sequences: list[Sequence], holdout: float, seed: int) -> tuple[list, list]:
    """(train, held-out): a seeded shuffle, at least one sequence on each side."""
    if len(sequences) < 2:
        raise ValueError(f"need at least 2 sequences to hold one out, got {len(sequences)}")
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    n_held = min(len(sequences) - 1, max(1, round(len(sequences) * holdout)))
    held = [sequences[i] for i in order[:n_held]]
    train = [sequences[i] for i in order[n_held:]]
    return train, held


def batch_generate(
    model, prompts: list[list[int]], device, max_new_tokens: int, eos, pad: int, sample=False
) -> list[list[int]]:
    """The model's continuation of each prompt (greedy; with `sample`, at temperature 1 and
    top-p 0.95 from torch's seed), generated together: left-padded to one length, masked,
    each output cut after its first end-of-sequence token. The
    weights are read once per step for all rows: 120 stdlib prompts x 128 tokens came at
    16 tok/s in batches of 8 against 10.7 one prompt at a time (the 1.5B target, bfloat16,
    2 threads, Intel Xeon with AMX, 2026-11-25; padding to the longest prompt of a batch
    eats part of the gain). bfloat16 rows padded to different lengths can break near-ties
    differently from a run of one: training data, not a reference."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    how = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 0} if sample else {}
    with torch.inference_mode():
        y = model.generate(
            ids,
            attention_mask=mask,
            **({"do_sample": False} | how),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    out = []
    for row in y[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        out.append(row[:end])
    return out


def load_text(path: str | Path, pattern: str, tokenizer, max_length: int) -> list[Sequence]:
    """Local text as training sequences (`--text`, e.g. a code model's own source tree):
    the file at `path`, or every file under it whose name matches `pattern`, in path
    order, each tokenized and cut into pieces of `max_length` tokens (a last piece shorter
    than 16 tokens is dropped). A piece has no prompt: every position is trained."""
    root = Path(path).expanduser()
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.rglob(pattern) if p.is_file())
    else:
        raise ValueError(f"--text {path}: no such file or folder")
    if not files:
        raise ValueError(f"--text {path}: no file matches {pattern!r} (--text-glob)")
    out = []
    skipped = 0
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1  # not text
            continue
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for i in range(0, len(ids), max_length):
            piece = ids[i : i + max_length]
            if len(piece) >= 16:
                out.append(Sequence((), tuple(piece)))
    if skipped:
        print(f"--text {path}: skipped {skipped} files that are not UTF-8 text", file=sys.stderr)
    if len(out) < 2:
        raise ValueError(
            f"--text {path}: {len(out)} pieces of 16 tokens or more in {len(files)} files; "
            "need at least 2 (one is held out)"
        )
    return out
