"""Prose and chat prompts written by a model: general text the standard library lacks.

The standard library's prose is Python documentation, and its chat prompts are "write this
function" requests. The first distillation on them (docs/features/distill.md) moved the
bench's prose and chat acceptance by 2 points: the bench's prose is general writing ("The
history of the printing press begins ..."), and a drafter learns where it is trained.
With no dataset hub, a model writes the prompts itself (self-instruct: the model writes
the instructions it is then run on), from a shipped list of subject areas and forms:

- ``prose``: the model writes the opening sentences of a piece (an article, a guide, a
  story, ...) on a subject it picks within an area; the prompt is that text cut after a
  random word of its second sentence, a completion to go on with, as the bench's prose is;
- ``chat``: the model writes one request a user might send an assistant about the area;
  the prompt is that request as a user message.

Sampled (temperature 1, top-p 0.95) from a seed, in batches; the writer's output is
cleaned (one paragraph, no quotes or lists, mostly words) and deduplicated, and a prompt
equal to, containing or contained in one of the bench's is left out.
"""

from __future__ import annotations

import random
import re

AREAS = (
    "world history", "cooking and baking", "gardening", "travel", "personal finance",
    "health and fitness", "physics", "biology", "chemistry", "astronomy", "music",
    "sports", "careers and job hunting", "writing and grammar", "education",
    "economics", "geography", "visual art", "the environment", "psychology",
    "home repair", "pets", "law and everyday legal questions", "philosophy",
    "mathematics", "software engineering practice", "databases", "computer networking",
    "web development", "data analysis", "machine learning", "operating systems",
    "product management", "small business", "parenting", "film and television",
    "literature", "architecture", "transportation", "energy",
)  # fmt: skip
FORMS = (
    "an encyclopedia article", "a blog post", "a step-by-step guide", "a news report",
    "a short story", "an essay", "a textbook section", "a product review",
    "a speech", "a letter to a friend",
)  # fmt: skip
PROSE_ASK = (
    "Write the opening paragraph of {form} about a specific subject in {area}. Begin "
    "directly with the text itself, with no title."
)
CHAT_ASK = (
    "Write one realistic message that a user might send to an AI assistant about {area}: "
    "a question, a task, or a request for code or an explanation. Reply with the message "
    "only, without quotes."
)
MAX_WORDS = 80
MAX_NEW_TOKENS = 96  # two sentences of prose, a whole request# A reply about the task rather than the piece itself ("The first sentence would ...").
META = ("first sentence", "second sentence", "opening paragraph", "here is", "here's")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def asks(kind: str, count: int, rng: random.Random) -> list[str]:
    """`count` instructions to the writer for one kind, areas and forms drawn by `rng`."""
    template = PROSE_ASK if kind == "prose" else CHAT_ASK
    return [template.format(area=rng.choice(AREAS), form=rng.choice(FORMS)) for _ in range(count)]


def _clean(text: str, max_words: int = MAX_WORDS) -> str | None:
    """The writer's reply as one paragraph of words, or None when it is not one."""
    text = text.strip().strip('"').strip("\u201c\u201d").strip()
    text = text.split("\n\n")[0].strip()
    if not text or any(s in text for s in ("```", "\n-", "\n*", "\n1.", "#")):
        return None
    text = " ".join(text.split())
    words = text.split()
    if not 6 <= len(words) <= max_words:
        return None
    if sum(c.isalpha() or c == " " for c in text) < 0.85 * len(text):
        return None
    return text


def prose_prompt(text: str, rng: random.Random) -> str | None:
    """Opening sentences cut after a random word of the second sentence (at least three
    words in): a completion to go on with; None when there is no second sentence."""
    if (text := _clean(text, max_words=4 * MAX_WORDS)) is None:
        return None
    if any(s in text.lower() for s in META):
        return None
    sentences = _SENTENCE_END.split(text, maxsplit=1)
    if len(sentences) < 2 or len(sentences[0].split()) < 6 or len(sentences[1].split()) < 5:
        return None
    words = _SENTENCE_END.split(sentences[1], maxsplit=1)[0].split()
    if len(words) < 5:
        return None
    keep = rng.randint(3, len(words) - 2)
    return f"{sentences[0]} {' '.join(words[:keep])}".rstrip(",;:")


def chat_prompt(text: str) -> str | None:
    return _clean(text)


def write_prompts_with(
    model_path: str,
    kinds: list[str],
    seed: int,
    exclude: list[str],
    device: str = "cpu",
    dtype: str = "bfloat16",
    batch_size: int = 8,
    progress: bool = True,
) -> list[dict]:
    """One prompt per entry of `kinds` ("prose" or "chat"), written by the model at
    `model_path`; a reply that does not clean up is asked again (a new draw), up to four
    rounds, and a kind that still falls short is an error naming the shortfall."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.tools.bench.modes import Prompt, encode_prompt
    from specdec.tools.distill.data import batch_generate
    from specdec.tools.distill.train import DTYPES

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(device)
    model.eval()
    eos = model.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rng = random.Random(seed)
    torch.manual_seed(seed)
    wanted = {k: kinds.count(k) for k in ("prose", "chat")}
    got: dict[str, list[str]] = {"prose": [], "chat": []}
    seen = {" ".join(t.lower().split()) for t in exclude}
    with tqdm(total=len(kinds), desc="written prompts", disable=not progress) as bar:
        for _ in range(4):
            todo = [(k, a) for k in got for a in asks(k, wanted[k] - len(got[k]), rng)]
            for i in range(0, len(todo), batch_size):
                group = todo[i : i + batch_size]
                ids = [
                    encode_prompt(
                        tokenizer, Prompt("chat", messages=[{"role": "user", "content": a}])
                    )
                    for _, a in group
                ]
                replies = batch_generate(model, ids, device, MAX_NEW_TOKENS, eos, pad, sample=True)
                for (kind, _), reply in zip(group, replies, strict=True):
                    if kind == "chat" and len(reply) == MAX_NEW_TOKENS:
                        continue  # cut short: not a whole request
                    text = tokenizer.decode(reply, skip_special_tokens=True)
                    prompt = prose_prompt(text, rng) if kind == "prose" else chat_prompt(text)
                    if prompt is None or len(got[kind]) >= wanted[kind]:
                        continue
                    key = " ".join(prompt.lower().split())
                    if key in seen or any(key in s or s in key for s in seen):
                        continue
                    seen.add(key)
                    got[kind].append(prompt)
                    bar.update(1)
            if all(len(got[k]) >= wanted[k] for k in got):
                break
    short = {k: wanted[k] - len(got[k]) for k in got if len(got[k]) < wanted[k]}
    if short:
        raise ValueError(f"the writer gave too few usable prompts after 4 rounds: {short} short")
    out, taken = [], {"prose": 0, "chat": 0}
    for kind in kinds:
        text = got[kind][taken[kind]]
        taken[kind] += 1
        if kind == "prose":
            out.append({"kind": "prose", "prompt": text})
        else:
            out.append({"kind": "chat", "messages": [{"role": "user", "content": text}]})
    return out
