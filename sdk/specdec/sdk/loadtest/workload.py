"""What a load test sends: conversations (prompts), modes, load levels and request settings."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdec.sdk.client import METHODS

#: Upper bound on k of the mode `adaptive` (the same as `adaptive4`).
ADAPTIVE_DEFAULT_K = 4


@dataclass(frozen=True)
class Conversation:
    """One entry of the prompt set: a plain prompt is a conversation of one turn.

    A multi-turn conversation is replayed turn by turn in one gateway session: each user
    turn is one request, and the model's own answers stand in for any assistant turns.
    """

    index: int
    kind: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Mode:
    """How every request of a mode asks for speculation: k None = the gateway's default."""

    name: str
    k: int | None = None  # under k_policy "adaptive": the upper bound
    ssd: bool | None = None
    k_policy: str | None = None  # "fixed" / "adaptive"; None: the gateway's default
    method: str | None = None  # where drafts come from (METHODS); None: the gateway's default
    tree_width: int | None = None  # SpeculationParams.tree_width; None: the gateway's

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Level:
    """A load level: a fixed number of concurrent users, or a Poisson arrival rate."""

    concurrency: int | None = None
    rate: float | None = None  # requests (conversations) per second
    max_concurrency: int | None = None  # rate levels: cap on conversations in flight

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"rate={self.rate:g}/s"

    @property
    def value(self) -> float:
        value = self.concurrency if self.concurrency is not None else self.rate
        assert value is not None  # a Level has one of the two
        return float(value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "concurrency": self.concurrency,
            "request_rate": self.rate,
            "max_concurrency": self.max_concurrency,
        }


@dataclass(frozen=True)
class RequestSettings:
    """What every request carries besides its text and its mode."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # base seed: conversation i uses seed + i
    stop: tuple[str, ...] = ()
    timeout: float = 300.0
    # Each prompt's turns ask for max_new_tokens within this share of it, either side (0:
    # all the same; `for_turn`).
    output_len_range: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.output_len_range < 1.0:
            raise ValueError(
                f"--output-len-range must be at least 0 and below 1 (got {self.output_len_range})"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_turn(self, conversation: Conversation, turn: int) -> RequestSettings:
        """The settings of one turn: under an output length range, its max_new_tokens drawn
        uniformly within the range around max_new_tokens, from the prompt's index and the
        turn's alone, so that a prompt asks for the same length at every level and in every
        mode (and its reference under --check-exact too), while the users of a closed loop,
        each on another prompt, end their requests apart, as real requests do. (With all
        the same length they end together and prefill their next prompts together: in
        step.)"""
        if not self.output_len_range:
            return self
        draw = random.Random(conversation.index * 7919 + turn).uniform(-1.0, 1.0)
        length = round(self.max_new_tokens * (1.0 + self.output_len_range * draw))
        return dataclasses.replace(self, max_new_tokens=max(1, length))

    def seed_for(self, conversation: Conversation) -> int | None:
        return None if self.seed is None else self.seed + conversation.index


def shipped_prompts_text() -> str:
    """The shipped mixed set: 4 code, 4 prose and 4 chat prompts (also `specdec bench`'s)."""
    return resources.files("specdec.sdk.loadtest").joinpath("prompts.jsonl").read_text()


def load_conversations(path: str | None = None, limit: int | None = None) -> list[Conversation]:
    """Conversations from a JSONL file (default: the shipped set).

    Each line holds one of: ``"prompt": str`` (one turn), ``"turns": [str, ...]`` (user
    turns), or ``"messages": [{"role", "content"}, ...]`` (its user messages are the turns;
    the text is sent as is, without a chat template). ``"kind"`` labels it (optional).
    """
    name = path or "prompts.jsonl"
    text = Path(path).read_text() if path else shipped_prompts_text()
    conversations: list[Conversation] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{n}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{name}:{n}: expected a JSON object")
        given = [key for key in ("prompt", "turns", "messages") if key in row]
        if len(given) != 1:
            raise ValueError(f"{name}:{n}: give exactly one of prompt, turns or messages")
        if "prompt" in row:
            turns = [row["prompt"]]
        elif "turns" in row:
            turns = row["turns"]
        else:
            messages = row["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ValueError(f"{name}:{n}: messages must be a list of objects")
            turns = [m.get("content") for m in messages if m.get("role") == "user"]
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{name}:{n}: every turn must be a non-empty string")
        conversations.append(
            Conversation(len(conversations), str(row.get("kind", "other")), tuple(turns))
        )
        if limit is not None and len(conversations) >= limit:
            break
    if not conversations:
        raise ValueError(f"{name}: no prompts")
    return conversations


def parse_modes(text: str) -> list[Mode]:
    """'k0,k2,ssd2' -> modes. kN: draft length N (k0: no speculation); ssdN: speculative
    speculative decoding with draft length N; adaptiveN: k_policy adaptive with SSD and k
    at most N (`adaptive`: N = 4); default: the gateway's own settings. The fixed modes
    ask for k_policy fixed, so a gateway started with --k-policy adaptive runs them as named.
    A mode may name where its drafts come from with @METHOD (model, ngram, suffix, hybrid):
    k3@ngram, ssd2@hybrid, default@suffix; without it, the gateway's --method."""
    modes: list[Mode] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        base, at, method = name.partition("@")
        mode = _mode(name, base)
        if at:
            if method not in METHODS:
                raise ValueError(
                    f"mode {name!r}: unknown method {method!r}; known: {', '.join(METHODS)}"
                )
            if mode.k == 0:
                raise ValueError(f"mode {name!r}: k0 runs no speculation, so no method")
            mode = dataclasses.replace(mode, name=name, method=method)
        if any(existing.name == name for existing in modes):
            raise ValueError(f"mode {name!r} is given twice")
        modes.append(mode)
    if not modes:
        raise ValueError("no mode given")
    return modes


def with_trees(modes: list[Mode], width: int) -> list[Mode]:
    """Each mode that speculates followed by its twin verifying token trees of `width`
    ('k3@ngram tree3'), so trees and chains run interleaved at every level; width 1: the
    modes as they are."""
    if not 1 <= width <= 8:
        raise ValueError(f"--tree-width must be in [1, 8], got {width}")
    if width == 1:
        return modes
    out: list[Mode] = []
    for mode in modes:
        out.append(mode)
        if mode.k != 0:
            out.append(dataclasses.replace(mode, name=f"{mode.name} tree{width}", tree_width=width))
    return out


def _mode(name: str, base: str) -> Mode:
    """The mode of `base` (a mode name without @METHOD); `name` for its messages."""
    if m := re.fullmatch(r"k(\d+)", base):
        return Mode(base, k=int(m.group(1)), ssd=False, k_policy="fixed")
    if m := re.fullmatch(r"ssd(\d+)", base):
        if int(m.group(1)) < 1:
            raise ValueError(f"mode {name!r}: SSD needs a draft length of at least 1")
        return Mode(base, k=int(m.group(1)), ssd=True, k_policy="fixed")
    if m := re.fullmatch(r"adaptive(\d*)", base):
        k = int(m.group(1)) if m.group(1) else ADAPTIVE_DEFAULT_K
        if k < 1:
            raise ValueError(f"mode {name!r}: adaptive needs an upper bound of at least 1")
        return Mode(base, k=k, ssd=True, k_policy="adaptive")
    if base == "default":
        return Mode(base)
    raise ValueError(
        f"unknown mode {name!r}: use kN (draft length N; k0 = no speculation), "
        "ssdN (SSD with draft length N), adaptiveN (adaptive k up to N, with SSD; "
        "adaptive: N = 4) or default (the gateway's settings), each optionally with "
        "@METHOD (model, ngram, suffix, hybrid)"
    )


def parse_levels(
    concurrency: str | None, rate: str | None, max_concurrency: int | None = None
) -> list[Level]:
    """--concurrency 1,2,4 or --rate 0.5,2 (requests/s) -> levels, in the order given."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give one of --concurrency or --rate")
    levels: list[Level] = []
    for part in (concurrency or rate or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if concurrency is not None:
                count = int(part)
                if count < 1:
                    raise ValueError
                levels.append(Level(concurrency=count))
            else:
                value = float(part)
                if not value > 0 or value == float("inf"):
                    raise ValueError
                levels.append(Level(rate=value, max_concurrency=max_concurrency))
        except ValueError:
            what = "--concurrency" if concurrency is not None else "--rate"
            raise ValueError(f"{what}: {part!r} is not a positive number") from None
    if not levels:
        raise ValueError("no load level given")
    labels = [level.label for level in levels]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a load level is given twice: {', '.join(labels)}")
    return levels
