"""`specdec bench --structured`: structured output against free generation, on the pair.

Each prompt asks for a JSON object; every mode runs it (greedy) before the next prompt:

  target json      transformers ``generate`` on the target alone with the JSON schema's mask
                   as a logits processor (``GrammarProcessor``): the reference
  k=K              the stack, free generation
  k=K json         the stack under the schema (GenerateRequest.structured_output)
  ssd k=K          the same two with SSD
  ssd k=K json

Reported per mode: tokens/s, the draft acceptance rate (accepted / drafted tokens) and mean
accepted length per round; for the constrained modes whether the tokens equal the target's
constrained output and whether the text is JSON that the schema allows (the schema has
required keys, so a text that parses and holds them is checked, not only parsed).

Output: a markdown table on stdout, ``results.json`` and ``results.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

# A JSON schema a code model can fill: compact JSON (the gateway's default).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "language": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "language", "year", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe the Python library NumPy as a JSON object with its name, language, first "
    "release year and up to three tags.",
    "Describe the Linux kernel as a JSON object with its name, language, first release "
    "year and up to three tags.",
    "Describe the Rust crate serde as a JSON object with its name, language, first release "
    "year and up to three tags.",
]


class GrammarProcessor:
    """A llguidance grammar's mask as a transformers logits processor (a batch of one):
    forbidden logits -inf after the tokens generated so far. Built from the transformers
    tokenizer (llguidance.hf), independently of the gateway's code."""

    def __init__(self, tokenizer, vocab: int, grammar: str, prompt_length: int):
        import llguidance
        import llguidance.hf

        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        self.vocab = vocab
        self.start = prompt_length
        self.seen = 0

    def allowed(self):
        """[vocab] bool: the tokens the grammar allows next."""
        import torch

        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        unpacked = (bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        return unpacked.flatten()[: self.vocab].bool()

    def advance(self, tokens: list[int]) -> None:
        for t in tokens:
            if not self.matcher.consume_token(t):
                raise AssertionError(self.matcher.get_error())

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.start :].tolist()
        self.advance(new[self.seen :])
        self.seen = len(new)
        return scores.masked_fill(~self.allowed().to(scores.device), float("-inf"))


def schema_grammar() -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["required"])


def run_structured(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    from specdec.sdk import Client
    from specdec.tools.launcher import ServiceFailed
    from specdec.tools.models import resolve_models
    from specdec.tools.stack import LocalStack, resolve_dtype, say

    problem = resolve_models(args, "bench")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    k = int((args.k or "3").split(",")[0])
    args.default_k = max(4, k)
    n = args.max_new_tokens
    prompts = PROMPTS[: args.num_prompts or len(PROMPTS)]
    print(f"dtype {resolve_dtype(args).summary()}", flush=True)  # fastest: measured here
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    print(f"loading {args.target_model} ({args.dtype}) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    target = AutoModelForCausalLM.from_pretrained(args.target_model, dtype=dtype).eval()
    grammar = schema_grammar()
    spec = {"json_schema": SCHEMA}
    encoded = [
        list(
            tokenizer(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
            ).input_ids
        )
        for p in prompts
    ]
    modes = ["target json", f"k={k}", f"k={k} json", f"ssd k={k}", f"ssd k={k} json"]
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        with (
            LocalStack(args, announce=say) as stack,
            Client(stack.gateway.address, timeout=3600) as client,
        ):
            for i, ids in enumerate(encoded):
                for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                    started = time.perf_counter()
                    if mode == "target json":
                        x = torch.tensor([ids])
                        processor = GrammarProcessor(
                            tokenizer, target.config.vocab_size, grammar, len(ids)
                        )
                        with torch.inference_mode():
                            out = target.generate(
                                x,
                                attention_mask=torch.ones_like(x),
                                do_sample=False,
                                max_new_tokens=n,
                                logits_processor=LogitsProcessorList([processor]),
                            )
                        tokens = out[0, len(ids) :].tolist()
                        stats = None
                    else:
                        out = client.generate(
                            token_ids=ids,
                            max_new_tokens=n,
                            k=k,
                            ssd=mode.startswith("ssd"),
                            structured_output=spec if mode.endswith("json") else None,
                        )
                        tokens, stats = list(out.tokens), out.stats
                    seconds = time.perf_counter() - started
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    samples[mode].append(
                        {
                            "tokens": tokens,
                            "seconds": seconds,
                            "text": text,
                            "draft_tokens": stats.draft_tokens if stats else 0,
                            "accepted_tokens": stats.accepted_tokens if stats else 0,
                            "rounds": stats.rounds if stats else 0,
                            "ssd_hits": stats.ssd_hits if stats else 0,
                            "ssd_misses": stats.ssd_misses if stats else 0,
                        }
                    )
                    print(f"prompt {i} {mode:<14} {len(tokens) / seconds:6.2f} tok/s", flush=True)
    except ServiceFailed as e:
        print(f"specdec bench: {e}", file=sys.stderr)
        return 1
    rows = summarize(samples, modes)
    result = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "specdec " + shlex.join(sys.argv[1:]),
            "target_model": args.target_model,
            "draft_model": args.draft_model,
            "dtype": args.dtype,
            "k": k,
            "max_new_tokens": n,
            "schema": SCHEMA,
        },
        "rows": rows,
        "samples": samples,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    table = render(rows)
    (out / "results.md").write_text(table)
    print(table)
    return 0


def summarize(samples: dict[str, list[dict]], modes: list[str]) -> list[dict]:
    reference = [s["tokens"] for s in samples["target json"]]
    rows = []
    for mode in modes:
        runs = samples[mode]
        tokens = sum(len(s["tokens"]) for s in runs)
        seconds = sum(s["seconds"] for s in runs)
        drafted = sum(s["draft_tokens"] for s in runs)
        accepted = sum(s["accepted_tokens"] for s in runs)
        rounds = sum(s["rounds"] for s in runs)
        hits = sum(s.get("ssd_hits", 0) for s in runs)
        misses = sum(s.get("ssd_misses", 0) for s in runs)
        constrained = mode.endswith("json")
        rows.append(
            {
                "mode": mode,
                "tokens": tokens,
                "tokens_per_second": round(tokens / seconds, 3) if seconds else 0.0,
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "mean_accepted_length": round((accepted + rounds) / rounds, 3) if rounds else None,
                "equals_target_json": (
                    [s["tokens"] for s in runs] == reference if constrained else None
                ),
                "valid_json": sum(valid(s["text"]) for s in runs) if constrained else None,
                "ssd_hit_rate": round(hits / (hits + misses), 3) if hits + misses else None,
                "prompts": len(runs),
            }
        )
    return rows


def render(rows: list[dict]) -> str:
    def cell(v) -> str:
        return "" if v is None else str(v)

    lines = [
        "| mode | tok/s | acceptance | accepted/round | SSD hits | = target json | valid JSON |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        valid_cell = "" if r["valid_json"] is None else f"{r['valid_json']}/{r['prompts']}"
        lines.append(
            f"| {r['mode']} | {r['tokens_per_second']} | {cell(r['acceptance_rate'])} | "
            f"{cell(r['mean_accepted_length'])} | {cell(r['ssd_hit_rate'])} | "
            f"{cell(r['equals_target_json'])} | {valid_cell} |"
        )
    return "\n".join(lines) + "\n"
