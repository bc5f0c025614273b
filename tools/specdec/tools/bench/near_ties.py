"""Where `specdec loadtest --check-exact` counted a difference, was it a bfloat16 near-tie?

    python -m specdec.tools.bench.near_ties LOADTEST_JSON [--model NAME] [--dtype bfloat16]

For every distinct first difference in the JSON's `exact_mismatch_examples` (conversation,
turn, position p), it runs the target alone (transformers `generate`, greedy) on that
conversation's first turn up to p, then one forward over the prompt and those p tokens, and
reports the gap between the two best logits at p in units of the last place of the top
logit: the bench's rule (`hf.NEAR_TIE_ULPS`) calls a gap of at most 4 such units a numerical
near-tie, where a batched forward and a one-token step may round the two into either order.
Only first turns are checked (a later turn's context holds the model's own earlier answer);
a later turn is refused. The load test sends each turn's text as is (no chat template), so
that is what is tokenized here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.tools.bench.hf import NEAR_TIE_ULPS, last_place


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("loadtest_json")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", help="the load test's --prompts (default: the shipped set)")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.sdk.loadtest.workload import load_conversations
    from specdec.tools.models import installed_path

    run = json.loads(Path(args.loadtest_json).read_text())
    cases = sorted(
        {
            (e["conversation"], e["turn"], e["first_difference"])
            for r in run["results"]
            for e in r["exact_mismatch_examples"]
        }
    )
    if any(turn for _, turn, _ in cases):
        raise SystemExit("near_ties: differences in a later turn are not checked (not built)")
    path = str(installed_path(args.model) or args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversations = load_conversations(args.prompts)
    rows = []
    for conversation, turn, pos in cases:
        ids = tokenizer(conversations[conversation].turns[turn]).input_ids
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=pos + 1, do_sample=False
            )[0, len(ids) :].tolist()
            logits = model(input_ids=torch.tensor([ids + out[:pos]])).logits[0, -1]
        top = torch.topk(logits.float(), 2)
        ulp = last_place(logits.max())
        gap = float(top.values[0] - top.values[1])
        row = {
            "conversation": conversation,
            "turn": turn,
            "position": pos,
            "prompt_tokens": len(ids),
            "top2": top.indices.tolist(),
            "gap": gap,
            "ulp": ulp,
            "gap_ulps": gap / ulp,
            "near_tie": gap / ulp <= NEAR_TIE_ULPS,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"cases": len(rows), "near_ties": sum(r["near_tie"] for r in rows)}))


if __name__ == "__main__":
    main()
