"""The front: what serves a request, from the two doors to its completions.

- `server`: the gRPC door (GatewayService over `Gateway`) and the process's bootstrap;
- `http/`: the OpenAI-compatible HTTP door (its body schema, chat templates, tool calls,
  errors and log-probabilities as OpenAI writes them);
- `turn`: `Gateway`, the session turn both doors call: the request validated, the
  session's turn lock and history, its completion(s), the history written back;
- `choices` (n > 1 sharing a prefill) and `completion` (one completion's rounds, its
  text and its scores: `logprobs`);
- `response`: what a turn returns (the GenerateResponse, the stream's messages, the
  request's metrics);
- `info`: GetServerInfo and /v1/models (the model, the limits, the supported fields).

The top wing: it may import the service and config, every other wing and the ground
floor; only the entry point (`cli`) imports it.
"""
