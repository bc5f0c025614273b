"""Run inside a private network namespace (`unshare -rn`) by test_openai_door.py:
`specdec up` with its default ports (gRPC 50051, HTTP 8000) on the tiny models, then the
official openai client, used as its own docs show (base URL http://127.0.0.1:8000/v1),
completes, streams and calls a tool. Prints one JSON object of what it saw; the test
asserts on it. The namespace is the test's own, so the default ports cannot collide with
anything else on the machine.

    python openai_door.py DRAFT_MODEL TARGET_MODEL LOG_DIR
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def loopback_up() -> None:
    """A new network namespace starts with its loopback down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, siocgifflags, request)[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH", b"lo", flags | iff_up))


def main() -> None:
    draft, target, logs = sys.argv[1:4]
    loopback_up()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "SPECDEC_FORK_SERVER", "SPECDEC_HTTP_PORT", "SPECDEC_PORT")
    }
    up = subprocess.Popen(
        [sys.executable, "-m", "specdec", "up", "--draft-model", draft, "--target-model", target,
         "--log-dir", logs],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if line.startswith("ready: curl"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    out: dict = {}
    try:
        ready.wait(600)
        out["up"] = list(lines)
        if up.poll() is not None:
            return
        client_calls(out)
    finally:
        up.send_signal(signal.SIGTERM)
        out["up_exit"] = up.wait(120)
        print(json.dumps(out))


def client_calls(out: dict) -> None:
    """The client's calls; each answer goes into `out` as it arrives."""
    from openai import OpenAI

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    model = client.models.list().data[0].id
    out["model"] = model
    hi = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model=model, messages=hi, max_tokens=8, temperature=0)
    out["chat"] = chat.model_dump()
    text = client.completions.create(model=model, prompt="def fib(n):", max_tokens=8)
    out["completion"] = text.model_dump()
    stream = client.chat.completions.create(
        model=model, messages=hi, max_tokens=8, temperature=0, stream=True
    )
    out["chat_stream"] = [chunk.model_dump() for chunk in stream]
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    for name, extra in [("tool", {}), ("tool_k0", {"extra_body": {"k": 0}})]:
        call = client.chat.completions.create(
            model=model,
            messages=weather,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=120,
            temperature=0,
            **extra,
        )
        out[name] = call.model_dump()
    stream = client.chat.completions.create(
        model=model,
        messages=weather,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    out["tool_stream"] = [chunk.model_dump() for chunk in stream]
    auto = client.chat.completions.create(
        model=model, messages=weather, tools=[WEATHER], max_tokens=8, temperature=0
    )
    out["tool_auto"] = auto.model_dump()
    # The call's result goes back as a `tool` message, after the assistant's call.
    message = call.choices[0].message
    follow = client.chat.completions.create(
        model=model,
        messages=[
            *weather,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
        ],
        tools=[WEATHER],
        max_tokens=8,
        temperature=0,
    )
    out["tool_follow_up"] = follow.model_dump()


if __name__ == "__main__":
    main()
