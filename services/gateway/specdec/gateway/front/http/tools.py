"""Tools (function calling) on /v1/chat/completions.

Tools change the prompt and the reading of the output, never the tokens: the request's
`tools` go to the model's own chat template (`tools=`, as transformers'
`apply_chat_template` passes them), and the text the model writes is read back into
OpenAI's `tool_calls`. The output tokens are the target model's, under speculation as
without it, so a tool call is as exact as any other field.

The calls are read in the Hermes format that Qwen2.5's template teaches the model (and
Hermes, Qwen3, ...): each call is a block `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`. A block whose JSON parses to an object with a string `name` (and
`arguments` an object, or absent) is a call; anything else (a malformed block, a block
cut by max_tokens, text around the blocks) stays content, as written.

`tool_choice`:
- "auto" (the default with tools): the template shows the tools; calls are read back.
- "none": the template is not shown the tools (earlier calls and results in the messages
  still are), and the output is content.
- "required" or {"type": "function", "function": {"name": ...}}: the output is forced to
  be calls by a grammar (structured output, `StructuredOutput.grammar`): `<tool_call>\\n`,
  a JSON object whose name is one of the tools (the named one) and whose arguments match
  that tool's parameters schema, `\\n</tool_call>`; several calls in a row unless
  `parallel_tool_calls` is false. The grammar masks the target's logits, so the output is
  still the target's distribution restricted to calls (as any structured output).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec.gateway.front.http.errors import FieldError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools and what it asks of them (None: no tools in play)."""

    tools: list[dict[str, Any]]
    mode: str  # "auto", "required" or "function" (a named function); "none" is no ToolChoice
    name: str = ""  # mode "function": the function's name
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode != "auto"

    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect) that forces calls (mode "required" or
        "function")."""
        tools = [t["function"] for t in self.tools]
        if self.mode == "function":
            tools = [f for f in tools if f["name"] == self.name]
        objects = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in tools
        ]
        schema: dict[str, Any] = objects[0] if len(objects) == 1 else {"anyOf": objects}
        # compact JSON, as response_format's (specdec.gateway.round.grammar.JSON_DEFAULTS)
        schema["x-guidance"] = {"whitespace_flexible": False}
        start = 'start: call ("\\n" call)*' if self.parallel else "start: call"
        return "\n".join(
            (
                start,
                f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
                f"body: %json {json.dumps(schema, ensure_ascii=False)}",
            )
        )


def tool_choice(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool | None
) -> ToolChoice | None:
    """The request's ToolChoice from its parsed `tools`, `tool_choice` and
    `parallel_tool_calls` (schema.ChatBody), or None when no tool is in play (no tools, or
    tool_choice "none"). FieldError names the field a contradiction is about."""
    name = ""
    if isinstance(choice, dict):
        mode, name = "function", choice["function"]["name"]
    else:
        mode = choice or "auto"
    if mode == "none":
        return None
    if not tools:
        if mode == "auto":  # what agent frameworks send with an empty tool list
            return None
        raise FieldError("tool_choice", f"tool_choice {_shown(choice)} needs tools")
    if mode == "function" and name not in [t["function"]["name"] for t in tools]:
        raise FieldError("tool_choice", f"tool_choice names the function {name!r}, not in tools")
    return ToolChoice(tools, mode, name, parallel is not False)


def _shown(choice: str | dict[str, Any] | None) -> str:
    return json.dumps(choice)


def _call(body: str) -> dict[str, Any] | None:
    """One block's call in OpenAI's shape, or None when it is not a call."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments' JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {
            "name": parsed["name"],
            "arguments": json.dumps(arguments, ensure_ascii=False),
        },
    }


@dataclass
class ToolCallReader:
    """Reads one choice's text, as it arrives, into content and tool calls.

    `feed(text)` and `finish()` return the deltas to send, in order: `{"content": str}` or
    `{"tool_calls": [call with its "index"]}`. Text that may still open a block (a prefix
    of `<tool_call>`) or is inside an open block is held until it is decided; whitespace
    at the end of content is held until more content (then sent with it) or a call (then
    dropped: the newlines around blocks are not content), and sent at the end when no
    call was read. None of it depends on where the text is cut into pieces, and a unary
    answer is the same reading of the whole text (`read`), so a stream and a unary answer
    agree.
    """

    calls: list[dict[str, Any]] = field(default_factory=list)
    _pending: str = ""  # text not yet decided
    _inside: bool = False  # after an opening tag
    _blank: str = ""  # whitespace-only content held back

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._pending += text
        while True:
            if self._inside:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE) :]
                self._inside = False
                call = _call(body)
                if call is None:
                    self._content(OPEN + body + CLOSE, out)
                    continue
                self._blank = ""
                call["index"] = len(self.calls)
                self.calls.append(call)
                out.append({"tool_calls": [call]})
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                self._content(self._pending[:start], out)
                self._pending = self._pending[start + len(OPEN) :]
                self._inside = True
                continue
            keep = _partial_tag(self._pending)
            self._content(self._pending[: len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep :]
            return out

    def finish(self) -> list[dict[str, Any]]:
        """The held text once the choice has ended: an unterminated block is content."""
        out: list[dict[str, Any]] = []
        rest = (OPEN if self._inside else "") + self._pending
        self._pending, self._inside = "", False
        self._content(rest, out)
        if self._blank and not self.calls:
            out.append({"content": self._blank})
        self._blank = ""
        return out

    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        """Content up to its last non-whitespace character; the whitespace after it waits
        for what follows (more content: sent with it; a call: dropped)."""
        text = self._blank + text
        sent = text.rstrip()
        if sent:
            out.append({"content": sent})
        self._blank = text[len(sent) :]


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def read(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole choice's (content, tool_calls): content None when it is only calls (and
    whitespace), as OpenAI answers; the calls without their stream `index`."""
    reader = ToolCallReader()
    deltas = reader.feed(text) + reader.finish()
    if not reader.calls:
        return text, []
    content = "".join(d["content"] for d in deltas if "content" in d)
    return content or None, [{k: v for k, v in c.items() if k != "index"} for c in reader.calls]
