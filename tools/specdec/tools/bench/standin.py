"""Stand-in model directories: a target and a drafter whose forwards cost a known time.

`build_standins(root, target_ms, draft_ms, acceptance)` writes ``root/target`` and
``root/draft``: each a model directory with the tiny tokenizer of
specdec.tools.tinymodels, a config naming the stand-in's code (``auto_map``), that code
(`standin_model.py`, copied as ``modeling_standin.py``) and its weights. They load through
the real path, ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``, in
the services (``--trust-remote-code``) and in-process alike. See standin_model.py for what
they stand in for. The options of standin_model's config travel through: each forward's
cost per row and token (``target_per_token_ms``, ``draft_per_token_ms``: a compute-bound
device), and an output that cycles through `period` tokens with a `noise` share of
positions off the cycle (what sets prompt lookup's acceptance, the drafter's being
`acceptance`); `Standins.prompt_ids` maps prompts onto tokens outside the cycle.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.tools.bench import standin_model
from specdec.tools.tinymodels import _build_tokenizer, _save, _suppressed_ids

MODULE = "modeling_standin"


@dataclass(frozen=True)
class Standins:
    target: Path
    draft: Path
    target_ms: float
    draft_ms: float
    acceptance: float  # share of positions where the drafter proposes the target's token
    target_per_token_ms: float = 0.0  # each forward's cost per row and token, on top
    draft_per_token_ms: float = 0.0
    period: int = 0  # the output cycles through `sequence` (0: standin_model's old tables)
    noise: float = 0.0  # share of positions (from noise_start) where it does not
    noise_start: int = 0
    sequence: tuple[int, ...] = ()  # S (standin_model.sequence)
    outside: tuple[int, ...] = ()  # the allowed tokens not in S

    def prompt_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` mapped onto tokens outside S (same length; equal ids stay equal): a prompt
        that no lookup in the output matches."""
        if not self.outside:
            raise ValueError("the period spans every allowed token: no prompt avoids it")
        return [self.outside[int(t) % len(self.outside)] for t in ids]


def _write(path: Path, tokenizer, allowed: list[int], **options) -> standin_model.StandinConfig:
    config = standin_model.StandinConfig(
        vocab_size=len(tokenizer),
        allowed_ids=allowed,
        **options,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    _save(standin_model.StandinForCausalLM(config), tokenizer, path)  # as the test models
    shutil.copyfile(standin_model.__file__, path / f"{MODULE}.py")
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {
        "AutoConfig": f"{MODULE}.StandinConfig",
        "AutoModelForCausalLM": f"{MODULE}.StandinForCausalLM",
    }
    cfg.pop("architectures", None)
    cfg["architectures"] = ["StandinForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return config


def build_standins(
    root: Path,
    target_ms: float = 2.0,
    draft_ms: float = 0.5,
    acceptance: float = 0.75,
    *,
    target_per_token_ms: float = 0.0,
    draft_per_token_ms: float = 0.0,
    period: int = 0,
    noise: float = 0.0,
    noise_start: int | None = None,
) -> Standins:
    """Write the stand-in target and drafter under root (overwriting). `noise_start`
    defaults to 2 * period (see standin_model): give the longest prompt + period when
    prompts may be longer than a period."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    root = Path(root)
    tokenizer = _build_tokenizer()
    suppressed = set(_suppressed_ids(tokenizer))
    allowed = [t for t in range(len(tokenizer)) if t not in suppressed]
    output = dict(period=period, noise=noise, noise_start=noise_start)
    target = _write(
        root / "target", tokenizer, allowed, forward_ms=target_ms,
        per_token_ms=target_per_token_ms, disagree=0.0, **output,
    )  # fmt: skip
    _write(
        root / "draft", tokenizer, allowed, forward_ms=draft_ms,
        per_token_ms=draft_per_token_ms, disagree=1.0 - acceptance, **output,
    )  # fmt: skip
    return Standins(
        target=root / "target",
        draft=root / "draft",
        target_ms=target_ms,
        draft_ms=draft_ms,
        acceptance=acceptance,
        target_per_token_ms=target_per_token_ms,
        draft_per_token_ms=draft_per_token_ms,
        period=period,
        noise=noise,
        noise_start=target.noise_start,
        sequence=tuple(standin_model.sequence(target)),
        outside=tuple(standin_model.outside(target)),
    )
