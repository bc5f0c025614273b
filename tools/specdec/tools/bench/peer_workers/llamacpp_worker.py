"""llama.cpp (llama-cpp-python) as a peer of `specdec bench`: one mode of one job.

Runs inside the peer's own virtualenv (.cache/peers/bench-llamacpp), never imports specdec.
Reads the job (JSON) on stdin, writes the answer (JSON, one line) on stdout; the protocol is
described in specdec.tools.bench.peers.

Modes: "target" (the target GGUF alone), "ngram k=K" (llama-cpp-python's
LlamaPromptLookupDecoding, K tokens per draft) and "draft k=K" (a LlamaDraftModel that runs
the draft GGUF greedily for K tokens, keeping its KV cache across rounds).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from protocol import parse_mode, serve


def run(job: dict) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    kind, k = parse_mode(job["mode"])
    threads = int(job["threads"])
    n_new = int(job["max_new_tokens"])

    class Counting(LlamaDraftModel):
        """Wraps a drafter and counts its proposals and how many of them the target kept:
        each call's input is the previous call's input, the accepted part of its draft and
        one token of the target's."""

        def __init__(self, inner):
            self.inner = inner
            self.reset_counts()

        def reset_counts(self):
            self.proposed = self.accepted = 0
            self.last: tuple[int, list[int]] | None = None

        def settle(self, ids) -> None:
            if self.last is None:
                return
            start, draft = self.last
            seen = list(ids[start : start + len(draft)])
            self.proposed += len(seen)
            for a, b in zip(seen, draft, strict=False):
                if a != b:
                    break
                self.accepted += 1
            self.last = None

        def __call__(self, input_ids, /, **kwargs):
            self.settle(input_ids)
            draft = self.inner(input_ids)
            self.last = (len(input_ids), [int(t) for t in draft])
            return draft

    class DraftModel(LlamaDraftModel):
        """The draft GGUF proposing k tokens greedily; its generate() reuses the longest
        common prefix of its KV cache, so each round evaluates only the new tokens."""

        def __init__(self, llm, k: int):
            self.llm, self.k = llm, k

        def __call__(self, input_ids, /, **kwargs):
            out = []
            gen = self.llm.generate([int(t) for t in input_ids], temp=0.0, reset=True)
            try:
                for tok in gen:
                    out.append(tok)
                    if len(out) == self.k or self.llm.token_eos() == tok:
                        break
            finally:
                gen.close()
            return np.array(out, dtype=np.intc)

    common: dict[str, Any] = dict(n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    # The context: the longest prompt, the new tokens and a draft's overshoot.
    probe = Llama(model_path=job["target_gguf"], vocab_only=True, verbose=False)
    prompts = [
        probe.tokenize(p.encode("utf-8"), add_bos=True, special=True) for p in job["prompts"]
    ]
    del probe
    n_ctx = max(len(p) for p in prompts) + n_new + 2 * max(k, 1) + 16
    n_ctx = max(512, (n_ctx + 255) // 256 * 256)

    drafter = None
    draft_llm = None
    if kind == "ngram":
        # n-grams of 3 down to 1 tokens, as the vLLM worker's prompt_lookup_max/min
        n = int(job.get("ngram", {}).get("prompt_lookup_max", 3))
        drafter = Counting(LlamaPromptLookupDecoding(max_ngram_size=n, num_pred_tokens=k))
    elif kind == "draft":
        draft_llm = Llama(model_path=job["draft_gguf"], n_ctx=n_ctx, **common)
        drafter = Counting(DraftModel(draft_llm, k))
    llm = Llama(model_path=job["target_gguf"], n_ctx=n_ctx, draft_model=drafter, **common)
    eog = set()
    for t in range(llm.n_vocab()):
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), t):
            eog.add(t)

    def generate(ids: list[int]) -> tuple[list[int], float, float | None]:
        llm.reset()  # no prefix reuse across prompts: every run prefills its whole prompt
        if draft_llm is not None:
            draft_llm.reset()
        if drafter is not None:
            drafter.reset_counts()
        out: list[int] = []
        started = time.perf_counter()
        gen = llm.generate(ids, temp=0.0, reset=True)
        try:
            for tok in gen:
                out.append(int(tok))
                if len(out) >= n_new or tok in eog:
                    break
        finally:
            gen.close()
        seconds = time.perf_counter() - started
        acceptance = None
        if drafter is not None:
            drafter.settle([*ids, *out])
            acceptance = drafter.accepted / drafter.proposed if drafter.proposed else None
        return out, seconds, acceptance

    generate(prompts[0])  # the warm-up
    results = []
    for i, ids in enumerate(prompts):
        out, seconds, acceptance = generate(ids)
        row = {"prompt_index": i, "token_ids": out, "seconds": seconds}
        if acceptance is not None and drafter is not None:
            row["acceptance"] = acceptance
            row["proposed"] = drafter.proposed
            row["accepted"] = drafter.accepted
        results.append(row)
    return {
        "peer": job.get("peer", "llamacpp"),
        "version": f"llama-cpp-python {llama_cpp.__version__}",
        "mode": job["mode"],
        "n_ctx": n_ctx,
        "results": results,
    }


if __name__ == "__main__":
    sys.exit(serve(run))
