"""Bytes of draft distributions per round at T = 1 on a real drafter, the whole proposal
against the cut one (--draft-probs-max-entries 2048, --draft-probs-tail 1e-4).

    python -m specdec.tools.bench.payload [--model DIR] [--k 2,4,8,16]

In-process (no services): one Draft per prompt and k; prints one JSON line per k with the
DraftResponse bytes per round (drafter -> gateway; the VerifyRequest carries the same
distributions gateway -> verifier) and the entries per cut distribution.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from importlib import resources
from typing import Any

from specdec.common.params import SamplingParams
from specdec.drafter.config import DrafterConfig
from specdec.drafter.proposer import DraftCall, propose
from specdec.drafter.speculate import BranchStore
from specdec.replica.convert import encoded_to_proto
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime
from specdec.v1 import drafter_pb2


def main() -> None:
    from transformers import AutoTokenizer

    from specdec.tools.models import installed_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="drafter model directory (default: the installed 0.5B)")
    p.add_argument("--k", default="2,4,8,16")
    a = p.parse_args()
    path = a.model or installed_path("qwen2.5-coder-0.5b-instruct")
    if path is None:
        raise SystemExit("no --model and no installed drafter: run `specdec models install`")
    path = str(path)
    cfg = DrafterConfig(role="drafter", model=path, dtype="bfloat16", threads=1)
    rt = ModelRuntime(cfg)
    rt.load()
    tok = AutoTokenizer.from_pretrained(path)
    rows = resources.files("specdec.tools.benchdata").joinpath("prompts.jsonl").read_text()
    prompts = [r["prompt"] for r in map(json.loads, rows.splitlines()) if "prompt" in r]
    prompts = [prompts[0], prompts[4], prompts[5]]  # two prose, one code
    params = SamplingParams(temperature=1.0, seed=7)
    for k in map(int, a.k.split(",")):
        out: dict[str, Any] = {"k": k}
        for label, entries in (("whole", 0), ("cut", 2048)):
            rt.config = dataclasses.replace(cfg, draft_probs_max_entries=entries)
            sizes, counts = [], []
            for i, text in enumerate(prompts):
                sid = f"s/{label}{k}/{i}"
                d = rt.drive(
                    propose(
                        DraftCall(
                            rt, BranchStore(), sid, Prefix(0, 0), tok(text).input_ids, k, params
                        )
                    )
                )
                response = drafter_pb2.DraftResponse(
                    draft_tokens=d.tokens, draft_probs=[encoded_to_proto(e) for e in d.probs]
                )
                sizes.append(response.ByteSize())
                counts += [e.token_ids.numel() if e.token_ids is not None else -1 for e in d.probs]
                rt.release(sid)
            out[f"{label}_bytes_per_round"] = round(sum(sizes) / len(sizes))
            if label == "cut":
                out["cut_entries_min_max"] = [min(counts), max(counts)]
        out["ratio"] = round(out["whole_bytes_per_round"] / out["cut_bytes_per_round"], 1)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
