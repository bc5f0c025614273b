"""What the bench measures: prompts, modes, and one sample of a mode on a prompt."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

QUICK_PROMPTS = 3  # one of each kind
QUICK_TOKENS = 32

# Drafter variants of `--drafters`: a name and the drafter flags that make it (appended to
# the drafter's command line, after the stack's own --dtype, so a variant may override it).
# A variant runs on its own stack with its own drafter on the drafter's CPU; its rows are
# named "k=2 [name]" (the default variant's keep their plain names).
DRAFTERS: dict[str, tuple[str, ...]] = {
    "bf16": (),  # today's drafter: the model in the stack's --dtype (bfloat16 in the bench)
    "int8": ("--quantize", "int8", "--dtype", "float32"),  # int8 weights, fp32 activations
    "vocab32k": ("--draft-vocab", "32768"),  # the output layer over the 32,768 smallest ids
}
DEFAULT_DRAFTER = "bf16"
# `--prompt-set`: the shipped prompt files (specdec.sdk.loadtest): the mixed set (code,
# prose, chat) and the input-grounded one (edits, refactors, extraction, a chat that
# quotes itself), where lookup drafts have something to copy.
PROMPT_SETS = {"default": "prompts.jsonl", "grounded": "prompts-grounded.jsonl"}
ALL_PROMPT_SETS = "all"  # every shipped set, one after another
# `--methods`: lookup methods to add rows for ("ngram k=4", "ssd hybrid k=4", ...).
LOOKUP_METHODS = ("ngram", "suffix", "hybrid")
# transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`): its documented example
# value, the anchor row of the lookup methods.
HF_PROMPT_LOOKUP_TOKENS = 10
# Its row runs the target alone on the verifier's one CPU, as the target alone does (it uses
# no draft model, so it gets the hardware a lookup method gets in the stack); its twin
# "prompt lookup, 2 CPUs" also uses the drafter's CPU, as assisted generation does.
PROMPT_LOOKUP = "prompt lookup"
PROMPT_LOOKUP_2CPU = "prompt lookup, 2 CPUs"


# The target alone in the weights layout whose one-token step is fastest here, when that is
# not the stack's (build_modes' step_layout).
STEP_TARGET = "target, fastest step"


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
    drafter: str = DEFAULT_DRAFTER  # the --drafters variant whose stack runs it
    baseline: str = "target"  # the mode this one's speed and tokens are compared with
    method: str = "model"  # stack: SpeculationParams.method (k=K rows: the drafter alone)
    # stack: the request's k_policy: "fixed" (k every round: the k=K rows) or "adaptive"
    # (k an upper bound; the gateway's default: the 'adaptive' rows)
    k_policy: str = "fixed"
    tree_width: int | None = None  # stack: SpeculationParams.tree_width (None: the gateway's)


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


def load_prompts(path: str | None, prompt_set: str = "default") -> list[Prompt]:
    """The prompts of a JSONL file, or of a shipped set; `all`: every shipped set, its
    kinds taken in turn (the first prompt of each set's each kind, then the second, ...),
    so that --num-prompts 7 draws one of every kind of both sets."""
    if path:
        return _parse_prompts(Path(path).read_text(), path)
    if prompt_set != ALL_PROMPT_SETS:
        return _parse_prompts(_shipped(PROMPT_SETS[prompt_set]), PROMPT_SETS[prompt_set])
    groups: dict[tuple[str, str], list[Prompt]] = {}
    for name in PROMPT_SETS.values():
        for p in _parse_prompts(_shipped(name), name):
            groups.setdefault((name, p.kind), []).append(p)
    rows = itertools.zip_longest(*groups.values())
    return [p for row in rows for p in row if p is not None]


def _shipped(name: str) -> str:
    return resources.files("specdec.sdk.loadtest").joinpath(name).read_text()


def _parse_prompts(text: str, source: str) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{source}:{n}: give one of prompt or messages")
        prompts.append(Prompt(row.get("kind", "other"), row.get("prompt"), row.get("messages")))
    return prompts


def prompt_text(tokenizer, prompt: Prompt) -> str:
    """A prompt as the model reads it: the chat template (with the generation prompt) for
    messages, the text as it is otherwise."""
    if prompt.messages is not None:
        return str(
            tokenizer.apply_chat_template(
                prompt.messages, tokenize=False, add_generation_prompt=True
            )
        )
    if prompt.text is None:
        raise ValueError(f"a {prompt.kind} prompt with neither text nor messages")
    return prompt.text


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """A prompt's token ids as every in-process runner encodes it (`prompt_text`)."""
    return list(tokenizer(prompt_text(tokenizer, prompt)).input_ids)


def pick_quick(prompts: list[Prompt]) -> list[Prompt]:
    """The first prompt of each kind."""
    seen: dict[str, Prompt] = {}
    for p in prompts:
        seen.setdefault(p.kind, p)
    return list(seen.values())[:QUICK_PROMPTS]


def is_head_folder(directory: str) -> bool:
    """Whether DIR is a draft head's folder (its config.json has a specdec_head object)."""
    config = Path(directory).expanduser() / "config.json"
    try:
        return "specdec_head" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def head_flags(flags: tuple[str, ...], target_model: str) -> tuple[str, ...]:
    """A variant's drafter flags; a head's with the target as its --model (a head reads
    the target's tokenizer, embedding and output matrix)."""
    return (*flags, "--model", target_model) if "--head" in flags else flags


def parse_drafters(text: str) -> dict[str, tuple[str, ...]]:
    """'bf16,int8,distilled=DIR,distilled-int8=DIR:int8' -> each variant's name and its
    drafter flags, in order. A DRAFTERS name is that variant; NAME=DIR serves the model in
    DIR (a distilled drafter, say) as it is loaded, or the head in DIR when DIR is a head
    folder (`specdec distill --head`; `head_flags` adds the target); NAME=DIR:VARIANT with
    VARIANT's flags (int8 weights, say). Every name once."""
    out: dict[str, tuple[str, ...]] = {}
    for entry in (x.strip() for x in text.split(",")):
        if not entry:
            continue
        name, _, where = entry.partition("=")
        name = name.strip()
        if not where:
            if name not in DRAFTERS:
                raise ValueError(
                    f"--drafters: unknown variant {name!r}; known: {', '.join(DRAFTERS)}, "
                    "or NAME=DIR[:VARIANT]"
                )
            flags = DRAFTERS[name]
        else:
            directory, _, base = where.rpartition(":")
            if not directory or base not in DRAFTERS:  # no ':VARIANT' (or a ':' in DIR)
                directory, base = where, DEFAULT_DRAFTER
            if not name:
                raise ValueError(f"--drafters: {entry!r} names no variant (NAME=DIR)")
            directory = directory.strip()
            # A head folder (specdec distill --head) drafts over the target's features: its
            # --model is the target's, which the bench adds (head_flags).
            where_flag = "--head" if is_head_folder(directory) else "--model"
            flags = (*DRAFTERS[base], where_flag, directory)
        if name in out:
            raise ValueError(f"--drafters names a variant twice: {text!r}")
        out[name] = flags
    if not out:
        raise ValueError(f"--drafters: no variant named; known: {', '.join(DRAFTERS)}")
    return out


def variant_name(base: str, drafter: str) -> str:
    """A stack mode's row name on a drafter variant: 'k=2 [int8]' ('k=2' for the default)."""
    return base if drafter == DEFAULT_DRAFTER else f"{base} [{drafter}]"


def build_modes(
    ks: list[int],
    ssd_ks: list[int],
    tracing: bool = False,
    drafter: str = DEFAULT_DRAFTER,
    shared: bool = True,
    methods: tuple[str, ...] = (),
    adaptive: bool = True,
    step_layout: str | None = None,
    tree_width: int = 1,
) -> list[Mode]:
    """Every mode of one drafter variant's stack; with `tracing`, each stack mode also runs
    as '<mode> traced' on a second stack that exports every span (sampling 1.0) over OTLP.

    shared: the first variant's run, which also measures what no drafter changes: k = 0,
    assisted generation and the draft alone in-process. Every variant runs the target
    alone (its baseline, interleaved with its modes) and its drafter alone through the
    drafter service (`draft [name]`, for its cost ratio).

    methods: lookup methods (LOOKUP_METHODS) with a row each at the largest k of `ks`
    (`hybrid k=4`) and at the largest of `ssd_ks` with SSD (`ssd hybrid k=4`); the shared
    run then also measures transformers' prompt-lookup decoding (`prompt lookup` on the
    verifier's CPU, `prompt lookup, 2 CPUs` on both).

    adaptive: also the default settings' rows, the adaptive policy with the largest k (and
    the largest SSD k) as its bound: `adaptive k<=4`, `ssd adaptive k<=4`, and per method
    `hybrid adaptive k<=4`, `ssd hybrid adaptive k<=4`. The k=K rows draft k every round
    (k_policy fixed).

    step_layout: the weights' layout in which the target's one-token step is fastest here
    (the calibration's timings), when it is not the stack's: the shared run then also
    measures the target alone in it (`target [bfloat16+packed]`), the fastest target alone
    every row is also compared with (`speedup_vs_fastest_target`).

    tree_width > 1: for the draft model and per method, the same rows verifying token trees
    of that width (`tree3 k=4`, `ngram tree3 k=8`, `ngram tree3 adaptive k<=8`, with SSD
    too), beside their chains."""
    target = "target" if shared else f"target [{drafter}]"
    modes = [Mode(target, "hf", drafter=drafter, baseline=target)]
    if shared and step_layout:
        fastest = step_target_name(step_layout)
        modes.append(Mode(fastest, "hf", contender=False, drafter=drafter, baseline=fastest))
    if shared:
        modes.append(Mode("k=0", "stack", k=0, drafter=drafter))
    name = lambda base: variant_name(base, drafter)  # noqa: E731
    modes += [
        Mode(name(f"k={k}"), "stack", k=k, drafter=drafter, baseline=target) for k in ks if k > 0
    ]
    modes += [
        Mode(name(f"ssd k={k}"), "stack", k=k, ssd=True, drafter=drafter, baseline=target)
        for k in ssd_ks
    ]
    for method in methods:
        modes += [
            Mode(name(f"{method} k={k}"), "stack", k=k, drafter=drafter, baseline=target,
                 method=method)
            for k in ks[-1:]
        ]  # fmt: skip
        modes += [
            Mode(name(f"ssd {method} k={k}"), "stack", k=k, ssd=True, drafter=drafter,
                 baseline=target, method=method)
            for k in ssd_ks[-1:]
        ]  # fmt: skip
    if tree_width > 1:
        modes += _tree_modes(ks[-1:], ssd_ks[-1:], methods, tree_width, adaptive, drafter, target)
    if adaptive:
        for method in ("model", *methods):
            label = "adaptive" if method == "model" else f"{method} adaptive"
            modes += [
                Mode(name(f"{label} k<={k}"), "stack", k=k, drafter=drafter, baseline=target,
                     method=method, k_policy="adaptive")
                for k in ks[-1:]
            ]  # fmt: skip
            modes += [
                Mode(name(f"ssd {label} k<={k}"), "stack", k=k, ssd=True, drafter=drafter,
                     baseline=target, method=method, k_policy="adaptive")
                for k in ssd_ks[-1:]
            ]  # fmt: skip
    if tracing:
        modes += [
            dataclasses.replace(m, name=f"{m.name} traced", traced=True)
            for m in modes
            if m.engine == "stack"
        ]
    if shared:
        modes += [Mode("assisted", "hf"), Mode("draft", "hf", contender=False)]
        if methods:
            modes += [Mode(PROMPT_LOOKUP, "hf"), Mode(PROMPT_LOOKUP_2CPU, "hf")]
    modes.append(
        Mode(f"draft [{drafter}]", "drafter", contender=False, drafter=drafter, baseline=target)
    )
    return modes


def step_target_name(layout: str) -> str:
    """The mode of the target alone in another weights layout (build_modes' step_layout)."""
    return f"{STEP_TARGET} [{layout}]"


def _tree_modes(
    ks: list[int],
    ssd_ks: list[int],
    methods: tuple[str, ...],
    width: int,
    adaptive: bool,
    drafter: str,
    target: str,
) -> list[Mode]:
    """Each method's rows with token trees of `width` (build_modes), the draft model's
    dynamic trees (`tree3 k=K`) first."""
    out = []
    policies = ("fixed", "adaptive") if adaptive else ("fixed",)
    for method in ("model", *methods):
        for policy in policies:
            label = ("" if method == "model" else f"{method} ") + f"tree{width}"
            label += " adaptive" if policy == "adaptive" else ""
            bound = "k<=" if policy == "adaptive" else "k="
            for ssd, chosen in ((False, ks), (True, ssd_ks)):
                out += [
                    Mode(
                        variant_name(f"{'ssd ' if ssd else ''}{label} {bound}{k}", drafter),
                        "stack",
                        k=k,
                        ssd=ssd,
                        drafter=drafter,
                        baseline=target,
                        method=method,
                        k_policy=policy,
                        tree_width=width,
                    )
                    for k in chosen
                ]
    return out


def untraced_name(mode_name: str) -> str:
    return mode_name.removesuffix(" traced")


def run_stack_mode(client, mode: Mode, ids: list[int], n: int) -> Sample:
    started = time.perf_counter()
    g = client.generate(
        token_ids=ids,
        max_new_tokens=n,
        k=mode.k,
        ssd=mode.ssd or None,
        method=mode.method,
        k_policy=mode.k_policy,
        tree_width=mode.tree_width,
    )
    seconds = time.perf_counter() - started
    stats = {
        **dataclasses.asdict(g.stats),
        "accepted_per_position": list(g.stats.accepted_per_position),
    }
    return Sample(list(g.tokens), seconds, g.timings.time_to_first_token_ms, stats, g.trace_id)


def run_drafter_alone(address: str, ids: list[int], n: int, session: str) -> Sample:
    """The drafter alone, through its service: one greedy Draft of n tokens after the prompt
    (a prefill, then n - 1 one-token steps on its KV cache), the session released after.
    What `generate` of the draft alone measures in-process, for any drafter variant."""
    import grpc

    from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        request = drafter_pb2.DraftRequest(
            session_id=session,
            prefix=common_pb2.CachedPrefix(length=0, hash=0),
            new_tokens=ids,
            num_draft_tokens=n,
            sampling=common_pb2.SamplingParams(temperature=0.0),
        )
        started = time.perf_counter()
        reply = stub.Draft(request, timeout=3600)
        seconds = time.perf_counter() - started
        stub.Release(common_pb2.ReleaseRequest(session_id=session), timeout=60)
    if len(reply.draft_tokens) != n:
        raise RuntimeError(f"the drafter drafted {len(reply.draft_tokens)} tokens, asked for {n}")
    # The whole draft comes in one response: its first token arrives with the last.
    return Sample(
        list(reply.draft_tokens), seconds, seconds * 1e3, {"forward_ms": reply.forward_ms}
    )
