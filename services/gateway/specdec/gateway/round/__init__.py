"""The round: one speculation round and what decides it.

- `loop`: `Speculator.round`, a round from its draft to its verdict, returning one
  `Outcome`;
- `draft`: where a round's draft comes from (`Drafts`: a lookup, the draft model, SSD's
  prepared draft, hybrid's extension, a grafted prediction);
- `ssd`: SSD's Speculate beside the Verify, its verdict and the drafts it prepared;
- `calls`: the Draft and Verify calls, and the placements their answers move;
- `tree`: a draft as a token tree (`DraftTree`: merge, graft, the accepted path's branch);
- `policy`: what each round drafts (the source, its length, the SSD fan-out: fixed or
  adaptive) and the draft sources' acceptance priors;
- `grammar`: structured output (the grammar engine, a matcher per request, a round's
  masks);
- `lookup/`: drafts that cost nothing (prompt lookup, suffix decoding, predictions,
  hybrid).

It may import the fleet (the calls of a round), the sessions, observe and the ground
floor; never the front, the service or config.
"""
