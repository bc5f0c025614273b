"""The OpenAI door is open by default: the openai-python client, used as its own docs show
(base URL http://HOST:8000/v1), completes, streams and calls a tool against `specdec up`
with no port flag, on the tiny models.

`specdec up` runs with its default ports, so the test runs it in a private network
namespace of its own (`unshare -rn`: a user namespace mapping this user to root, and a
fresh network with only a loopback), where nothing else can hold 8000 or 50051. The tiny
models' chat template takes tools as Qwen2.5's does; a random tiny model would never write
a tool call by chance, so the calls are forced with tool_choice "required" and a named
function: the grammar keeps the output to calls, and what the model writes inside it (the
city) is its own, read back from its text into `tool_calls`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("openai_door.py")


def _namespaces() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    return subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def door(test_models, tmp_path_factory):
    if not _namespaces():
        pytest.skip("needs `unshare -rn` (unprivileged user and network namespaces)")
    logs = tmp_path_factory.mktemp("door-logs")
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, str(SCRIPT), str(test_models.draft_noisy),
         str(test_models.target), str(logs)],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert done.stdout.strip(), done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr + "".join(out.get("up", []))
    return out


def test_up_announces_the_base_url_and_a_curl(door):
    up = door["up"]
    assert "openai    http://127.0.0.1:8000/v1\n" in up
    (curl,) = [line for line in up if line.startswith("ready: curl")]
    assert "http://127.0.0.1:8000/v1/chat/completions" in curl
    assert f'"model": "{door["model"]}"' in curl
    assert door["up_exit"] == 0


def test_the_client_completes_and_streams(door):
    chat = door["chat"]
    assert chat["object"] == "chat.completion" and chat["model"] == door["model"]
    assert chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["finish_reason"] == "length"
    assert door["completion"]["choices"][0]["text"]
    chunks = door["chat_stream"]
    streamed = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    assert streamed == chat["choices"][0]["message"]["content"]


def _arguments(call: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    return json.loads(call["function"]["arguments"])


def test_the_client_calls_a_tool(door):
    """tool_choice "required": the answer is a call, read from the model's own text, with
    finish_reason tool_calls; the same tokens with speculation as without (k = 0)."""
    choice = door["tool"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert _arguments(call)["city"] in ("Paris", "Tokyo")
    tokens = door["tool"]["specdec"]["token_ids"]
    assert tokens == door["tool_k0"]["specdec"]["token_ids"]
    assert door["tool"]["specdec"]["stats"]["draft_tokens"] > 0  # speculated
    assert door["tool_k0"]["specdec"]["stats"]["draft_tokens"] == 0
    assert door["tool_k0"]["choices"][0]["message"]["tool_calls"][0]["function"] == call["function"]


def test_the_client_streams_a_tool_call(door):
    """A named function, streamed: the call arrives whole in a delta's tool_calls (index 0),
    then finish_reason tool_calls; the same call as the unary answer's."""
    chunks = [c for c in door["tool_stream"] if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    (call,) = calls
    assert call["index"] == 0
    assert call["function"] == door["tool"]["choices"][0]["message"]["tool_calls"][0]["function"]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_and_a_tool_result(door):
    """tool_choice auto (the default with tools): this model writes text, which stays
    content; a conversation with the call and its result (role tool) is accepted."""
    auto = door["tool_auto"]["choices"][0]
    assert auto["message"]["content"] and not auto["message"]["tool_calls"]
    assert auto["finish_reason"] == "length"
    follow = door["tool_follow_up"]
    assert follow["choices"][0]["finish_reason"] == "length"
    assert follow["usage"]["prompt_tokens"] > door["tool_auto"]["usage"]["prompt_tokens"]
