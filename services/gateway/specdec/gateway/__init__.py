"""The gateway: the public API, the speculation loop, the sessions (no torch).

Its wings, top to bottom (the import-linter contract in pyproject.toml holds them to this
order; docs/development.md has the map):

- `front/`: the gRPC and HTTP doors and the turn they both call;
- `service` and `config`: the gateway's start-up and shared state, and its settings;
- `round/`: one speculation round (the loop, the k policy, grammars, lookup drafts);
- `fleet/` (the replicas and the calls to them) beside `sessions/` (Redis);
- `observe/`: metrics, spans, recordings;
- the ground floor: `job` (a request's resolved parts), `outcome` (what a round did),
  `text` (tokenizer and output text) and `names` (the named values), which import no wing.
"""
