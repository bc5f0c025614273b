"""Memory of one KV engine holding SESSIONS sessions of TOKENS tokens, and what one batched
decode forward over all of them adds (peak RSS), on a model with a real model's KV shape.

    python -m specdec.tools.bench.kv_memory dense|paged [--sessions 8] [--tokens 2048]
        [--dtype bfloat16] [--model-dir DIR]

The model (built once into --model-dir) has the Qwen2.5-Coder 1.5B target's KV shape (28
layers, 2 KV heads of 128) but a narrow hidden size (256), so weights and activations are
small next to the KV; its numbers are the engines' KV, not the model's. Run each engine in
its own process (peak RSS is per process). Prints one JSON line: the sessions' resident
KV (dense: their DynamicCaches' tensors; paged: the pool's, and the blocks in use), peak
RSS before the forward and after it, the rise, and the median time of --steps more such
forwards (alternate the engines' processes to compare them on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

from specdec.replica.batching import ForwardRequest
from specdec.replica.runtime import ModelRuntime
from specdec.verifier.config import VerifierConfig

# The Qwen2.5-Coder 1.5B target's KV shape; a narrow model around it.
SHAPE = {
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_attention_heads": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=("dense", "paged"))
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=5, help="decode forwards timed after")
    parser.add_argument("--model-dir", default="/tmp/specdec-kv-shaped")
    a = parser.parse_args()
    model = Path(a.model_dir)
    if not (model / "config.json").exists():
        from specdec.tools.tinymodels import build_shaped_model

        build_shaped_model(model, SHAPE, name="kv-shaped")
    cfg = VerifierConfig(
        role="verifier",
        model=str(model),
        dtype=a.dtype,
        threads=1,
        engine=a.engine,
        cost_probe=False,
        max_cached_tokens=a.sessions * (a.tokens + a.steps + 8),
        max_batch_size=a.sessions,
    )
    rt = ModelRuntime(cfg)
    rt.load()
    sessions = []
    for i in range(a.sessions):
        s = rt.ready_store.acquire(f"s{i}", 0, 0, a.tokens + a.steps + 1)
        rt.forward(s, [(7 * i + 13 * j) % 200 + 5 for j in range(a.tokens)], keep=1)
        sessions.append(s)
    extra = rt.ready_store.kv_footprint()  # the paged store's blocks too
    resident = extra.pop("kv_bytes")
    before = _peak_mb()
    rt._run_batch([ForwardRequest(s, [9], 1, False) for s in sessions])
    after = _peak_mb()
    times = []
    for _ in range(a.steps):  # more decode steps of all sessions, timed
        started = time.perf_counter()
        rt._run_batch([ForwardRequest(s, [9], 1, False) for s in sessions])
        times.append(time.perf_counter() - started)
    rt.shutdown()
    print(
        json.dumps(
            {
                "engine": a.engine,
                "sessions": a.sessions,
                "tokens": a.tokens,
                "dtype": a.dtype,
                "resident_kv_mb": round(resident / 2**20, 1),
                **extra,
                "peak_rss_before_forward_mb": round(before),
                "peak_rss_after_forward_mb": round(after),
                "forward_rise_mb": round(after - before),
                "decode_forward_ms": round(statistics.median(times) * 1e3, 1) if times else None,
            }
        )
    )


if __name__ == "__main__":
    main()
