"""Observe: what the gateway reports of itself.

- `metrics`: its Prometheus metrics (specdec_gateway_*);
- `tracing`: the spans of a request, of its rounds and of its Redis operations;
- `recorder`: finished turns written for drafter distillation (`--record DIR`).

It may import the ground floor only; every wing imports it.
"""
