"""`python -m specdec.tools.bench.llamacpp_exact`: the stack on the llama.cpp engine against
the same GGUF alone through llama.cpp, greedy, on the bench's prompts.

For each prompt, the stack's tokens at k = 0 and with the gateway's defaults are compared
with llama-cpp-python's own `Llama.generate` (one thread, the engine's attention settings:
no flash attention, the cells' type as the replica's --llama-kv-dtype) over the same GGUF.
Where they differ, the first difference is certified or not as a near-tie: the gap between
the two highest logits of llama.cpp alone at that position (a gap within --tie-bound is a
near-tie, which the two runs' different batch layouts may break either way).

Usage (a stack already serving on the llama.cpp engine, `specdec up --drafter-arg
"--engine llama.cpp" --verifier-arg "--engine llama.cpp"`):

    python -m specdec.tools.bench.llamacpp_exact --gateway 127.0.0.1:50051 \
        --target-gguf ~/.cache/specdec/models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct.gguf \
        --tokenizer ~/.cache/specdec/models/qwen2.5-coder-1.5b-instruct/model --out exact.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.llamacpp_exact")
    p.add_argument("--gateway", required=True, help="the stack's gateway host:port")
    p.add_argument("--target-gguf", required=True, help="the verifier's GGUF file")
    p.add_argument("--tokenizer", required=True, help="the target's model folder")
    p.add_argument("--prompt-set", default="all", help="the bench's shipped prompt set")
    p.add_argument("--num-prompts", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--kv-dtype", choices=("f16", "f32"), default="f16")
    p.add_argument("--tie-bound", type=float, default=0.1, help="a near-tie's largest gap")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)

    import llama_cpp
    import numpy as np
    from transformers import AutoTokenizer

    from specdec.replica.llamacpp import KV_TYPES
    from specdec.sdk import Client
    from specdec.tools.bench.modes import encode_prompt, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = load_prompts(None, args.prompt_set)[: args.num_prompts]
    n = args.max_new_tokens
    alone = llama_cpp.Llama(
        model_path=args.target_gguf,
        n_ctx=8192,
        n_threads=1,
        flash_attn=False,
        type_k=KV_TYPES[args.kv_dtype],
        type_v=KV_TYPES[args.kv_dtype],
        logits_all=True,
        verbose=False,
    )

    def reference(ids: list[int]) -> list[int]:
        out: list[int] = []
        for token in alone.generate(ids, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out

    def gap_at(ids: list[int]) -> float:
        alone.reset()
        alone.eval(ids)
        top = np.sort(np.asarray(alone.scores[alone.n_tokens - 1]))[-2:]
        return float(top[1] - top[0])

    rows = []
    certified = True
    with Client(args.gateway, timeout=600) as client:
        for prompt in prompts:
            ids = list(encode_prompt(tokenizer, prompt))
            expected = reference(ids)
            row: dict = {"kind": prompt.kind, "prompt_tokens": len(ids)}
            modes: tuple[tuple[str, dict[str, Any]], ...] = (("k=0", {"k": 0}), ("defaults", {}))
            for mode, options in modes:
                got = list(client.generate(token_ids=ids, max_new_tokens=n, **options).tokens)
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None
                )
                gap = None if first is None else gap_at(ids + expected[:first])
                tie = first is None or (gap is not None and gap <= args.tie_bound)
                certified &= tie
                row[mode] = {
                    "identical": got == expected,
                    "first_difference": first,
                    "top2_gap": gap,
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"rows": rows, "tie_bound": args.tie_bound}, indent=1) + "\n"
        )
    print("every difference a near-tie" if certified else "a difference is not a near-tie")
    return 0 if certified else 1


if __name__ == "__main__":
    sys.exit(main())
