"""OpenAI's `logprobs` objects from the gateway's TokenLogprobs (specdec.gateway.front.logprobs).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. Completions
(the legacy format lm-eval's local-completions reads): `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`, where each top_logprobs entry maps token text to its
log-probability for the `logprobs` most likely tokens and, as vLLM does, the token itself;
with echo the prompt's rows come first, the first of them null (no context to score it).
A token's text is its own decoding (special tokens included), as vLLM gives it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from specdec.gateway.text import TextCodec
from specdec.v1 import common_pb2

Row = tuple[int, float | None, list[tuple[int, float]] | None]


def rows(table: common_pb2.TokenLogprobs) -> Iterator[Row]:
    """(token id, log-probability, alternatives) per token; None for an unscored token
    (a prompt's first)."""
    n, m, top = len(table.token_ids), len(table.logprobs), table.num_top
    for i, token in enumerate(table.token_ids):
        j = i - (n - m)
        if j < 0:
            yield token, None, None
            continue
        alternatives = zip(
            table.top_token_ids[j * top : (j + 1) * top],
            table.top_logprobs[j * top : (j + 1) * top],
            strict=True,
        )
        yield token, table.logprobs[j], list(alternatives)


@dataclass
class LogprobsRenderer:
    """Token texts through the served tokenizer; text offsets counted per choice."""

    codec: TextCodec

    def token(self, token_id: int) -> str:
        return self.codec.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, table: common_pb2.TokenLogprobs) -> dict[str, Any]:
        content = []
        for token, logprob, top in rows(table):
            text = self.token(token)
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())}
                        for t, lp in ((self.token(i), lp) for i, lp in top or [])
                    ],
                }
            )
        return {"content": content}

    def completion(
        self, tables: list[common_pb2.TokenLogprobs], offset: int = 0
    ) -> tuple[dict[str, Any], int]:
        """The legacy object over the tables' rows in order, text offsets from `offset`;
        and the offset after them (a stream's next delta starts there)."""
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for table in tables:
            for token, logprob, top in rows(table):
                text = self.token(token)
                out["tokens"].append(text)
                out["token_logprobs"].append(logprob)
                out["text_offset"].append(offset)
                offset += len(text)
                if top is None:
                    out["top_logprobs"].append(None)
                    continue
                best: dict[str, float | None] = {self.token(i): lp for i, lp in top}
                best.setdefault(text, logprob)
                out["top_logprobs"].append(best)
        return out, offset
