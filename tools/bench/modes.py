"""What the bench measures: prompts, modes, and one sample of a mode on a prompt."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

QUICK_PROMPTS = 3  # one of each kind
QUICK_TOKENS = 32


@dataclass(frozen=True)
class Prompt:
    kind: str  # code | prose | chat
    text: str | None = None
    messages: list[dict] | None = None


@dataclass(frozen=True)
class Mode:
    name: str
    engine: str  # "hf" | "stack"
    k: int | None = None  # stack: draft length
    ssd: bool = False
    contender: bool = True  # False: measured for the cost ratio only
    traced: bool = False  # stack: its requests are sampled, its twin's are not (--tracing)


@dataclass
class Sample:
    tokens: list[int]
    seconds: float
    ttft_ms: float
    stats: dict | None = None  # stack modes: the response's speculation stats
    trace_id: str = ""  # stack modes: the gateway's trace id ('' when not traced)


@dataclass
class ModeRun:
    mode: Mode
    samples: list[Sample] = field(default_factory=list)


def load_prompts(path: str | None) -> list[Prompt]:
    if path:
        text = Path(path).read_text()
    else:
        text = resources.files("specdec.sdk.loadtest").joinpath("prompts.jsonl").read_text()
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{path or 'prompts.jsonl'}:{n}: give one of prompt or messages")
        prompts.append(Prompt(row.get("kind", "other"), row.get("prompt"), row.get("messages")))
    return prompts


def pick_quick(prompts: list[Prompt]) -> list[Prompt]:
    """The first prompt of each kind."""
    seen: dict[str, Prompt] = {}
    for p in prompts:
        seen.setdefault(p.kind, p)
    return list(seen.values())[:QUICK_PROMPTS]


def build_modes(ks: list[int], ssd_ks: list[int], tracing: bool = False) -> list[Mode]:
    """Every mode; with `tracing`, each stack mode also runs as '<mode> traced' on a
    second stack that exports every span (sampling 1.0) over OTLP."""
    modes = [Mode("target", "hf"), Mode("k=0", "stack", k=0)]
    modes += [Mode(f"k={k}", "stack", k=k) for k in ks if k > 0]
    modes += [Mode(f"ssd k={k}", "stack", k=k, ssd=True) for k in ssd_ks]
    if tracing:
        modes += [
            dataclasses.replace(m, name=f"{m.name} traced", traced=True)
            for m in modes
            if m.engine == "stack"
        ]
    modes += [Mode("assisted", "hf"), Mode("draft", "hf", contender=False)]
    return modes


def untraced_name(mode_name: str) -> str:
    return mode_name.removesuffix(" traced")


def run_stack_mode(client, mode: Mode, ids: list[int], n: int) -> Sample:
    started = time.perf_counter()
    g = client.generate(token_ids=ids, max_new_tokens=n, k=mode.k, ssd=mode.ssd or None)
    seconds = time.perf_counter() - started
    stats = {
        **dataclasses.asdict(g.stats),
        "accepted_per_position": list(g.stats.accepted_per_position),
    }
    return Sample(list(g.tokens), seconds, g.timings.time_to_first_token_ms, stats, g.trace_id)
