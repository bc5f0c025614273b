"""`specdec loadtest --api openai`: the gateway's OpenAI-compatible HTTP API as a Backend.

Each turn is one streamed `POST /v1/completions` (server-sent events, with
`stream_options.include_usage`), the same workload as the gRPC backend: the turn's text is
the prompt, a conversation's turns share a `session_id` (the first turn sends
`session_reset`), and the mode's `k` / `ssd` go as the API's extension fields. Chunks are
timed as they arrive; the token ids and speculation statistics come from the `specdec`
extension of the chunks. Errors become SDK exceptions with the gRPC code the gateway
names in the error body (`code`), so the report counts them like the gRPC backend's.

`--gateway` is the HTTP API's HOST:PORT or base URL (`http://host:8000/v1`); the bearer
token, if the gateway asks for one (`--api-key`), comes from OPENAI_API_KEY. Needs
`httpx` (`pip install 'specdec-sdk[loadtest]'`).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc

from specdec.sdk.errors import SpecdecError, error_for
from specdec.sdk.loadtest.workload import Mode, RequestSettings
from specdec.sdk.types import Generation, SpeculationStats, StreamChunk, Timings, Usage

# By HTTP status, when an error body names no gRPC code.
_BY_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_FINISH = {"length": "length", "stop": "stop"}


def base_url(address: str) -> str:
    """HOST:PORT or a URL -> the API's base URL ending in /v1."""
    url = address if address.startswith(("http://", "https://")) else f"http://{address}"
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def error_from(status: int, body: Any) -> SpecdecError:
    """The SDK exception for an OpenAI-shaped error (HTTP status and body)."""
    err = body.get("error", body) if isinstance(body, dict) else {}
    message = err.get("message") if isinstance(err, dict) else None
    named = err.get("code") if isinstance(err, dict) else None
    code = grpc.StatusCode.__members__.get(str(named).upper()) if named else None
    if code is None:
        code = _BY_STATUS.get(status, grpc.StatusCode.UNKNOWN)
    details = message or f"HTTP {status}: {str(body)[:200]}"
    return error_for(code, details)


def _stats(raw: dict[str, Any]) -> SpeculationStats:
    fields = SpeculationStats.__dataclass_fields__
    values = {k: v for k, v in raw.items() if k in fields}
    if "accepted_per_position" in values:
        values["accepted_per_position"] = tuple(values["accepted_per_position"])
    return SpeculationStats(**values)


class OpenAIBackend:
    """The gateway's OpenAI-compatible HTTP API through httpx (streamed completions)."""

    name = "openai"

    def __init__(self, address: str, timeout: float):
        try:
            import httpx
        except ImportError:
            raise ValueError(
                "--api openai needs httpx: pip install 'specdec-sdk[loadtest]'"
            ) from None
        headers = {}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        self.url = base_url(address)
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=timeout,
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._http_error = httpx.HTTPError
        self.model: str | None = None

    async def _model(self) -> str:
        if self.model is None:
            try:
                r = await self.client.get("/models")
            except self._http_error as e:
                raise SpecdecError(f"{self.url}: {e}", grpc.StatusCode.UNAVAILABLE) from None
            if r.status_code != 200:
                raise error_from(r.status_code, _json(r.content))
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def stream(
        self,
        text: str,
        mode: Mode,
        settings: RequestSettings,
        seed: int | None,
        session_id: str | None,
        first_turn: bool,
    ) -> AsyncIterator[StreamChunk]:
        body: dict[str, Any] = {
            "model": await self._model(),
            "prompt": text,
            "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if settings.top_p is not None:
            body["top_p"] = settings.top_p
        if settings.top_k:
            body["top_k"] = settings.top_k
        if settings.stop:
            body["stop"] = list(settings.stop)
        if seed is not None:
            body["seed"] = seed
        if session_id:
            body["session_id"] = session_id
            if first_turn:
                body["session_reset"] = True
        if mode.k is not None:
            body["k"] = mode.k
        if mode.ssd is not None:
            body["ssd"] = mode.ssd
        if mode.k_policy is not None:
            body["k_policy"] = mode.k_policy
        if mode.method is not None:
            body["method"] = mode.method
        if mode.tree_width is not None:
            body["tree_width"] = mode.tree_width
        try:
            async for chunk in self._stream(body):
                yield chunk
        except self._http_error as e:
            raise SpecdecError(f"{self.url}: {e}", grpc.StatusCode.UNAVAILABLE) from None

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[StreamChunk]:
        texts: list[str] = []
        tokens: list[int] = []
        finish = ""
        stats: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        usage: dict[str, Any] = {}
        async with self.client.stream("POST", "/completions", json=body) as r:
            if r.status_code != 200:
                raise error_from(r.status_code, _json(await r.aread()))
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise error_from(500, obj)
                if obj.get("usage"):
                    usage = obj["usage"]
                if not obj.get("choices"):
                    continue
                choice = obj["choices"][0]
                ext = obj.get("specdec") or {}
                ids = tuple(ext.get("token_ids") or ())
                if choice.get("finish_reason"):
                    finish = _FINISH.get(choice["finish_reason"], choice["finish_reason"])
                    stats, timings = ext.get("stats") or {}, ext.get("timings") or {}
                if choice.get("text") or ids:
                    texts.append(choice.get("text") or "")
                    tokens.extend(ids)
                    yield StreamChunk(choice.get("text") or "", ids)
        if not finish or not usage:
            raise SpecdecError(
                "the stream ended without a finish reason and usage", grpc.StatusCode.INTERNAL
            )
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        final = Generation(
            text="".join(texts),
            tokens=tuple(tokens),
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=usage["prompt_tokens"] - cached,  # as gRPC: without the history
                completion_tokens=usage["completion_tokens"],
                history_tokens=cached,
            ),
            timings=Timings(
                **{k: v for k, v in timings.items() if k in Timings.__dataclass_fields__}
            ),
            stats=_stats(stats),
            session_id=body.get("session_id", ""),
        )
        yield StreamChunk("", (), final)

    async def suffix_cache_scope(self) -> str | None:
        return None  # the OpenAI API does not say

    async def close(self) -> None:
        await self.client.aclose()


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return content.decode(errors="replace")
