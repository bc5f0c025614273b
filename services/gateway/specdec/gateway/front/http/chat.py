"""Chat for the HTTP API: the model's chat template, and chat turns over sessions.

`ChatTemplate` renders the replicas' own Jinja chat template the way transformers'
`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` does: the
same sandboxed environment and options (trim_blocks, lstrip_blocks, loop controls, a
`{% generation %}` tag), the same globals (raise_exception, strftime_now, tojson without
HTML escaping, dict, namespace) and the tokenizer's named special tokens as variables. The
gateway needs no transformers for it.

`ChatTurn` is the prompter of a chat request (specdec.gateway.front.turn.Prompter): it runs
inside the session's turn lock, with the session's record. A session's history is the
tokens the model saw and produced; a chat request sends the whole message list. The turn
continues the session when the rendered messages start with the history's text (decoded
with its special tokens, so a reply that ended in EOS lines up with the template's
end-of-turn token): only the rendered text after it is tokenized and appended, and both
replicas continue from their KV caches. Otherwise (another conversation under the same
id, an edited earlier message, a reply cut by a stop string) it starts the session
afresh from the whole rendered chat and says why (`restarted`). The Redis record is
unchanged: nothing but the token history is needed to decide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from specdec.common.errors import InvalidRequest
from specdec.gateway.front.http import schema
from specdec.gateway.front.http.errors import FieldError
from specdec.gateway.job import ContextLengthExceeded
from specdec.gateway.sessions import SessionRecord
from specdec.gateway.text import TextCodec

log = logging.getLogger(__name__)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant masks in transformers): the
    body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno
        )

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore attributes (as transformers' sandbox)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _Dict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    import json

    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> tuple[jinja2.Template, bool]:
    """The compiled template, and whether it reads `tools` (a template that never does
    would drop a request's tools without a word)."""
    env = _environment()
    variables = jinja2.meta.find_undeclared_variables(env.parse(template))
    return env.from_string(template), "tools" in variables


class ChatTemplate:
    """A tokenizer's chat template with its special tokens."""

    def __init__(self, template: str, special_tokens: Mapping[str, str]):
        if not template:
            raise InvalidRequest(
                "the served model has no chat template; use /v1/completions with a prompt"
            )
        try:
            self.template, self.takes_tools = _compile(template)
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the model's chat template does not compile: {e}") from None
        self.special_tokens = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat as text, as apply_chat_template(tokenize=False, tools=tools) renders it.
        Tools need a template that reads them (FieldError naming `tools` otherwise)."""
        if tools and not self.takes_tools:
            raise FieldError(
                "tools",
                "the served model's chat template does not take tools (it never reads "
                "`tools`): send the request without tools, or serve a model whose template "
                "renders them (Qwen2.5's does)",
            )
        # As transformers: keys whose value is None are dropped (OpenAI sends content=None).
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self.template.render(
                messages=chat,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:  # raise_exception() in the template, or a bug in it
            raise FieldError("messages", f"chat template: {e}") from None


def messages_from_json(raw: Any) -> list[dict[str, Any]]:
    """OpenAI's `messages` as the dicts a chat template expects (FieldError naming the
    field if bad: schema.Message declares them).

    Content given as a list of parts is joined into one string (text parts only), as vLLM
    does for string-content templates.
    """
    parsed = schema.parse(schema.Messages, {"messages": raw})
    return [m.template_dict() for m in parsed.messages]


@dataclass
class ChatTurn:
    """The prompter of one chat request (see the module docstring).

    `fill_context`: the request gave no max_tokens, so the completion may use what is left
    of the context, up to `max_new_tokens` (the gateway's limit). After the turn:
    `continued` (the session's history was extended), `restarted` (why a session with
    history started afresh, else None), `history_tokens`.
    """

    codec: TextCodec
    rendered: str
    session_id: str | None = None
    fill_context: bool = False
    max_context: int = 0
    max_new_tokens: int = 0
    continued: bool = False
    restarted: str | None = None
    history_tokens: int = 0

    async def __call__(
        self, record: SessionRecord | None
    ) -> tuple[SessionRecord | None, list[int], int | None]:
        record, ids = await self._prompt(record)
        if not self.fill_context:
            return record, ids, None
        room = self.max_context - len(ids) - (len(record.tokens) if record else 0)
        if room < 1:
            raise ContextLengthExceeded(
                f"the conversation fills the model's context of {self.max_context} tokens"
            )
        return record, ids, min(room, self.max_new_tokens)

    async def _prompt(self, record: SessionRecord | None) -> tuple[SessionRecord | None, list[int]]:
        if record is not None and record.tokens:
            history_text = await asyncio.to_thread(self._decode, record.tokens)
            if len(self.rendered) > len(history_text) and self.rendered.startswith(history_text):
                new = await asyncio.to_thread(
                    self.codec.encode, self.rendered[len(history_text) :], False
                )
                if new:
                    self.continued = True
                    self.history_tokens = len(record.tokens)
                    return record, new
            at = _common_prefix_length(history_text, self.rendered)
            self.restarted = (
                f"the messages do not extend session {self.session_id!r}: its history "
                f"({len(record.tokens)} tokens, {len(history_text)} characters rendered) "
                f"and the rendered messages differ from character {at}; started afresh"
            )
            log.info(
                "chat session started afresh",
                extra={"session_id": self.session_id, "history_tokens": len(record.tokens)},
            )
        ids = await asyncio.to_thread(self.codec.encode, self.rendered, False)
        if not ids:
            raise FieldError("messages", "the rendered chat is empty after tokenization")
        return None, ids

    def _decode(self, tokens: list[int]) -> str:
        return self.codec.tokenizer.decode(tokens, skip_special_tokens=False)


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
