"""vLLM's CPU build, shape by shape: the peer column of `specdec bench --shapes`.

Runs inside the peer's own virtualenv (.cache/peers/bench-vllm, `make peer-bench-install`),
never imports specdec. vLLM exposes no forward over a given cache, so a forward of n
tokens after a cached prefix is measured as vLLM runs one: `rows` prompts that share a
prefix of --prefix tokens (cached by vLLM's prefix caching, warmed first), each followed by
n fresh tokens (new ones every repetition, so no suffix is ever cached), generating one
token. The median wall time of that `generate` is the forward of rows x n new tokens plus
vLLM's scheduling and its one-token sampling, which is milliseconds against forwards of
hundreds.

    .cache/peers/bench-vllm/bin/python tools/specdec/tools/bench/peer_workers/vllm_shapes.py \\
        --model ~/.cache/specdec/models/qwen2.5-coder-1.5b-instruct/model --threads 1

Prints the table in the format of `specdec bench --shapes` (milliseconds, and in brackets
over the one-token one-row forward) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the target's safetensors directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="1,4,9,16")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    tokens = [int(x) for x in args.tokens.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.prefix + max(tokens) + 8,
        seed=0,
        enable_prefix_caching=True,
        max_num_batched_tokens=max(512, max(rows) * (args.prefix + max(tokens))),
        max_num_seqs=max(rows),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(0)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = min(1000, int(json.load(f)["vocab_size"]))
    # ordinary token ids: what a forward computes does not depend on which
    prefix = [rng.randrange(vocab // 10, vocab) for _ in range(args.prefix)]

    def fresh(n: int) -> list[int]:
        return [rng.randrange(vocab // 10, vocab) for _ in range(n)]

    def run(r: int, n: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=prefix + fresh(n)) for _ in range(r)]
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    run(1, 1)  # the prefix, now cached; the warm-up
    ms: dict[str, float] = {}
    for r in rows:
        for n in tokens:
            run(r, n)  # warm-up of the shape
            ms[f"{r}x{n}"] = round(
                statistics.median(run(r, n) for _ in range(args.repeats)) * 1e3, 2
            )
    step = ms["1x1"]
    head = "| layout | " + " | ".join(f"{n} tok x {r}" for r in rows for n in tokens) + " |"
    cells = " | ".join(
        f"{ms[f'{r}x{n}']:.0f} ms ({ms[f'{r}x{n}'] / step:.2f})" for r in rows for n in tokens
    )
    print(head)
    print("|---|" + "--:|" * (len(rows) * len(tokens)))
    print(f"| vLLM {vllm.__version__} {args.dtype} | {cells} |")
    print(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "dtype": args.dtype,
                "threads": args.threads,
                "prefix": args.prefix,
                "ms": ms,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
