"""Structured output in the gateway: grammars, a matcher per request, the masks of a round.

The engine is llguidance (PyPI `llguidance`, no dependencies, no torch): the gateway builds
its tokenizer once from the replicas' tokenizer.json, compiles each request's
`StructuredOutput` (a JSON object, a JSON schema, a regex, a choice or a Lark grammar) into a
grammar, and
keeps one matcher per request that follows the tokens the request emits.

A round under a grammar (specdec.gateway.round.loop):

1. The draft is walked through a copy of the matcher: the mask of each draft position is
   the tokens the grammar allows after the context and the draft tokens before it.
2. The draft is cut after its first forbidden token. That token stays: the verifier's
   masked target p gives it probability 0, so it is rejected for certain and the recovered
   token is drawn from norm(max(0, p - q)) at its position, exactly as for the uncut
   draft (dropping it instead would sample that position from p and skew the output
   whenever q put mass on forbidden tokens). Nothing after it can be reached.
   A draft that reaches an end the grammar accepts (EOS) is cut after it the same way.
3. The verifier gets the k+1 masks (`GrammarMask`: a bitset of ceil(vocab/8) bytes, or the
   allowed ids when fewer than vocab/32) and sets the target's forbidden logits to -inf
   before temperature, top-k and top-p (specdec.replica.masks). Exactness never depends on
   the drafter, which drafts without the grammar: the cut only spares the verifier the
   tokens after a certain rejection.
4. The round's tokens advance the request's matcher. EOS is allowed only where the grammar
   accepts; once it has completed only EOS is, so the generation ends there
   (FINISH_REASON_EOS, "stop" over HTTP).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from typing import TYPE_CHECKING

import llguidance

from specdec.common.errors import InvalidRequest
from specdec.v1 import gateway_pb2, verifier_pb2

if TYPE_CHECKING:  # a type of llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

ENGINE = f"llguidance {version('llguidance')}"
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or the choices together
MAX_CHOICES = 1024
# JSON is compact by default (no whitespace between tokens): flexible whitespace lets a
# model loop on newlines and indentation without ever closing the object. A schema's own
# "x-guidance" options (e.g. {"whitespace_flexible": true}) override this.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """A compiled StructuredOutput: llguidance's grammar text and what it came from."""

    kind: str  # one of KINDS
    text: str  # llguidance's grammar (JSON)


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"{what} is longer than {MAX_SPEC_CHARS} characters")


def grammar_text(spec: gateway_pb2.StructuredOutput) -> tuple[str, str]:
    """(kind, llguidance grammar) of a StructuredOutput; InvalidRequest naming the field
    for what is malformed before compilation (JSON that does not parse, an empty choice)."""
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(
            "structured_output is set but names no kind (json_object, json_schema, regex, "
            "choice or grammar)"
        )
    if kind == "json_object":
        return kind, llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_DEFAULTS
        )
    if kind == "json_schema":
        _check_size(spec.json_schema, "structured_output.json_schema")
        try:
            schema = json.loads(spec.json_schema)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"structured_output.json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest("structured_output.json_schema must be a JSON object")
        try:
            return kind, llguidance.LLMatcher.grammar_from_json_schema(
                # a boolean schema as its JSON text (llguidance reads true and "true" alike)
                schema if isinstance(schema, dict) else json.dumps(schema),
                defaults=JSON_DEFAULTS,
            )
        except ValueError as e:
            raise InvalidRequest(f"structured_output.json_schema: {e}") from None
    if kind == "regex":
        if not spec.regex:
            raise InvalidRequest("structured_output.regex is empty")
        _check_size(spec.regex, "structured_output.regex")
        return kind, llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "grammar":
        if not spec.grammar.strip():
            raise InvalidRequest("structured_output.grammar is empty")
        _check_size(spec.grammar, "structured_output.grammar")
        return kind, llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    choices = list(spec.choice.choices)
    if not choices or any(not c for c in choices):
        raise InvalidRequest("structured_output.choice needs at least one non-empty string")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"structured_output.choice: at most {MAX_CHOICES} choices")
    _check_size("".join(choices), "structured_output.choice")
    # Lark string literals take JSON's escapes.
    lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return kind, llguidance.LLMatcher.grammar_from_lark(lark)


class Grammars:
    """The gateway's grammar engine: llguidance's tokenizer over the replicas' vocabulary,
    built once (about a second at 151k tokens); compiles requests, makes matchers."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Collection[int]):
        self.vocab_size = vocab_size  # the model's logits, which may exceed the tokenizer's
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self.bits_bytes = (vocab_size + 7) // 8
        self.eos_token_ids = frozenset(eos_token_ids)

    def compile(self, spec: gateway_pb2.StructuredOutput) -> Grammar:
        """The request's grammar, or InvalidRequest naming what is wrong with it (an invalid
        JSON schema or regex: llguidance's message)."""
        kind, text = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise InvalidRequest(f"structured_output.{kind} is invalid: {error}")
        return Grammar(kind, text)

    def constraint(self, spec: gateway_pb2.StructuredOutput) -> Constraint:
        """A request's grammar state at the start of its output (InvalidRequest for a bad
        grammar). Compiling a large schema takes milliseconds: call it off the event loop."""
        return self.matcher(self.compile(spec))

    def matcher(self, grammar: Grammar) -> Constraint:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"structured_output.{grammar.kind} is invalid: {matcher.get_error()}"
            )
        return Constraint(self, matcher)


@dataclass(frozen=True)
class CutDraft:
    """A draft as the grammar leaves it: `keep` of its tokens (a prefix), the masks of the
    keep + 1 verified positions."""

    keep: int
    masks: list[verifier_pb2.GrammarMask]  # [keep + 1]
    forbidden: bool  # the last kept token is forbidden (rejected for certain)


class Constraint:
    """One request's grammar state: a matcher that has consumed every token the request
    emitted so far."""

    def __init__(self, grammars: Grammars, matcher: llguidance.LLMatcher):
        self.grammars = grammars
        self.matcher = matcher

    def bits(self) -> bytes:
        """The tokens allowed next: a bitset of ceil(vocab/8) bytes (token t at bit t % 8 of
        byte t / 8). Once the grammar has completed, EOS alone."""
        bits = self.matcher.compute_bitmask()[: self.grammars.bits_bytes]
        self._check()
        return bits

    def cut(self, draft: Sequence[int]) -> CutDraft:
        """The masks of a round's draft [k] and where it is cut (see the module docstring).
        The matcher is walked through the draft and rolled back: it is unchanged."""
        masks: list[verifier_pb2.GrammarMask] = []
        consumed = 0
        keep, forbidden = len(draft), False
        for i, token in enumerate(draft):
            bits = self.bits()
            masks.append(encode_mask(bits))
            if not (token >> 3 < len(bits) and bits[token >> 3] >> (token & 7) & 1):
                keep, forbidden = i + 1, True  # rejected for certain: nothing after counts
                break
            if token in self.grammars.eos_token_ids:  # the end: the completion stops here
                keep = i + 1
                break
            self.matcher.consume_token(token)
            self._check()
            consumed += 1
        # The position after the kept draft: its mask, unless the kept draft ends in a
        # token after which nothing is used (a forbidden token, or EOS).
        ends = forbidden or (keep > 0 and draft[keep - 1] in self.grammars.eos_token_ids)
        masks.append(verifier_pb2.GrammarMask() if ends else encode_mask(self.bits()))
        if consumed and not self.matcher.rollback(consumed):
            self._check()
            raise RuntimeError(f"grammar matcher could not roll back {consumed} tokens")
        return CutDraft(keep, masks, forbidden)

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume a round's tokens (what the verifier emitted, all allowed by the masks it
        applied), up to an EOS (the completion stops there)."""
        for token in tokens:
            if token in self.grammars.eos_token_ids:
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(
                    f"grammar refused token {token} that the verifier emitted under its "
                    f"mask: {self.matcher.get_error()}"
                )

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self.matcher.get_error()}")


def encode_mask(bits: bytes) -> verifier_pb2.GrammarMask:
    """A bitset over the vocabulary ([ceil(vocab/8)] bytes, token t at bit t % 8 of byte
    t / 8) as the wire carries it: the allowed ids when they take fewer bytes (4 each)."""
    allowed = int.from_bytes(bits, "little")
    count = allowed.bit_count()
    if count == 0:
        raise RuntimeError("the grammar allows no token here")
    if count * 4 < len(bits):
        ids = [i * 8 + j for i, b in enumerate(bits) if b for j in range(8) if b >> j & 1]
        return verifier_pb2.GrammarMask(allowed_ids=ids)
    return verifier_pb2.GrammarMask(allowed_bits=bits)
