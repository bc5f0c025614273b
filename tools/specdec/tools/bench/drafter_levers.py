"""What makes the real drafter (Qwen2.5-Coder 0.5B) cheaper, measured in one process on one
core and one thread (the pinned drafter's hardware); the target stays bfloat16.

    python -m specdec.tools.bench.drafter_levers steps  [--reps 5] [--steps 16] [--levers ...]
                                                        [--variants bf16,fp32,int8] [--context 128]
    python -m specdec.tools.bench.drafter_levers accept [--tokens 64] [--k 2,4] [--reps 5]

``steps``: per-token decoding step of the drafter with a KV cache (a prompt's worth of
context, then one token at a time), at batch 1 (plain drafting) and batch 6 (an SSD
``Speculate``: six branches drafted as one batch), for each variant: ``bf16`` (today's
drafter), ``fp32``, ``int8`` (``--quantize int8``: int8 weights, float32 activations), and
the levers named with ``--levers``: ``compile`` (``torch.compile`` of the bf16 model's
forward over a static KV cache), ``static`` (the bf16 model over transformers'
``StaticCache`` without compiling). Variants run alternated, ``--reps`` times: every
repetition times every variant before the next repetition starts, so load drift on a shared
machine hits all alike. Prints median and spread of ms per step and the ratio to bf16.

``accept``: loads the bf16 target, decodes the shipped 12 prompts greedily for ``--tokens``
tokens, then for each drafter variant (one at a time in memory) replays greedy speculation
over that output at each k (``replay``: exact for greedy decoding, from one forward of the
draft per prompt). Reports the acceptance rate (accepted /
drafted), tokens per round, and the cost ratio c = draft step / target step, both timed
alternated in this process at batch 1.

Each command prints one JSON document at the end (and progress before it).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import warnings

import torch

from specdec.tools.bench.draftvocab import simulate

DRAFT = "qwen2.5-coder-0.5b-instruct"
TARGET = "qwen2.5-coder-1.5b-instruct"
CONTEXT = 128  # tokens of context before the timed steps (about a shipped prompt)


def load(name: str, variant: str):
    """The model as the drafter would serve it: through ModelRuntime.load (one thread)."""
    from specdec.drafter.config import DrafterConfig
    from specdec.replica.runtime import ModelRuntime
    from specdec.tools.models import installed_path

    path = installed_path(name)
    if path is None:
        raise SystemExit(f"{name} is not installed: run `specdec models install` first")
    dtype = {"fp32": "float32", "int8": "float32"}.get(variant, "bfloat16")
    quantize = "int8" if variant == "int8" else "none"
    cfg = DrafterConfig(role="drafter", model=str(path), dtype=dtype, quantize=quantize, threads=1)
    rt = ModelRuntime(cfg)
    rt.load()
    rt.shutdown()  # the model thread: the steps run here (`drive`)
    return rt


class Stepper:
    """Decoding steps of one model variant: prefill a context, then time single tokens."""

    def __init__(self, name: str, model, static: bool = False, compiled: bool = False):
        self.name = name
        self.model = model
        self.static = static
        self.forward = model.forward
        self.compile_s: float | None = None
        if compiled:
            self.forward = torch.compile(model.forward, dynamic=False)

    def _cache(self, batch: int, length: int):
        from transformers import DynamicCache, StaticCache

        if self.static:
            return StaticCache(config=self.model.config, max_cache_len=length)
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def ms_per_step(self, context: list[int], batch: int, steps: int) -> float:
        """Prefill `context` for `batch` rows, then the mean ms of `steps` one-token steps."""
        ids = torch.tensor([context] * batch)  # [batch, n]
        cache = self._cache(batch, len(context) + steps + 1)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
        position = len(context)
        started = time.perf_counter()
        for _ in range(steps):
            kwargs = {}
            if self.static:  # a static cache needs the step's positions spelled out
                kwargs["cache_position"] = torch.tensor([position])
            out = self.forward(
                input_ids=token, cache=cache, use_cache=True, logits_to_keep=1, **kwargs
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            position += 1
        return (time.perf_counter() - started) * 1e3 / steps


def _spread(values: list[float]) -> dict:
    return {
        "median_ms": round(statistics.median(values), 2),
        "min_ms": round(min(values), 2),
        "max_ms": round(max(values), 2),
        "runs": [round(v, 2) for v in values],
    }


def steps_command(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    context = [(i * 7919) % 150000 for i in range(args.context)]
    steppers = []
    for variant in args.variants:
        steppers.append(Stepper(variant, load(DRAFT, variant).model))
    if steppers[0].name != "bf16":
        raise SystemExit("steps: the first variant must be bf16 (the others are timed against it)")
    bf16 = steppers[0].model
    for lever in args.levers:
        if lever == "static":
            steppers.append(Stepper("bf16 static cache", bf16, static=True))
        elif lever == "compile":
            steppers.append(Stepper("bf16 compiled static", bf16, static=True, compiled=True))
        elif lever == "compile-dynamic":
            steppers.append(Stepper("bf16 compiled", bf16, compiled=True))
        else:
            raise SystemExit(f"unknown lever {lever!r}")
    for s in steppers:  # warm-up (and compilation), not timed in the runs
        started = time.perf_counter()
        for batch in args.batches:
            s.ms_per_step(context, batch, 2)
        s.compile_s = round(time.perf_counter() - started, 1)
        print(f"warm {s.name}: {s.compile_s} s", flush=True)
    times: dict[tuple[str, int], list[float]] = {
        (s.name, b): [] for s in steppers for b in args.batches
    }
    for rep in range(args.reps):
        for batch in args.batches:
            order = steppers[rep % len(steppers) :] + steppers[: rep % len(steppers)]
            for s in order:
                ms = s.ms_per_step(context, batch, args.steps)
                times[(s.name, batch)].append(ms)
                print(f"rep {rep + 1} batch {batch} {s.name:<22} {ms:8.1f} ms/step", flush=True)
    rows = []
    for s in steppers:
        for batch in args.batches:
            base = statistics.median(times[("bf16", batch)])
            row = {"variant": s.name, "batch": batch, **_spread(times[(s.name, batch)])}
            row["vs_bf16"] = round(row["median_ms"] / base, 3)
            row["warmup_s"] = s.compile_s
            rows.append(row)
    return {"command": "steps", "context": args.context, "steps": args.steps, "rows": rows}


def _prompts(tokenizer) -> list[list[int]]:
    from specdec.tools.bench.modes import load_prompts

    out = []
    for p in load_prompts(None):
        if p.messages is not None:
            text = tokenizer.apply_chat_template(
                p.messages, tokenize=False, add_generation_prompt=True
            )
        else:
            text = p.text
        out.append(list(tokenizer(text).input_ids))
    return out


@torch.inference_mode()
def _greedy(model, ids: list[int], n: int, eos: list[int]) -> list[int]:
    from transformers import GenerationConfig

    x = torch.tensor([ids])
    config = GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
    )
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config)
    return out[0, len(ids) :].tolist()


@torch.inference_mode()
def replay(draft, prompt: list[int], target_out: list[int], k: int) -> tuple[int, int, int]:
    """Greedy speculation of `draft` against the target's greedy output: (rounds, drafted,
    accepted).

    Under greedy decoding a round at position p accepts d_1 iff the draft's argmax after
    prompt + out[:p] is out[p], then d_2 iff its argmax after prompt + out[:p+1] is
    out[p+1], and so on: an accepted draft token is the target's token, so every draft
    token that can be accepted is the draft's prediction after the target's own prefix.
    One forward of the draft over prompt + output gives all of them; a round accepts the
    run of positions from p where they equal the target's tokens, at most k, and moves on
    by that plus the target's token (k shrinks at the end as the gateway shrinks it)."""
    ids = torch.tensor([prompt + target_out[:-1]])  # [1, len(prompt) + n - 1]
    logits = draft(input_ids=ids, logits_to_keep=len(target_out)).logits[0]  # [n, vocab]
    hit = (logits.argmax(-1) == torch.tensor(target_out)).tolist()  # [n]
    return simulate(hit, k)


def accept_command(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    target_rt = load(TARGET, "bf16")
    target, eos = target_rt.model, target_rt.eos_token_ids
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_rt.config.model)
    prompts = _prompts(tokenizer)
    started = time.perf_counter()
    outputs = [_greedy(target, p, args.tokens, eos) for p in prompts]
    print(f"target greedy: {time.perf_counter() - started:.0f} s", flush=True)
    context = [(i * 7919) % 150000 for i in range(CONTEXT)]
    target_step = Stepper("target bf16", target)
    target_step.ms_per_step(context, 1, 2)
    rows = []
    for variant in args.variants:
        rt = load(DRAFT, variant)
        draft = Stepper(variant, rt.model)
        draft.ms_per_step(context, 1, 2)
        t_ms, d_ms = [], []
        for _ in range(args.reps):  # alternated: target step, draft step
            t_ms.append(target_step.ms_per_step(context, 1, args.steps))
            d_ms.append(draft.ms_per_step(context, 1, args.steps))
        row: dict = {
            "variant": variant,
            "target_step": _spread(t_ms),
            "draft_step": _spread(d_ms),
            "cost_ratio": round(statistics.median(d_ms) / statistics.median(t_ms), 3),
            "cost_ratio_per_rep": [round(d / t, 3) for d, t in zip(d_ms, t_ms, strict=True)],
        }
        for k in args.k:
            totals = [0, 0, 0]
            for p, out in zip(prompts, outputs, strict=True):
                for i, v in enumerate(replay(rt.model, p, out, k)):
                    totals[i] += v
            rounds, drafted, acc = totals
            row[f"k={k}"] = {
                "acceptance_rate": round(acc / drafted, 4),
                "tokens_per_round": round(sum(len(o) for o in outputs) / rounds, 3),
                "rounds": rounds,
                "drafted": drafted,
                "accepted": acc,
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
        del rt, draft
        gc.collect()
    return {
        "command": "accept",
        "prompts": len(prompts),
        "tokens": args.tokens,
        "generated": sum(len(o) for o in outputs),
        "rows": rows,
    }


def main() -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.drafter_levers")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("steps")
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--steps", type=int, default=16)
    s.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 6])
    s.add_argument("--levers", type=lambda t: [x for x in t.split(",") if x], default=[])
    s.add_argument("--variants", type=lambda t: t.split(","), default=["bf16", "fp32", "int8"])
    s.add_argument("--context", type=int, default=CONTEXT)
    a = sub.add_parser("accept")
    a.add_argument("--tokens", type=int, default=64)
    a.add_argument("--k", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4])
    a.add_argument("--variants", type=lambda t: t.split(","), default=["bf16", "fp32", "int8"])
    a.add_argument("--reps", type=int, default=5)
    a.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    result = steps_command(args) if args.command == "steps" else accept_command(args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
