"""A completion's log-probabilities in the gateway (torch-free): the rows each Verify
returns (specdec.replica.logprobs computes them on the verifier), kept aligned with the
completion's tokens.

A round emits its accepted drafts and its next token, each scored; the completion may keep
fewer of them (EOS, max_new_tokens, a stop string cut after the token that completed it),
so the rows are cut to the tokens kept, and a stream's delta carries the rows of its own
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.v1 import common_pb2


@dataclass
class LogprobsTrack:
    """The scored rows of one completion, in token order."""

    num_top: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    emitted: int = 0  # rows already sent in a stream's deltas

    def add(self, table: common_pb2.TokenLogprobs) -> None:
        """A Verify's rows of its emitted tokens (every token scored), with at least
        num_top alternatives each (more when the Verify also served the recorder's
        --record-top-logprobs: cut to num_top)."""
        if len(table.logprobs) != len(table.token_ids) or table.num_top < self.num_top:
            raise ValueError(
                f"the verifier scored {len(table.logprobs)} of {len(table.token_ids)} tokens "
                f"with {table.num_top} alternatives ({self.num_top} asked)"
            )
        table = narrowed(table, self.num_top)
        self.token_ids.extend(table.token_ids)
        self.logprobs.extend(table.logprobs)
        self.top_token_ids.extend(table.top_token_ids)
        self.top_logprobs.extend(table.top_logprobs)

    def rows(self, start: int, end: int) -> common_pb2.TokenLogprobs:
        """The rows of tokens [start, end)."""
        top = self.num_top
        return common_pb2.TokenLogprobs(
            token_ids=self.token_ids[start:end],
            logprobs=self.logprobs[start:end],
            num_top=top,
            top_token_ids=self.top_token_ids[start * top : end * top],
            top_logprobs=self.top_logprobs[start * top : end * top],
        )

    def delta(self, kept: int) -> common_pb2.TokenLogprobs:
        """The rows not streamed yet, up to the completion's `kept` tokens."""
        start, self.emitted = self.emitted, kept
        return self.rows(start, kept)


def narrowed(table: common_pb2.TokenLogprobs, num_top: int) -> common_pb2.TokenLogprobs:
    """`table` with the first num_top (the likeliest) of its alternatives per scored token:
    one Verify asked for the most any reader of it needs (the request's top_logprobs,
    the recorder's --record-top-logprobs), each reader keeps its own."""
    top = table.num_top
    if num_top >= top:
        return table
    rows = range(len(table.logprobs))
    return common_pb2.TokenLogprobs(
        token_ids=table.token_ids,
        logprobs=table.logprobs,
        num_top=num_top,
        top_token_ids=[t for i in rows for t in table.top_token_ids[i * top : i * top + num_top]],
        top_logprobs=[v for i in rows for v in table.top_logprobs[i * top : i * top + num_top]],
    )
