"""What a reduced draft vocabulary (`--draft-vocab`, specdec.drafter.vocab) buys and costs
on a model pair: the README's "Reduced draft vocabulary" figures.

    python -m specdec.tools.bench.draftvocab target   # 1: the target's greedy outputs
    python -m specdec.tools.bench.draftvocab accept   # 2: greedy acceptance per N and source
    python -m specdec.tools.bench.draftvocab speed    # 3: drafter step time, reduced / full

One model in memory at a time (the phases share OUT, default bench-results/draftvocab).

`target` generates the target's greedy continuation of every shipped prompt (12 x 64
tokens by default) with transformers' `generate()`.

`accept` runs the draft once over each prompt + that continuation and reads its greedy
choice at every position, restricted to each candidate subset. Under greedy decoding the
stack's output is the target's (teacher forcing is exact: a round's draft token i is
accepted iff the draft's choice after the true prefix is the target's next token), so a
round at position j accepts the longest run of matches from j (at most k), then adds the
target's token; the acceptance rate is accepted / drafted, as `stats.acceptance_rate`
counts it, with k shortened near the end as the gateway does. Sources of the ranking: the
token ids in order (BPE merge rank) and token counts over a text corpus that ships on PyPI
(the Python files and docstrings of the installed `transformers` package; `--corpus`).
It also writes the ranking files (OUT/ranking-<source>.txt) in --draft-vocab-file format.

`speed` times the drafter's real decoding step (DrafterRuntime.forward, one token, one
thread) with the full output layer and with each reduced one, alternating within one
process, and prints the ratio of the median step times per repetition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

DEFAULT_NS = (4096, 8192, 16384, 32768, 65536)
KS = (2, 4)


def _pair() -> tuple[str, str]:
    from specdec.tools.models import installed_path

    target = installed_path("qwen2.5-coder-1.5b-instruct")
    draft = installed_path("qwen2.5-coder-0.5b-instruct")
    if target is None or draft is None:
        raise SystemExit("the model pair is not installed: run `specdec models install`")
    return str(target), str(draft)


def phase_target(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.tools.bench.modes import encode_prompt, load_prompts

    target, _ = _pair()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()

    def encode(prompt) -> list[int]:
        return encode_prompt(tokenizer, prompt)

    eos = model.generation_config.eos_token_id
    path = args.out / "target.json"
    rows = json.loads(path.read_text()) if path.exists() else []  # resumes a cut run
    for i, prompt in enumerate(load_prompts(None)):
        ids = encode(prompt)
        if i < len(rows):
            assert rows[i]["prompt"] == ids, "target.json holds other prompts"
            continue
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=args.tokens,
                eos_token_id=eos,
            )
        rows.append({"kind": prompt.kind, "prompt": ids, "output": out[0, len(ids) :].tolist()})
        path.write_text(json.dumps(rows))
        print(
            f"prompt {i + 1}: {len(rows[-1]['output'])} tokens",
            f"{time.perf_counter() - started:.0f} s",
        )


def corpus_ranking(tokenizer, corpus: Path) -> list[int]:
    """Token ids by their count over the .py files under `corpus`, most frequent first."""
    counts: Counter[int] = Counter()
    files = sorted(corpus.rglob("*.py"))
    batch: list[str] = []
    for f in files:
        batch.append(f.read_text(encoding="utf-8", errors="replace"))
        if len(batch) == 256:
            for ids in tokenizer(batch).input_ids:
                counts.update(ids)
            batch = []
    for ids in tokenizer(batch).input_ids if batch else []:
        counts.update(ids)
    print(f"corpus: {len(files)} files, {sum(counts.values())} tokens, {len(counts)} distinct")
    return [t for t, _ in counts.most_common()]


def simulate(matches: list[bool], k: int) -> tuple[int, int, int]:
    """Greedy rounds over one output: (rounds, drafted, accepted)."""
    n, j = len(matches), 0
    rounds = drafted = accepted = 0
    while j < n:
        k_eff = min(k, n - j - 1)
        a = 0
        while a < k_eff and matches[j + a]:
            a += 1
        rounds += 1
        drafted += k_eff
        accepted += a
        j += a + 1
    return rounds, drafted, accepted


def phase_accept(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, draft = _pair()
    torch.set_num_threads(args.threads)
    rows = json.loads((args.out / "target.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(draft)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.bfloat16).eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    import transformers

    corpus = Path(args.corpus or Path(transformers.__file__).parent)
    saved = args.out / "ranking-corpus.txt"
    if saved.exists():  # counted by an earlier run
        from specdec.drafter.vocab import read_ranking

        counted = read_ranking(str(saved))
    else:
        counted = corpus_ranking(tokenizer, corpus)
    seen = set(counted)  # tokens the corpus never holds follow in id order
    counted += [t for t in range(vocab) if t not in seen]
    rankings = {"id-order": list(range(vocab)), "corpus": counted}
    for name, ranking in rankings.items():
        (args.out / f"ranking-{name}.txt").write_text(
            f"# {name} ranking of {draft}\n" + "\n".join(map(str, ranking)) + "\n"
        )
    logits = []  # per prompt: [n, vocab] fp32, the draft's logits for each output token
    with torch.inference_mode():
        for row in rows:
            ids = row["prompt"] + row["output"]
            out = model(torch.tensor([ids])).logits[0].float()  # [len, vocab]
            logits.append(out[len(row["prompt"]) - 1 : len(ids) - 1])
    targets = [torch.tensor(r["output"]) for r in rows]
    total = sum(len(t) for t in targets)
    results = []
    for source, ranking in rankings.items():
        for n in [*args.ns, 0]:
            if n and n > len(ranking):
                continue
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[torch.tensor(ranking[: n or vocab], dtype=torch.long)] = True
            keep[torch.tensor(eos, dtype=torch.long)] = True
            if n == 0:
                keep[:] = True
            covered = sum(int(keep[t].sum()) for t in targets)
            entry = {"source": source, "n": n or vocab, "kept": int(keep.sum())}
            entry["coverage"] = covered / total
            for k in KS:
                r = d = a = 0
                for lg, t in zip(logits, targets, strict=True):
                    choice = lg.masked_fill(~keep, float("-inf")).argmax(-1)
                    rr, dd, aa = simulate((choice == t).tolist(), k)
                    r, d, a = r + rr, d + dd, a + aa
                entry[f"k{k}"] = {"acceptance": a / d, "tokens_per_round": total / r}
            results.append(entry)
            print(
                f"{source:9} N={entry['n']:6} coverage {entry['coverage']:.3f} "
                + " ".join(
                    f"k={k}: accept {entry[f'k{k}']['acceptance']:.3f} "
                    f"tok/round {entry[f'k{k}']['tokens_per_round']:.2f}"
                    for k in KS
                )
            )
            if n == 0:
                break
    (args.out / "accept.json").write_text(json.dumps(results, indent=1))


def phase_speed(args) -> None:
    import torch

    from specdec.drafter.config import DrafterConfig
    from specdec.drafter.runtime import DrafterRuntime
    from specdec.drafter.vocab import ReducedHead, subset_ids

    _, draft = _pair()
    cfg = DrafterConfig(role="drafter", model=draft, dtype="bfloat16", threads=1)
    rt = DrafterRuntime(cfg)
    rt.load()
    torch.set_num_threads(1)
    layer = rt.model.get_output_embeddings()
    heads: dict[str, ReducedHead | None] = {"full": None}
    for n in args.ns:
        heads[str(n)] = ReducedHead(
            layer, subset_ids(n, None, rt.vocab_size, rt.eos_token_ids), rt.vocab_size
        )
    rows = (
        json.loads((args.out / "target.json").read_text())
        if (args.out / "target.json").exists()
        else None
    )
    prompt = rows[0]["prompt"] if rows else list(range(1000, 1040))
    times: dict[str, list[float]] = {name: [] for name in heads}
    ratios: dict[str, list[float]] = {name: [] for name in heads if name != "full"}
    order = list(heads)
    for rep in range(args.reps):
        # One session per variant; the variants take turns step by step (the order
        # rotating), so a change in the machine's load hits them alike.
        sessions, last = {}, {}
        steps: dict[str, list[float]] = {name: [] for name in heads}
        for name in order:
            rt.head = heads[name]
            sessions[name] = rt.ready_store.acquire(f"{rep}-{name}", 0, 0, len(prompt) + args.steps)
            last[name] = rt.forward(sessions[name], prompt, keep=1)[-1]
        for step in range(args.steps):
            shift = step % len(order)
            for name in order[shift:] + order[:shift]:
                rt.head = heads[name]
                token = int(last[name].argmax())
                started = time.perf_counter()
                last[name] = rt.forward(sessions[name], [token])[-1]
                steps[name].append(time.perf_counter() - started)
        for name in order:
            rt.release(f"{rep}-{name}")
            times[name].append(statistics.median(steps[name]) * 1e3)
        for name in ratios:
            ratios[name].append(times[name][-1] / times["full"][-1])
        print(f"rep {rep + 1}: " + " ".join(f"{n}={times[n][-1]:.1f}ms" for n in order), flush=True)
    summary = {
        name: {
            "median_step_ms": statistics.median(times[name]),
            "ratio_median": statistics.median(ratios[name]) if name in ratios else 1.0,
            "ratio_min": min(ratios[name]) if name in ratios else 1.0,
            "ratio_max": max(ratios[name]) if name in ratios else 1.0,
        }
        for name in heads
    }
    for name, s in summary.items():
        print(
            f"{name:>6}: step {s['median_step_ms']:.1f} ms, reduced/full {s['ratio_median']:.3f} "
            f"(range {s['ratio_min']:.3f}-{s['ratio_max']:.3f} over {args.reps} reps)"
        )
    (args.out / "speed.json").write_text(
        json.dumps(
            {"reps": args.reps, "steps": args.steps, "summary": summary, "ratios": ratios}, indent=1
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=["target", "accept", "speed"])
    p.add_argument("--out", type=Path, default=Path("bench-results/draftvocab"))
    p.add_argument("--tokens", type=int, default=64, help="target: new tokens per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ns", default=",".join(map(str, DEFAULT_NS)), help="subset sizes")
    p.add_argument("--corpus", help="accept: folder of .py files to count (default: transformers)")
    p.add_argument("--reps", type=int, default=6, help="speed: alternations")
    p.add_argument("--steps", type=int, default=32, help="speed: decoding steps per rep")
    args = p.parse_args()
    args.ns = [int(x) for x in args.ns.split(",") if x.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    {"target": phase_target, "accept": phase_accept, "speed": phase_speed}[args.phase](args)


if __name__ == "__main__":
    main()
