"""What a `specdec bench` run holds in memory, known before anything is loaded.

The bench holds the target and the draft in its own process (the in-process anchors), and
the stack's verifier and drafter hold them again. On the 1.5B/0.5B pair in float32 that is
about 21 GB, plus 3 GB more for the target in its fastest one-token layout (bfloat16,
packed). A 24 GB machine runs out, and the kernel kills the run hours in. So the bench
prices the run from the checkpoints' headers first and leaves out the optional row that
does not fit, saying so.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a replica process holds beyond its weights, measured on the pretrained pair (the
# verifier 7.4 GB RSS for 6.2 GB of float32 weights, the drafter 2.8 GB for 2.0 GB).
REPLICA_FACTOR = 1.25
PROCESS_BYTES = 600 << 20  # a Python process with torch and transformers imported


def parameters(model_dir: str | Path) -> int | None:
    """The number of weights in a checkpoint folder, from its safetensors headers (no
    tensor is read); None when the folder has no safetensors file (a GGUF folder)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in entry["shape"]:
                count *= d
            total += count
    return total


def available() -> int | None:
    """MemAvailable (bytes) from /proc/meminfo; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plan(
    target: str, draft: str, dtype: str, step_layout: str | None
) -> tuple[int | None, int | None, int | None]:
    """Bytes held by (the stack's replicas, the bench's in-process target and draft, the
    target in `step_layout` besides them); None where a checkpoint cannot be read."""
    t, d = parameters(target), parameters(draft)
    if t is None or d is None:
        return None, None, None
    size = ITEMSIZE[dtype]
    stack = (t + d) * size * REPLICA_FACTOR + 2 * PROCESS_BYTES
    in_process = (t + d) * size + PROCESS_BYTES
    step = t * ITEMSIZE[step_layout.partition("+")[0]] if step_layout else None
    return int(stack), int(in_process), step


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
