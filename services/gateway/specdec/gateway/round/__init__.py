"""The round: one speculation round and what decides it.

- `loop`: `Speculator.round`, a round from its draft to its verdict (the token trees and
  SSD's prepared branches with it), returning one `Outcome`;
- `policy`: what each round drafts (the source, its length, the SSD fan-out: fixed or
  adaptive) and the draft sources' acceptance priors;
- `grammar`: structured output (the grammar engine, a matcher per request, a round's
  masks);
- `lookup/`: drafts that cost nothing (prompt lookup, suffix decoding, predictions,
  hybrid) and their token trees.

It may import the fleet (the calls of a round), the sessions, observe and the ground
floor; never the front, the service or config.
"""
