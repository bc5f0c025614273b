"""Stand-in model directories: a target and a drafter whose forwards cost a fixed time.

`build_standins(root, target_ms, draft_ms, acceptance)` writes ``root/target`` and
``root/draft``: each a model directory with the tiny tokenizer of
specdec.tools.tinymodels, a config naming the stand-in's code (``auto_map``), that code
(`standin_model.py`, copied as ``modeling_standin.py``) and its weights. They load through
the real path, ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``, in
the services (``--trust-remote-code``) and in-process alike. See standin_model.py for what
they stand in for.
"""

from __future__ import annotations

import json
import shutil
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


def _write(path: Path, tokenizer, forward_ms: float, disagree: float, allowed: list[int]) -> Path:
    config = standin_model.StandinConfig(
        vocab_size=len(tokenizer),
        forward_ms=forward_ms,
        disagree=disagree,
        allowed_ids=allowed,
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
    return path


def build_standins(
    root: Path, target_ms: float = 2.0, draft_ms: float = 0.5, acceptance: float = 0.75
) -> Standins:
    """Write the stand-in target and drafter under root (overwriting)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    root = Path(root)
    tokenizer = _build_tokenizer()
    suppressed = set(_suppressed_ids(tokenizer))
    allowed = [t for t in range(len(tokenizer)) if t not in suppressed]
    return Standins(
        target=_write(root / "target", tokenizer, target_ms, 0.0, allowed),
        draft=_write(root / "draft", tokenizer, draft_ms, 1.0 - acceptance, allowed),
        target_ms=target_ms,
        draft_ms=draft_ms,
        acceptance=acceptance,
    )
