"""`specdec bench --shapes`: what one forward of the target costs, shape by shape.

The cost model prices a round by the verifier's forward time as a function of the tokens
it feeds; this table is that function measured directly, in every weight layout a replica
can run: float32 and bfloat16, each with plain and packed linear weights
(specdec.replica.packing). Per variant and shape (tokens per row x rows), the median of a
few forwards of batch `rows`, each row feeding `tokens` new tokens after a cached prefix
of --shape-prefix tokens, and that time over the same variant's one-token, one-row step:
"verifying 4 tokens costs 1.04 target steps".

One model is loaded in float32; each variant is made from it (a cast copy, the linear
layers packed in place and unpacked again after), so every row is the same weights. The
rows of a batch share one prefix (a cache of `rows` copies): the cost of a batched forward
over caches already in place, with no gather.

Output: a markdown table on stdout, ``results.json`` and ``results.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = (
    "float32",
    "float32+packed",
    "bfloat16",
    "bfloat16+packed",
    "float32+compiled",
    "bfloat16+compiled",
    "llama.cpp",
)
DEFAULT_VARIANTS = VARIANTS[:4]  # compiling the target takes minutes a shape on a CPU


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "--shapes", "the target's forward time per shape (tools/specdec/tools/bench/shapes.py)"
    )
    g.add_argument(
        "--shapes",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="time the target's forwards per shape (tokens per row x rows) in each weight "
        "layout: float32 and bfloat16, plain and packed",
    )
    g.add_argument("--shape-tokens", default="1,4,9,16", help="new tokens per row")
    g.add_argument("--shape-rows", default="1,8", help="rows (sessions) per forward")
    g.add_argument("--shape-prefix", type=int, default=128, help="cached tokens before them")
    g.add_argument(
        "--shape-variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"layouts to time, of {', '.join(VARIANTS)} (+compiled: the decoder through "
        "--compile's path, specdec.replica.compiled, inputs padded to their bucket; "
        "llama.cpp: the target's GGUF as shipped through the llama.cpp engine's context, "
        "specdec.replica.llamacpp)",
    )
    g.add_argument("--shape-repeats", type=int, default=3, help="timed forwards per shape")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def time_shapes(
    model, tokens: list[int], rows: list[int], prefix: int, repeats: int, compiled: bool = False
):
    """{(rows, tokens): median ms} of the model's forwards (batch-1 prefix, expanded).
    compiled: through --compile's compiled decoder (inputs right-padded to their bucket and
    masked, then the output layer on the real rows), compiling each shape in its warm-up."""
    import torch
    from transformers import DynamicCache

    forward = model
    if compiled:
        from specdec.replica.compiled import Compiled

        forward = _compiled_forward(model, Compiled(model, torch.device("cpu"), max(tokens)))

    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = (torch.arange(prefix + max(tokens)) * 7919 + 11) % vocab
    out: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        base = DynamicCache(config=model.config)
        model(input_ids=ids[:prefix].view(1, -1), cache=base, use_cache=True)
        for r in rows:
            # r copies of the prefix, in place before timing (Any: transformers types a layer
            # as a union of kinds, some without keys; this cache's are full attention)
            cache: Any = copy.deepcopy(base)
            for layer in cache.layers:
                layer.keys = layer.keys.expand(r, -1, -1, -1).contiguous()
                layer.values = layer.values.expand(r, -1, -1, -1).contiguous()
            for n in tokens:
                x = ids[prefix : prefix + n].view(1, n).expand(r, n)
                samples = []
                for i in range(repeats + 1):
                    t0 = time.perf_counter()
                    forward(input_ids=x, cache=cache, use_cache=True)
                    took = time.perf_counter() - t0
                    cache.crop(prefix - cache.get_seq_length())  # back to the prefix
                    if i:  # the first is a warm-up
                        samples.append(took)
                out[(r, n)] = round(statistics.median(samples) * 1e3, 2)
    return out


def _compiled_forward(model, compiled):
    """model(input_ids, cache) as --compile runs it: inputs padded to the bucket, the pads
    masked, the compiled decoder, the output layer on the real positions."""
    import torch

    head = model.get_output_embeddings()

    def forward(input_ids, cache, use_cache):
        r, n = input_ids.shape
        width = cache.get_seq_length()
        bucket = compiled.bucket(n)
        ids = torch.zeros(r, bucket, dtype=torch.long)
        ids[:, :n] = input_ids
        mask = torch.zeros(r, width + bucket, dtype=torch.long)
        mask[:, : width + n] = 1
        positions = (width + torch.arange(bucket))[None].expand(r, bucket).contiguous()
        hidden = compiled(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)
        if bucket > n:
            cache.crop(n - bucket)  # the pads' slots
        return head(hidden[:, :n])

    return forward


def llama_shapes(args: argparse.Namespace, tokens: list[int], rows: list[int]) -> dict:
    """The llama.cpp engine's table row: the target's GGUF (as `--engine llama.cpp` finds
    it) in a context of the engine's settings, with the torch row's threads."""
    import torch

    from specdec.replica.llamacpp import LlamaContext, available, find_gguf

    missing = available()
    if missing:
        raise SystemExit(f"--shape-variants llama.cpp: {missing}")
    gguf = find_gguf(args.target_model, args.target_gguf_file)
    print(f"timing llama.cpp ({gguf.name}) ...", flush=True)
    cells = args.shape_prefix + max(tokens)
    context = LlamaContext(
        gguf, cells * max(rows) + 256, max(rows) * max(tokens) + 64, torch.get_num_threads()
    )
    try:
        return context.time_shapes(tokens, rows, args.shape_prefix, args.shape_repeats)
    finally:
        context.close()


def table(results: dict, tokens: list[int], rows: list[int]) -> str:
    head = "| layout | " + " | ".join(f"{n} tok x {r}" for r in rows for n in tokens) + " |"
    lines = [head, "|---|" + "--:|" * (len(rows) * len(tokens))]
    for variant, ms in results.items():
        step = ms[(1, 1)]  # run_shapes asks for it
        cells = [f"{ms[(r, n)]:.0f} ms ({ms[(r, n)] / step:.2f})" for r in rows for n in tokens]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_shapes(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.replica import packing
    from specdec.replica.calibrate import cast_copy
    from specdec.replica.cpus import cpu_info
    from specdec.replica.loading import set_threads
    from specdec.tools.models import resolve_models

    problem = resolve_models(args, "bench")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    variants = [v for v in args.shape_variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        print(f"--shape-variants: unknown {sorted(unknown)} (known: {VARIANTS})", file=sys.stderr)
        return 2
    if any(v.endswith("+packed") for v in variants) and packing.available(torch.device("cpu")):
        print(f"--shapes: {packing.available(torch.device('cpu'))}", file=sys.stderr)
        return 2
    tokens, rows = _ints(args.shape_tokens), _ints(args.shape_rows)
    if 1 not in tokens or 1 not in rows:
        print(
            "--shapes: --shape-tokens and --shape-rows must include 1 (the step)", file=sys.stderr
        )
        return 2
    set_threads(args.target_threads)
    results: dict[str, dict[tuple[int, int], float]] = {}
    if "llama.cpp" in variants:
        variants.remove("llama.cpp")
        results["llama.cpp"] = llama_shapes(args, tokens, rows)
    kwargs = {"gguf_file": args.target_gguf_file} if args.target_gguf_file else {}
    fp32 = None
    if variants:
        print(f"loading {args.target_model} (float32) ...", flush=True)
        fp32 = AutoModelForCausalLM.from_pretrained(
            args.target_model, dtype=torch.float32, **kwargs
        )
        fp32.eval()
    for variant in variants:
        assert fp32 is not None  # loaded above for the variants
        dtype, _, how = variant.partition("+")
        model = fp32 if dtype == "float32" else cast_copy(fp32, getattr(torch, dtype))
        if how == "packed":
            packing.pack_linears(model)
        print(f"timing {variant} ...", flush=True)
        results[variant] = time_shapes(
            model, tokens, rows, args.shape_prefix, args.shape_repeats, how == "compiled"
        )
        if model is fp32 and how == "packed":
            packing.unpack_linears(fp32)
        del model
    cpu = cpu_info()
    text = (
        f"Target {args.target_model}, {torch.get_num_threads()} torch threads, "
        f"{cpu.describe()}, prefix {args.shape_prefix} tokens. Each cell: the median "
        f"forward time and, in brackets, that over the same layout's 1-token 1-row step.\n\n"
        + table(results, tokens, rows)
    )
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {
                "target": args.target_model,
                "threads": torch.get_num_threads(),
                "cpu": cpu.describe(),
                "prefix": args.shape_prefix,
                "ms": {v: {f"{r}x{n}": t for (r, n), t in ms.items()} for v, ms in results.items()},
            },
            indent=1,
        )
    )
    return 0
