"""Tokenizing and detokenizing in the gateway, with the `tokenizers` library only (no torch).

The tokenizer comes from the replicas themselves (Info with include_tokenizer), so the
gateway needs no model files, and its fingerprint proves it is the one the models use.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from specdec.v1 import common_pb2


class TextCodec:
    """Encode prompts and decode completions with the replicas' tokenizer."""

    def __init__(self, tokenizer_json: bytes, chat_template: str = ""):
        self.fingerprint = hashlib.sha256(tokenizer_json).hexdigest()
        self.tokenizer = Tokenizer.from_str(tokenizer_json.decode())
        self.chat_template = chat_template

    @classmethod
    def from_info(cls, info: common_pb2.ModelInfo) -> TextCodec:
        if not info.tokenizer_json_zlib:
            raise ValueError(f"replica {info.replica_id} sent no tokenizer")
        codec = cls(zlib.decompress(info.tokenizer_json_zlib), info.chat_template)
        if codec.fingerprint != info.tokenizer_fingerprint:
            raise ValueError(
                f"tokenizer from {info.replica_id} does not match its fingerprint "
                f"({codec.fingerprint[:12]} != {info.tokenizer_fingerprint[:12]})"
            )
        return codec

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass
class Completion:
    """The completion of one request as tokens arrive: text, stop strings, EOS, length.

    `push(tokens)` takes the tokens of one verified round and returns the text that may be
    streamed now. Text that could still turn out to start a stop string, or that ends in an
    incomplete UTF-8 sequence, is held back until it is certain.
    """

    codec: TextCodec
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    finish_reason: str | None = None  # "length" | "eos" | "stop"

    def push(self, new_tokens: Sequence[int]) -> tuple[str, list[int]]:
        """Add a round's tokens; returns (text delta, token delta) safe to stream now."""
        assert self.finish_reason is None, "completion already finished"
        start = len(self.tokens)
        for token in new_tokens:
            self.tokens.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        self.text = self.codec.decode(self.tokens)
        if self.stop:
            self._apply_stop(start)
        return self._delta()

    def _apply_stop(self, first_new: int) -> None:
        # A stop string can only end inside the text the new tokens added.
        longest = max(map(len, self.stop))
        old_text_len = len(self.codec.decode(self.tokens[:first_new]))
        window_start = max(0, old_text_len - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        if not hits:
            return
        cut, stop = min(hits)
        # Keep the tokens up to the one that completes the stop string.
        for n in range(first_new + 1, len(self.tokens) + 1):
            if self.codec.decode(self.tokens[:n]).find(stop, window_start) >= 0:
                del self.tokens[n:]
                break
        self.text = self.text[:cut]
        self.finish_reason = "stop"

    def _delta(self) -> tuple[str, list[int]]:
        if self.finish_reason is not None:
            safe = len(self.text)
        else:
            safe = len(self.text)
            if self.stop:
                safe -= max(map(len, self.stop)) - 1
            while safe > 0 and self.text[safe - 1] == "\ufffd":
                safe -= 1
        safe = max(safe, self.emitted_chars)
        text = self.text[self.emitted_chars : safe]
        self.emitted_chars = safe
        tokens = self.tokens[self.emitted_tokens :]
        self.emitted_tokens = len(self.tokens)
        return text, tokens
