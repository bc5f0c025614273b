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

from specdec.gateway.names import Finish
from specdec.v1 import common_pb2


class TextCodec:
    """Encode prompts and decode completions with the replicas' tokenizer."""

    def __init__(self, tokenizer_json: bytes):
        self.fingerprint = hashlib.sha256(tokenizer_json).hexdigest()
        self.tokenizer = Tokenizer.from_str(tokenizer_json.decode())

    @classmethod
    def from_info(cls, info: common_pb2.ModelInfo) -> TextCodec:
        if not info.tokenizer_json_zlib:
            raise ValueError(f"replica {info.replica_id} sent no tokenizer")
        codec = cls(zlib.decompress(info.tokenizer_json_zlib))
        if codec.fingerprint != info.tokenizer_fingerprint:
            raise ValueError(
                f"tokenizer from {info.replica_id} does not match its fingerprint "
                f"({codec.fingerprint[:12]} != {info.tokenizer_fingerprint[:12]})"
            )
        return codec

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; add_special_tokens applies the tokenizer's post-processor
        (a BOS for Llama-style tokenizers), as `tokenizer(text)` does in transformers."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass
class TextOutput:
    """The completion of one request as tokens arrive: text, stop strings, EOS, length.

    Tokens are taken one at a time, whatever the size of the round that brought them, so
    where a stop string cuts never depends on how many draft tokens a round accepted.
    Text is detokenized incrementally (as vLLM does): each token decodes a short window
    that starts a few tokens back, and text that ends in an incomplete UTF-8 sequence waits
    for the next token. `push(tokens)` returns what may be streamed now: text that could
    still turn out to start a stop string is held back until it is certain.
    """

    codec: TextCodec
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # EOS tokens are ordinary tokens: only the length ends it
    min_tokens: int = 0  # stop strings are not looked for before this many tokens (vLLM)
    stop_token_ids: frozenset[int] = frozenset()  # end it ("stop"); their text is dropped
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    finish_reason: Finish | None = None
    _prefix_offset: int = 0  # start of the decode window
    _read_offset: int = 0  # tokens whose text is already in self.text

    def push(self, new_tokens: Sequence[int]) -> tuple[str, list[int]]:
        """Add a round's tokens; returns (text delta, token delta) safe to stream now."""
        assert self.finish_reason is None, "completion already finished"
        longest = max(map(len, self.stop), default=0)
        for token in new_tokens:
            self.tokens.append(token)
            before = len(self.text)
            self.text += self._decode_next()
            if token in self.stop_token_ids:  # as vLLM: the token is kept, its text is not
                self.text = self.text[:before]
                self.finish_reason = Finish.STOP
                break
            if (
                self.stop
                and len(self.text) > before
                and len(self.tokens) >= self.min_tokens
                and self._cut_at_stop(before, longest)
            ):
                break
            if token in self.eos_token_ids and not self.ignore_eos:
                self.finish_reason = Finish.EOS
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = Finish.LENGTH
                break
        if self.finish_reason in (Finish.EOS, Finish.LENGTH):
            self.text += self._flush()
        return self._delta(longest)

    def _decode_next(self) -> str:
        window = self.tokens[self._prefix_offset :]
        known = self.codec.decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self.codec.decode(window)
        if len(full) <= len(known) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete UTF-8 sequence: wait
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        return full[len(known) :]

    def _flush(self) -> str:
        """Text still held back at the end (an incomplete UTF-8 tail decodes as U+FFFD)."""
        known = self.codec.decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self.codec.decode(self.tokens[self._prefix_offset :])
        self._read_offset = len(self.tokens)
        return full[len(known) :]

    def _cut_at_stop(self, before: int, longest: int) -> bool:
        """Stop at the first stop string the last token completed; True if one did."""
        start = max(0, before - longest + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.finish_reason = Finish.STOP
        return True

    def _delta(self, longest: int) -> tuple[str, list[int]]:
        safe = len(self.text)
        if self.finish_reason is None and longest:
            safe -= longest - 1
        safe = max(safe, self.emitted_chars)
        text = self.text[self.emitted_chars : safe]
        self.emitted_chars = safe
        tokens = self.tokens[self.emitted_tokens :]
        self.emitted_tokens = len(self.tokens)
        return text, tokens
