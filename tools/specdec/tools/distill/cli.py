"""`specdec distill`: train a drafter toward its target; `specdec distill prompts`.

    specdec distill --target-model T --draft-model D (--data DIR | --prompts FILE.jsonl)
                    --out DIR [--steps N] [--lora-rank R | --train-layers last:4] ...
    specdec distill --head --target-model T (--data DIR | --prompts FILE.jsonl | --text PATH)
                    --out DIR [--steps N] [--ttt] ...
    specdec distill prompts --out FILE.jsonl [--count N]

The new drafter is written to --out as a plain transformers checkpoint with a version id
in specdec_version.json: serve it with `specdec serve drafter --model DIR`; the drafter
reports the version in Info and in its metrics, and the gateway can send a share of new
sessions to it (--drafter-canary VERSION:PERCENT). See docs/features/distill.md.

With --head it trains a draft head on the target's features instead (EAGLE,
specdec.tools.distill.head): a head folder with its version id, served with
`specdec serve drafter --model T --head DIR` (docs/concepts/heads.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from specdec.sdk.progress import add_progress_argument, progress_enabled
from specdec.tools.distill.data import (
    Sequence,
    batch_generate,
    load_recordings,
    split,
    write_rows,
)
from specdec.tools.distill.prompts import bench_prompts, build_prompts, write_prompts


def add_distill_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "distill",
        help="train a drafter toward the target from recorded traffic or a prompt file",
        description="train a drafter toward the target from recorded traffic or a prompt "
        "file (`specdec distill prompts` writes a prompt file)",
    )
    sub = p.add_subparsers(dest="distill_command", metavar="{prompts}")
    pp = sub.add_parser(
        "prompts",
        help="write distillation prompts built from the Python standard library's source",
    )
    pp.add_argument("--out", required=True, help="JSONL prompt file to write")
    pp.add_argument("--count", type=int, default=200, help="prompts (code, prose, chat in turn)")
    pp.add_argument("--seed", type=int, default=0, help="seed of the sample")
    pp.add_argument(
        "--writer",
        help="a model directory: prose and chat prompts are general text this model writes "
        "(openings to go on with, requests to an assistant) instead of the standard "
        "library's documentation; code prompts stay the standard library's",
    )
    pp.add_argument("--device", default="cpu", help="--writer: cpu, cuda or cuda:N")
    pp.add_argument(
        "--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
        help="--writer: the writer's dtype",
    )  # fmt: skip
    pp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_progress_argument(pp)
    pp.set_defaults(func=run_prompts)

    p.add_argument(
        "--head",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="train a draft head on the target's features (EAGLE) instead of a draft model: "
        "writes a head folder for `specdec serve drafter --head` (docs/concepts/heads.md)",
    )
    p.add_argument("--target-model", help="the target (a model directory)")
    p.add_argument("--draft-model", help="the drafter to start from (a model directory)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="a directory of gateway recordings (--record)")
    src.add_argument(
        "--prompts", help="a JSONL prompt file (the bench's format), run through the target"
    )
    src.add_argument(
        "--text",
        help="--head: a local text file or folder (e.g. source code for a code model), cut "
        "into --max-length pieces",
    )
    p.add_argument("--text-glob", default="*.py", help="--text folder: the files read")
    p.add_argument(
        "--feature-layer",
        type=int,
        help="--head: the target's decoder layer the head reads (default: the last)",
    )
    p.add_argument(
        "--feature-format",
        choices=["float32", "bfloat16", "float16"],
        help="--head: the features' wire format (default: the target's dtype, --teacher-dtype)",
    )
    p.add_argument(
        "--feature-weight", type=float, default=1.0,
        help="--head: weight of the smooth-L1 regression of the next feature",
    )  # fmt: skip
    p.add_argument(
        "--token-weight", type=float, default=0.1,
        help="--head: weight of the cross-entropy of the target's next-token distribution",
    )  # fmt: skip
    p.add_argument(
        "--ttt",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="--head: training-time test, a second step that feeds the head its own "
        "predicted feature (what a draft's second token reads)",
    )
    p.add_argument(
        "--draft-vocab", type=int, default=0,
        help="--head: train the token loss over the first N token ids only, the subset the "
        "drafter keeps with the same --draft-vocab N (0: the whole vocabulary); the output "
        "layer is most of a step's cost",
    )  # fmt: skip
    p.add_argument("--out", help="directory of the new drafter (and its training state)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--ce-weight", type=float, default=1.0, help="weight of sequence-level KD")
    p.add_argument("--kl-weight", type=float, default=1.0, help="weight of the top-m KL")
    p.add_argument("--top-m", type=int, default=20, help="target tokens kept per position (KL)")
    p.add_argument(
        "--train-layers", default="all", help="decoder layers that train: all, last:N, A-B, A,B"
    )
    p.add_argument(
        "--train-head",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="train the output head too",
    )
    p.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA (peft) of this rank; 0: full fine-tuning"
    )
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha")
    p.add_argument(
        "--quant-aware",
        default="none",
        choices=["none", "int8"],
        help="int8: train through the int8 drafter's rounding (--quantize int8), so that "
        "the distilled drafter is at its best quantized; held-out agreement is also "
        "reported for the int8 form",
    )
    p.add_argument("--holdout", type=float, default=0.2, help="share of sequences held out")
    p.add_argument("--max-new-tokens", type=int, default=128, help="--prompts: tokens generated")
    p.add_argument(
        "--on-policy",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="--prompts: the drafter continues each prompt (greedy) and the target labels "
        "every position of those sequences (its greedy token and top-m, a teacher forward): "
        "training where the drafter itself goes",
    )
    p.add_argument(
        "--gen-batch-size",
        type=int,
        default=8,
        help="--prompts: prompts the target continues together (left-padded)",
    )
    p.add_argument("--max-length", type=int, default=1024, help="tokens per training sequence")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="continue OUT's checkpoint; with --head: reuse the target outputs for --prompts "
        "that an interrupted run into OUT collected",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--teacher-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="the target's dtype (default: --dtype)",
    )
    p.add_argument("--eval-temperature", type=float, default=1.0, help="for sum(min(p, q))")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--version", help="version id (default: distill-<sha256 of the weights>)")
    p.add_argument("--seed", type=int, default=0)
    add_progress_argument(p)
    p.set_defaults(func=run_distill)
    return p


def run_prompts(args: argparse.Namespace) -> int:
    bench = bench_prompts()
    rows = build_prompts(args.count, args.seed, exclude=bench)
    if args.writer:
        import torch

        from specdec.tools.distill.written import write_prompts_with

        if args.threads:
            torch.set_num_threads(args.threads)
        banned = [r.get("prompt") or r["messages"][-1]["content"] for r in bench]
        try:
            written = iter(
                write_prompts_with(
                    args.writer,
                    [r["kind"] for r in rows if r["kind"] != "code"],
                    args.seed,
                    banned,
                    device=args.device,
                    dtype=args.dtype,
                    progress=progress_enabled(args),
                )
            )
        except ValueError as e:
            print(f"specdec distill prompts: {e}", file=sys.stderr)
            return 2
        rows = [r if r["kind"] == "code" else next(written) for r in rows]
    write_prompts(args.out, rows)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("code", "prose", "chat")}
    print(f"wrote {len(rows)} prompts to {args.out} ({kinds})")
    return 0


def prompt_outputs(args, tokenizer, note: dict) -> list[Sequence]:
    """--prompts: the greedy continuation of each prompt by the target, or with
    --on-policy by the drafter (cached in OUT)."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from specdec.tools.bench.modes import encode_prompt, load_prompts
    from specdec.tools.distill.train import DTYPES

    cache = Path(args.out) / "distill" / "data.jsonl"
    if cache.exists() and args.resume:
        return load_recordings(cache.parent, len(tokenizer))
    started = time.perf_counter()
    prompts = load_prompts(args.prompts)
    path, dtype = (
        (args.draft_model, args.dtype)
        if args.on_policy
        else (args.target_model, args.teacher_dtype or args.dtype)
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(args.device).eval()
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    limit = max(1, args.max_length - args.max_new_tokens)
    encoded = [encode_prompt(tokenizer, prompt)[-limit:] for prompt in prompts]
    outputs: list[list[int]] = [[] for _ in encoded]
    size = args.gen_batch_size
    # Prompts of similar length share a batch (less padding), in the file's order otherwise.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    desc = "drafter outputs" if args.on_policy else "target outputs"
    with tqdm(total=len(encoded), desc=desc, disable=not progress_enabled(args)) as bar:
        for group in groups:
            batch = batch_generate(
                model, [encoded[i] for i in group], args.device, args.max_new_tokens, eos, pad
            )
            for i, ids in zip(group, batch, strict=True):
                outputs[i] = ids
            bar.update(len(group))
    out = [
        Sequence(tuple(ids), tuple(o), on_policy=args.on_policy)
        for ids, o in zip(encoded, outputs, strict=True)
    ]
    note["generated_tokens"] = sum(len(s.output_ids) for s in out)
    note["generation_minutes"] = (time.perf_counter() - started) / 60
    note["generated_by"] = "drafter" if args.on_policy else "target"
    write_rows(cache, out, str(args.target_model))
    del model
    return out


def read_data(args: argparse.Namespace, tokenizer) -> tuple[list, list, dict]:
    """(train, held-out, a note of where they came from): the sequences of --data, of
    --prompts (the target's outputs) or of --text, split by --holdout and --seed."""
    from specdec.tools.distill.data import load_text

    note: dict = {}
    if args.data:
        sequences = load_recordings(args.data, len(tokenizer))
        note = {"source": "recordings", "data": str(args.data)}
    elif args.prompts:
        note = {"source": "prompts", "prompts": str(args.prompts)}
        sequences = prompt_outputs(args, tokenizer, note)
    else:
        sequences = load_text(args.text, args.text_glob, tokenizer, args.max_length)
        note = {"source": "text", "text": str(args.text), "glob": args.text_glob}
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {args.holdout}")
    train, held = split(sequences, args.holdout, args.seed)
    return train, held, note


def run_distill(args: argparse.Namespace) -> int:
    try:
        return _run_distill(args)
    except ValueError as e:  # bad flags or data, named in the message
        print(f"specdec distill: {e}", file=sys.stderr)
        return 2


def _run_distill(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from specdec.tools.distill.train import TrainSettings, distill

    if args.head:
        return _run_head(args)
    for flag in ("text", "draft_vocab"):
        if getattr(args, flag):
            print(f"specdec distill: --{flag.replace('_', '-')} trains heads only (--head)",
                  file=sys.stderr)  # fmt: skip
            return 2
    missing = [f for f in ("target_model", "draft_model", "out") if not getattr(args, f)]
    if missing or not (args.data or args.prompts):
        names = [f"--{f.replace('_', '-')}" for f in missing]
        if not (args.data or args.prompts):
            names.append("--data or --prompts")
        print(f"specdec distill: missing {', '.join(names)}", file=sys.stderr)
        return 2
    if args.on_policy and not args.prompts:
        print("specdec distill: --on-policy needs --prompts (the drafter continues them)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.gen_batch_size < 1:
        why = f"--gen-batch-size must be >= 1, got {args.gen_batch_size}"
        print(f"specdec distill: {why}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    train, held, note = read_data(args, AutoTokenizer.from_pretrained(args.target_model))
    # Every field of TrainSettings is the flag of the same name.
    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in fields(TrainSettings)})
    report = distill(
        target_path=args.target_model,
        draft_path=args.draft_model,
        train=train,
        held=held,
        out=Path(args.out),
        settings=settings,
        device=args.device,
        dtype=args.dtype,
        teacher_dtype=args.teacher_dtype,
        resume=args.resume,
        save_every=args.save_every,
        eval_temperature=args.eval_temperature,
        version=args.version,
        progress=progress_enabled(args),
        data_note=note,
    )
    h = report["held_out"]
    print(json.dumps({"version": report["version"], "held_out": h, "cost": report["cost"]}))
    print(
        f"held-out greedy agreement {h['before']['greedy_agreement']:.3f} -> "
        f"{h['after']['greedy_agreement']:.3f}, sum(min(p,q)) {h['before']['sum_min_pq']:.3f} "
        f"-> {h['after']['sum_min_pq']:.3f} over {h['positions']} positions; "
        f"version {report['version']} in {args.out}"
    )
    return 0


# Flags of a draft model's distillation that a head's has not: refused with --head when
# set to anything but their default.
NOT_FOR_HEADS = (
    "draft_model", "ce_weight", "kl_weight", "top_m", "train_layers", "train_head",
    "lora_rank", "lora_alpha", "quant_aware", "on_policy", "eval_temperature",
)  # fmt: skip


def _run_head(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from specdec.tools.distill.head import HeadSettings, check_target, train_head

    defaults = _defaults(args)
    given = [f"--{n.replace('_', '-')}" for n in NOT_FOR_HEADS if getattr(args, n) != defaults[n]]
    if given:
        print(f"specdec distill --head: {', '.join(given)} is a draft model's, not a head's",
              file=sys.stderr)  # fmt: skip
        return 2
    missing = [f"--{f.replace('_', '-')}" for f in ("target_model", "out") if not getattr(args, f)]
    if not (args.data or args.prompts or args.text):
        missing.append("--data, --prompts or --text")
    if missing:
        print(f"specdec distill --head: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    check_target(args.target_model)
    if args.threads:
        torch.set_num_threads(args.threads)
    train, held, note = read_data(args, AutoTokenizer.from_pretrained(args.target_model))
    settings = HeadSettings(**{f.name: getattr(args, f.name) for f in fields(HeadSettings)})
    report = train_head(
        target_path=args.target_model,
        train=train,
        held=held,
        out=Path(args.out),
        settings=settings,
        feature_layer=args.feature_layer,
        feature_format=args.feature_format,
        device=args.device,
        dtype=args.dtype,
        teacher_dtype=args.teacher_dtype,
        version=args.version,
        progress=progress_enabled(args),
        data_note=note,
    )
    h = report["held_out"]
    print(json.dumps({k: report[k] for k in ("version", "held_out", "cost", "final_losses")}))
    b, a = h["before"], h["after"]
    print(
        f"held-out greedy agreement {b['greedy_agreement']:.3f} -> {a['greedy_agreement']:.3f} "
        f"(fed its own feature: {b['greedy_agreement_own_feature']:.3f} -> "
        f"{a['greedy_agreement_own_feature']:.3f}) over {h['positions']} positions; head "
        f"{report['version']} in {args.out}: specdec serve drafter --model "
        f"{args.target_model} --head {args.out}"
        + (f" --draft-vocab {settings.draft_vocab}" if settings.draft_vocab else "")
    )
    return 0


def _defaults(args: argparse.Namespace) -> dict:
    """The distill parser's defaults (what a flag left unset holds)."""
    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers())
    return vars(parser.parse_args(["distill"]))
