"""The fleet: the drafter and verifier replicas, and how a round's calls reach them.

- `caller`: `ReplicaCaller`, one request's calls (cache misses, busy replicas, failover),
  each sent as a CLIENT span;
- `transport` (a call over gRPC) and `dataplane` (over the data plane's framed TCP);
- `replicas`: the pools (admission, health, load, routing);
- `discovery`: where a role's replicas are (a static list, DNS, Kubernetes);
- `placement`: which replica holds a request's cache and how much of it;
- `canary`: which drafter version a session goes to.

It may import observe and the ground floor; never the round, the sessions, the front,
the service or config.
"""
