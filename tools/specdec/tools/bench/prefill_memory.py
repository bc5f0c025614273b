"""Peak RSS of one prefill on the real drafter (0.5B, bf16): all logits rows in one forward
(the old behaviour: keep=None, --prefill-chunk 0) against one row in 512-token chunks.

    python -m specdec.tools.bench.prefill_memory old|new TOKENS [MODEL_NAME [THREADS]]

THREADS (default 1): torch threads; peak memory does not depend on it, the time does.

Run each mode in its own process (peak RSS is per process).
"""

import json
import resource
import sys
import time

from specdec.drafter.config import DrafterConfig
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime
from specdec.tools.models import installed_path


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    path = str(installed_path(sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-0.5b-instruct"))
    cfg = DrafterConfig(
        role="drafter",
        model=path,
        dtype="bfloat16",
        threads=int(sys.argv[4]) if len(sys.argv) > 4 else 1,
        max_cached_tokens=65536,
        prefill_chunk=0 if mode == "old" else 512,
    )
    rt = ModelRuntime(cfg)
    rt.load()
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = [(i * 7919) % 150000 for i in range(n)]
    t = time.perf_counter()
    rt.extend("s/m", Prefix(0, 0), tokens, n, keep=None if mode == "old" else 1)
    print(
        json.dumps(
            {
                "mode": mode,
                "tokens": n,
                "rss_after_load_mb": round(loaded),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "prefill_s": round(time.perf_counter() - t, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
