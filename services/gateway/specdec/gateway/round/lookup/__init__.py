"""Drafts that cost nothing: lookup proposers in the gateway (no torch, no RPC).

- `ngram` (specdec.gateway.round.lookup.ngram): prompt lookup over the request's prompt and output;
- `suffix` (specdec.gateway.round.lookup.suffix): suffix decoding over the request's own text and
  a bounded cache of recent outputs of this gateway (per tenant or global);
- a prediction (specdec.gateway.round.lookup.prediction): OpenAI's Predicted Outputs;
- `hybrid` (specdec.gateway.round.lookup.hybrid): a lookup draft where its match is confident,
  otherwise the draft model's draft, extended by prompt lookup.

A source's candidate continuations are merged into one token tree
(SpeculationParams.tree_width) by specdec.gateway.round.tree.

A lookup draft is a deterministic proposal: its distribution is one-hot, so the verifier's
rule (DESIGN §2) accepts it with probability p(d) and recovers from p without d.
"""

from __future__ import annotations

# Children of a tree's node: candidate continuations a round may verify as one tree.
from specdec.common.params import MAX_TREE_WIDTH as MAX_TREE_WIDTH
from specdec.gateway.names import DraftMethod, Source
from specdec.v1 import gateway_pb2

MODEL = DraftMethod.MODEL
NGRAM = DraftMethod.NGRAM
SUFFIX = DraftMethod.SUFFIX
HYBRID = DraftMethod.HYBRID
PREDICTION = Source.PREDICTION  # a draft source (any method), not a method

BY_NAME = {method.value: method.proto for method in DraftMethod}

SCOPES = ("global", "tenant", "off")


def parse_method(name: str) -> gateway_pb2.SpeculationMethod:
    """'model' / 'ngram' / 'suffix' / 'hybrid' -> the SpeculationMethod value; ValueError
    naming the choices."""
    try:
        return BY_NAME[name.strip().lower()]
    except KeyError:
        raise ValueError(f"must be one of {', '.join(BY_NAME)}, got {name!r}") from None
