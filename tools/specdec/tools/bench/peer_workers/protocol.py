"""The worker side of the peer protocol (specdec.tools.bench.peers), shared by the workers.

A worker runs as a script with its peer's own virtualenv's python, so it imports this file
as a sibling module (its folder is first on sys.path), never specdec."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def parse_mode(mode: str) -> tuple[str, int]:
    """'target' -> ('target', 0); 'ngram k=K' / 'draft k=K' -> (kind, K)."""
    if mode == "target":
        return "target", 0
    kind, _, k = mode.partition(" k=")
    if kind in ("ngram", "draft") and k.isdigit() and int(k) > 0:
        return kind, int(k)
    raise ValueError(f"unknown mode {mode!r}")


def serve(run: Callable[[dict], dict]) -> int:
    """Read the job on stdin, answer run(job) on stdout as one JSON line (an exception as
    {"error": ...}, its traceback on stderr); exit status 1 on an error."""
    # The answer goes to the stdout this process was given; everything else that writes to
    # file descriptor 1 (the engine's logs, its child processes) goes to stderr.
    answer = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    job = json.loads(sys.stdin.read())
    try:
        out = run(job)
    except Exception as e:  # the driver quotes this and the end of stderr
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {e}"}
    answer.write("\n" + json.dumps(out) + "\n")
    answer.flush()
    return 0 if "error" not in out else 1
