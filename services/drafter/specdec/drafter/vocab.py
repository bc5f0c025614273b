"""A reduced draft vocabulary (FR-Spec, Zhao et al., arXiv 2502.14856).

The drafter's output layer is a large share of its per-token cost: the Qwen2.5-Coder 0.5B
draft's untied lm_head is 151,936 x 896, about a quarter of the weights a decoding step
reads. With `--draft-vocab N` (or `--draft-vocab-file PATH`) the drafter keeps only the
rows of N tokens: at load it slices them out of the output layer once ([N, hidden], on
the model's device and dtype), runs the model's base for the final hidden state, and
multiplies by that slice only. Logits outside the subset are -inf, so the draft
distribution is exactly 0 there. The verifier is untouched and the rejection rule exact
for any proposal the draft token is really drawn from, so greedy output and the sampled
distribution do not change; only the acceptance rate can (the draft can never propose a
token outside the subset).

Which N tokens. Without a file, the N smallest token ids: for byte-level BPE tokenizers
(Qwen, GPT-2, Llama 3) ids follow the merge order, so the earliest merges, which are the
most frequent pairs of the tokenizer's training corpus, come first. With a file, the
file's ranking: token ids separated by whitespace (one a line is usual), most frequent
first, `#` starting a comment; `--draft-vocab N` then keeps its first N (0: all of it).
Either way the model's end-of-sequence tokens are always kept, so a draft can end where
the target may.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specdec.common.settings import ConfigError, env_name

log = logging.getLogger(__name__)

VOCAB_FLAG = "--draft-vocab"
FILE_FLAG = "--draft-vocab-file"


def where(flag: str) -> str:
    return f"{flag} / {env_name(flag)}"


def read_ranking(path: str) -> list[int]:
    """Token ids of a ranking file, in file order (ConfigError naming --draft-vocab-file
    when it cannot be read, holds something other than non-negative integers, or repeats
    an id)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where(FILE_FLAG)}: cannot read {path!r}: {e}") from None
    ids: list[int] = []
    seen: set[int] = set()
    for number, line in enumerate(text.splitlines(), 1):
        for word in line.split("#", 1)[0].split():
            try:
                token = int(word)
            except ValueError:
                token = -1
            if token < 0:
                raise ConfigError(
                    f"{where(FILE_FLAG)}: {path}:{number}: {word!r} is not a token id "
                    "(a non-negative integer)"
                )
            if token in seen:
                raise ConfigError(f"{where(FILE_FLAG)}: {path}:{number}: token {token} repeats")
            seen.add(token)
            ids.append(token)
    if not ids:
        raise ConfigError(f"{where(FILE_FLAG)}: {path!r} holds no token id")
    return ids


def subset_ids(n: int, ranking: list[int] | None, vocab_size: int, always: list[int]) -> list[int]:
    """The kept token ids, ascending: the first n of the ranking (the ids in order when
    ranking is None; n = 0 with a ranking: all of it) plus `always`. ConfigError, naming
    the setting, when n or an id does not fit the vocabulary."""
    if ranking is None:
        if not 1 <= n <= vocab_size:
            raise ConfigError(
                f"{where(VOCAB_FLAG)}: must be in [1, {vocab_size}] (the model's vocabulary), "
                f"got {n}"
            )
        kept = set(range(n))
    else:
        bad = [t for t in ranking if t >= vocab_size]
        if bad:
            raise ConfigError(
                f"{where(FILE_FLAG)}: token id {bad[0]} is outside the model's vocabulary "
                f"[0, {vocab_size})"
            )
        if n > len(ranking):
            raise ConfigError(
                f"{where(VOCAB_FLAG)}: {n} exceeds the {len(ranking)} ids of {where(FILE_FLAG)}"
            )
        kept = set(ranking[: n or len(ranking)])
    return sorted(kept | {t for t in always if 0 <= t < vocab_size})


class ReducedHead:
    """The output layer restricted to a subset of the vocabulary.

    ids: [N] int64, ascending; weight: [N, hidden] (and bias [N]) in the model's dtype, on
    its device. Calling it maps hidden states [..., hidden] to fp32 logits [..., vocab]:
    the subset's entries are those rows' outputs, every other entry is -inf.
    """

    def __init__(self, output_layer: torch.nn.Linear, ids: list[int], vocab_size: int):
        weight = output_layer.weight  # [vocab, hidden]
        index = torch.tensor(ids, dtype=torch.long, device=weight.device)  # [N]
        self.ids = index
        self.vocab_size = vocab_size
        with torch.no_grad():
            self.weight = weight.index_select(0, index).contiguous()  # [N, hidden]
            bias = output_layer.bias
            self.bias = None if bias is None else bias.index_select(0, index).contiguous()

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = torch.nn.functional.linear(hidden, self.weight, self.bias)  # [..., N]
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"), dtype=torch.float32)
        out[..., self.ids] = sub.float()  # [..., vocab]
        return out
