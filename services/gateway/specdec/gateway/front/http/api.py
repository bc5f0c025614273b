"""OpenAI request bodies to the typed Request, and gateway events to OpenAI responses.

A thin translation: a body is parsed once by its declared schema
(specdec.gateway.front.http.schema: JSON types, OpenAI's field names, what the wire can hold)
into the SDK's typed Request (specdec.sdk.request), which goes to Gateway.run as it is (no
GenerateRequest on this path); every range that depends on the served model (max_tokens,
temperature, top_p, top_k, k, stop strings, session id, context) is checked by
specdec.gateway.job.Job.resolve, the same code the gRPC API runs. Its refusals name the
Request's field; `Options.fields` says which body field that is in this request.

Speculation settings are extension fields of the body, as vLLM accepts extra fields:
`k` (draft length; 0 = no speculation), `ssd` (bool), `k_policy` ("fixed" or "adaptive":
`k` is then an upper bound per round), `method` ("model", "ngram", "suffix" or
"hybrid": where drafts come from), `tree_width` (candidate continuations a round may
verify as one token tree), `session_id`, `session_reset`
(bool: forget the session's history first), `session_expected_turns` (the session's turns
the client saw complete, `specdec.session.turns` of its last response: a session that holds
fewer lost its history and is refused, 400 `session_lost`), `record` (false: the gateway's recording,
--record, skips this request) and `timeout` (seconds for the whole generation; past it
the answer is 504). Structured output: OpenAI's `response_format` (`json_object`,
`json_schema`) and vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` become
the Request's structured_output. Responses carry the
speculation statistics, timings, the token ids and, for a session, what happened to it
under the extension key `specdec`.

OpenAI's `prediction` ({"type": "content", "content": text or a list of text parts}) is
a source of drafts (the Request's prediction); usage reports
`completion_tokens_details.accepted_prediction_tokens` and `rejected_prediction_tokens`.
`user` names the tenant of the suffix cache under --suffix-cache-scope tenant.

Fields the gateway does not know are ignored and logged at debug level, as vLLM and SGLang
ignore them (benchmark tools and SDKs send extras); under --strict-fields they are refused.
OpenAI fields the gateway cannot honour (`tools`, `best_of > 1`, ...) are refused unless
they carry their neutral value. A bad value raises FieldError naming its body field
(`param` of the error body).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from specdec.gateway.front.http import schema
from specdec.gateway.front.http.errors import FieldError, ModelNotFound
from specdec.gateway.front.http.logprobs import LogprobsRenderer
from specdec.gateway.front.http.tools import ToolCallReader, ToolChoice, read, tool_choice
from specdec.gateway.front.response import Event
from specdec.sdk.request import Output, Request, Sampling, Scoring, Session, Speculation
from specdec.v1 import common_pb2, gateway_pb2

Scores = common_pb2.TokenLogprobs


EXTENSION = "specdec"

# OpenAI's default for /v1/completions when max_tokens is absent.
DEFAULT_COMPLETION_TOKENS = 16

# Body fields by the names of the typed parts' fields.
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling))
SPECULATION_FIELDS = tuple(f.name for f in dataclasses.fields(Speculation))

FINISH_REASON: dict[int, str] = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_EOS: "stop",
    gateway_pb2.FINISH_REASON_STOP: "stop",
}


@dataclass
class Options:
    """What the HTTP layer itself acts on (the rest travels in the Request)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk
    # carries the usage so far.
    continuous_usage: bool = False
    timeout: float | None = None
    session_id: str | None = None
    max_tokens_given: bool = False
    echo: bool = False  # completions: the prompt's text (and scores) before the completion
    user: str = ""  # OpenAI's end-user id: the suffix cache's tenant
    # The body field a request that cannot fit is about (errors.ErrorContext.prompt), and
    # the Request's field names -> this body's, where they differ (_body_names).
    prompt_field: str = "prompt"
    fields: dict[str, str] = field(default_factory=dict)
    # chat: the tools in play (None: none, or tool_choice "none"), which the chat template
    # is shown and whose calls are read from the output (specdec.gateway.front.http.tools)
    tools: ToolChoice | None = None


STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _body_names(given: Collection[str], chat: bool) -> dict[str, str]:
    """The body field each Request field came from, where the names differ: an error's
    `field` -> its `param` (errors.ErrorContext.fields); `given`: the body's fields that
    are not null."""
    prompt = "messages" if chat else "prompt"
    names = {
        "prompt": prompt,
        "token_ids": prompt,
        "max_new_tokens": "max_tokens",
        "reset_session": "session_reset",
        "prompt_logprobs": "echo",
    }
    if chat:
        if "max_completion_tokens" in given:
            names["max_new_tokens"] = "max_completion_tokens"
        elif "max_tokens" not in given:
            names["max_new_tokens"] = "min_tokens"  # the request's only length field
    else:
        names["top_logprobs"] = "logprobs"
    structured = [name for name in STRUCTURED_FIELDS if name in given]
    names["structured_output"] = structured[0] if structured else "response_format"
    return names


def check_model(model: str | None, served: str, aliases: Collection[str] = ()) -> str:
    """The served name, when the body's `model` is it or one of its aliases (or absent)."""
    if model is None:
        return served
    if model != served and model not in aliases:
        raise ModelNotFound(f"the model {model!r} does not exist; this server serves {served!r}")
    return served


def _structured(fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """response_format / guided_json / guided_regex / guided_choice (`fields`: the body's
    STRUCTURED_FIELDS): at most one (the grammar itself is checked by the gateway)."""
    regex, grammar = fields["guided_regex"], fields["guided_grammar"]
    given = {
        name: spec
        for name, spec in (
            ("guided_json", fields["guided_json"]),
            ("guided_regex", None if regex is None else {"regex": regex}),
            ("guided_choice", fields["guided_choice"]),
            ("guided_grammar", None if grammar is None else {"grammar": grammar}),
            ("response_format", fields["response_format"]),
        )
        if spec is not None
    }
    if len(given) > 1:
        names = list(given)
        raise FieldError(names[0], f"give one of {', '.join(names)}, not several")
    return next(iter(given.values()), None)


def _build(
    body: schema.Body,
    served: str,
    aliases: Collection[str],
    max_new_tokens: int,
    scoring: Scoring,
    prompt: str | None = None,
    token_ids: list[int] | None = None,
) -> tuple[Request, Options]:
    """The typed Request of a parsed body (specdec.sdk.request), and what the HTTP layer
    acts on itself."""
    opts = Options(model=check_model(body.model, served, aliases), stream=bool(body.stream))
    if body.stream_options is not None:
        if not opts.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream: true")
        opts.include_usage = bool(body.stream_options.include_usage)
        # as vLLM: continuous usage only with include_usage
        opts.continuous_usage = opts.include_usage and bool(
            body.stream_options.continuous_usage_stats
        )
    opts.timeout, opts.session_id, opts.user = body.timeout, body.session_id, body.user or ""
    sampling = {f: getattr(body, f) for f in SAMPLING_FIELDS}
    if sampling["top_k"] == -1:  # vLLM: -1 = off
        sampling["top_k"] = 0
    for name in ("presence_penalty", "frequency_penalty"):
        if sampling[name] is None:
            del sampling[name]
    request = Request(
        prompt=prompt,
        token_ids=token_ids,
        sampling=Sampling(**sampling),
        speculation=Speculation(**{f: getattr(body, f) for f in SPECULATION_FIELDS}),
        session=Session(
            session_id=body.session_id,
            reset_session=bool(body.session_reset),  # forget the session's history first
            session_expected_turns=body.session_expected_turns or 0,
        ),
        output=Output(
            max_new_tokens=max_new_tokens,
            stop=body.stop or (),
            stop_token_ids=body.stop_token_ids or (),
            ignore_eos=bool(body.ignore_eos),
            min_tokens=body.min_tokens or 0,
            n=body.n or 1,
            structured_output=_structured({n: getattr(body, n) for n in STRUCTURED_FIELDS}),
            prediction=body.prediction,
            record=body.record,
        ),
        scoring=scoring,
    )
    return request, opts


def completion_request(
    body: Any, served: str, aliases: Collection[str] = (), strict: bool = False
) -> tuple[Request, Options]:
    """POST /v1/completions body -> (Request, Options). `aliases`: other names `model`
    may give; `strict`: unknown fields are refused (--strict-fields)."""
    parsed: schema.CompletionBody = schema.parse(schema.CompletionBody, body, strict)
    prompt = parsed.prompt
    if prompt is None:
        raise FieldError("prompt", "prompt must be a string or a list of token ids")
    logprobs = parsed.logprobs  # alternatives per token (legacy)
    echo = bool(parsed.echo)
    scoring = Scoring(
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        prompt_logprobs=echo and logprobs is not None,
    )
    max_tokens = parsed.max_tokens
    request, opts = _build(
        parsed,
        served,
        aliases,
        DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens,
        scoring,
        prompt=prompt if isinstance(prompt, str) else None,
        token_ids=prompt if isinstance(prompt, list) else None,
    )
    opts.max_tokens_given, opts.echo = max_tokens is not None, echo
    opts.fields = _body_names({n for n, v in body.items() if v is not None}, chat=False)
    return request, opts


def chat_request(
    body: Any, served: str, aliases: Collection[str] = (), strict: bool = False
) -> tuple[Request, Options, list[dict[str, Any]]]:
    """POST /v1/chat/completions body -> (Request without its prompt, Options, messages).
    The caller renders the messages into `prompt`. Without max_tokens a chat may use what
    is left of the context, up to the gateway's --max-new-tokens: ChatTurn sets it once the
    prompt's length is known (the request carries 1, or min_tokens, meanwhile)."""
    parsed: schema.ChatBody = schema.parse(schema.ChatBody, body, strict)
    if parsed.max_tokens is not None and parsed.max_completion_tokens is not None:
        raise FieldError(
            "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
        )
    max_tokens = parsed.max_completion_tokens
    if max_tokens is None:
        max_tokens = parsed.max_tokens
    top = parsed.top_logprobs
    if top is not None and not parsed.logprobs:
        raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
    scoring = Scoring(logprobs=bool(parsed.logprobs), top_logprobs=top or 0)
    # Without max_tokens ChatTurn sets it from the context; min_tokens must fit meanwhile.
    fill = max(1, parsed.min_tokens or 0) if max_tokens is None else max_tokens
    request, opts = _build(parsed, served, aliases, fill, scoring)
    opts.max_tokens_given = max_tokens is not None
    opts.prompt_field, opts.fields = (
        "messages",
        _body_names({n for n, v in body.items() if v is not None}, chat=True),
    )
    opts.tools = tool_choice(parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls)
    if opts.tools is not None and opts.tools.forced:
        if request.output.structured_output is not None:
            raise FieldError(
                "tool_choice",
                f"tool_choice {opts.tools.mode!r} forces the output to be tool calls: give "
                "it without response_format or guided_*",
            )
        grammar = {"grammar": opts.tools.grammar()}
        output = dataclasses.replace(request.output, structured_output=grammar)
        request = dataclasses.replace(request, output=output)
        opts.fields["structured_output"] = "tools"  # a tool's parameters schema
    return request, opts, [m.template_dict() for m in parsed.messages]


def proto_dict(msg: Message) -> dict[str, Any]:
    """A proto message's fields as plain JSON values (defaults included)."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None:
            out[f.name] = [proto_dict(v) for v in value] if f.is_repeated else proto_dict(value)
        else:
            out[f.name] = list(value) if f.is_repeated else value
    return out


def usage(final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    """OpenAI's usage object. prompt_tokens counts the whole context the completion was
    conditioned on (a session's history included); cached_tokens is that history."""
    u = final.usage
    prompt = u.prompt_tokens + u.history_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": u.completion_tokens,
        "total_tokens": prompt + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.history_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
        },
    }


@dataclass
class Renderer:
    """Builds one request's OpenAI objects (unary body, stream chunks)."""

    chat: bool
    model: str
    session: dict[str, Any] | None = None  # filled by the route once the turn has run
    trace_id: str = ""  # the request's trace (tracing on)
    completion_tokens: int = 0  # tokens rendered so far (continuous usage)
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    scores: LogprobsRenderer | None = None  # the served tokenizer, for logprobs
    echo: str | None = None  # completions with echo: the prompt's text
    prompt_scores: bool = False  # echo with logprobs: the prompt's rows first
    tools: bool = False  # chat with tools in play: tool calls are read from the text
    _readers: dict[int, ToolCallReader] = field(default_factory=dict)  # per choice (stream)
    _started: set[int] = field(default_factory=set)  # choices whose stream has begun
    _offsets: dict[int, int] = field(default_factory=dict)  # per choice: text offset
    _prompt: Any = None  # echo in a stream: the prompt's scores (choice 0's first event)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def extension(
        self, final: gateway_pb2.GenerateResponse, token_ids: list[int]
    ) -> dict[str, Any]:
        ext: dict[str, Any] = {
            "token_ids": token_ids,
            "stats": proto_dict(final.stats),
            "timings": proto_dict(final.timings),
        }
        if self.session is not None:
            ext["session"] = self.session
        if self.trace_id:
            ext["trace_id"] = self.trace_id
        return ext

    def _logprobs(
        self, table: Scores | None, prompt: Scores | None = None, offset: int = 0
    ) -> tuple[dict[str, Any] | None, int]:
        """A choice's (or a delta's) OpenAI logprobs, None when not asked; the text offset
        after it (completions)."""
        if self.scores is None or table is None:
            return None, offset
        if self.chat:
            return self.scores.chat(table), offset
        return self.scores.completion([t for t in (prompt, table) if t is not None], offset)

    def _finish_reason(self, finish: int, calls: int) -> str | None:
        """OpenAI's finish_reason; "tool_calls" when the model ended (EOS or a stop) after
        writing tool calls."""
        reason = FINISH_REASON.get(finish)
        return "tool_calls" if calls and reason == "stop" else reason

    def _choice(
        self, index: int, text: str, finish: int, table: Scores | None, prompt: Scores | None
    ) -> dict[str, Any]:
        logprobs, _ = self._logprobs(table, prompt)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls: list[dict[str, Any]] = []
            if self.tools:
                message["content"], calls = read(text)
                if calls:
                    message["tool_calls"] = calls
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self._finish_reason(finish, len(calls)),
            }
        text = text if self.echo is None else self.echo + text
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": FINISH_REASON.get(finish),
        }

    def body(self, final: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        prompt = final.prompt_logprobs if self.prompt_scores else None
        choices = [
            self._choice(c.index, c.text, c.finish_reason, c.logprobs, prompt)
            for c in final.choices
        ] or [self._choice(0, final.text, final.finish_reason, final.logprobs, prompt)]
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(final),
            EXTENSION: self.extension(final, list(final.token_ids)),
        }

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def chunks(
        self, event: Event, include_usage: bool, continuous_usage: bool = False
    ) -> list[dict[str, Any]]:
        """The stream chunks for one event (specdec.gateway.front.response.Event): the delta of its
        choice, then at a choice's end a chunk with its finish reason and, on the last
        event, the statistics and the usage chunk if asked. continuous_usage: every chunk
        carries the usage so far (prompt_tokens: the event's context_tokens, a session's
        history included), as vLLM's continuous_usage_stats."""
        out = []
        index, tokens, final = event.index, list(event.tokens), event.final
        self.completion_tokens += len(tokens)
        usage_field: dict[str, Any] = {"usage": None} if include_usage else {}
        if continuous_usage:
            usage_field["usage"] = {
                "prompt_tokens": event.context_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": event.context_tokens + self.completion_tokens,
            }
        if self.chat and index not in self._started:
            self._started.add(index)
            out.append(
                self._chunk(
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage_field,
                )
            )
        if event.prompt_logprobs is not None:
            self._prompt = event.prompt_logprobs
        if self.echo is not None and index not in self._started:  # echo: the prompt first
            self._started.add(index)
            table = self._prompt if self.prompt_scores else None
            logprobs, self._offsets[index] = self._logprobs(table, None, 0)
            choice = {"index": index, "text": self.echo, "logprobs": logprobs}
            out.append(self._chunk([{**choice, "finish_reason": None}], **usage_field))
        reader = self._readers.setdefault(index, ToolCallReader()) if self.tools else None
        if event.text or tokens:
            logprobs, self._offsets[index] = self._logprobs(
                event.logprobs, None, self._offsets.get(index, 0)
            )
            deltas: list[dict[str, Any]]
            if not self.chat:
                deltas = [{"text": event.text}]
            elif reader is None:
                deltas = [{"delta": {"content": event.text}}]
            else:  # the text held until it is content or a call; this event's extras once
                deltas = [{"delta": d} for d in reader.feed(event.text)] or [{"delta": {}}]
            for i, delta in enumerate(deltas):
                choice = {"index": index, **delta, "logprobs": None, "finish_reason": None}
                extra: dict[str, Any] = {}
                if i == 0:
                    choice["logprobs"], extra = logprobs, {EXTENSION: {"token_ids": tokens}}
                out.append(self._chunk([choice], **usage_field, **extra))
        ended = event.choice if event.choice is not None else final
        if ended is not None:
            calls = 0
            if reader is not None:
                for delta in reader.finish():
                    choice = {"index": index, "delta": delta, "logprobs": None}
                    out.append(self._chunk([{**choice, "finish_reason": None}], **usage_field))
                calls = len(reader.calls)
            finish = self._finish_reason(ended.finish_reason, calls)
            choice = (
                {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
                if self.chat
                else {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
            )
            ext = {EXTENSION: self.extension(final, [])} if final is not None else {}
            out.append(self._chunk([choice], **usage_field, **ext))
        if final is not None and include_usage:
            out.append(self._chunk([], usage=usage(final)))
        return out
