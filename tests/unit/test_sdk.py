"""The client SDK (specdec.sdk): request building, response conversion, errors, CLI, wire.

Nothing here needs a gateway: the transport tests run against a small in-process echo
servicer (see ``EchoGateway``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from specdec.sdk import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    Generation,
    InternalError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecdecError,
    StreamChunk,
    Unavailable,
    Unimplemented,
    build_generate_request,
    from_rpc_error,
)
from specdec.sdk.cli_generate import add_generate_parser, run_generate
from specdec.sdk.client import MAX_MESSAGE_BYTES, channel_options
from specdec.sdk.types import StreamAssembler, generation_from_proto
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- requests


def test_request_all_fields():
    req = build_generate_request(
        "hello",
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=1234,
        stop=["\n\n", "END"],
        session_id="s-1",
        reset_session=True,
        session_ttl_seconds=600,
        k=5,
        ssd=False,
    )
    assert req.WhichOneof("input") == "prompt"
    assert req.prompt == "hello"
    assert req.max_new_tokens == 7
    assert req.sampling.temperature == pytest.approx(0.5)
    assert req.sampling.top_p == pytest.approx(0.9)
    assert req.sampling.top_k == 40
    assert req.sampling.HasField("seed") and req.sampling.seed == 1234
    assert list(req.stop) == ["\n\n", "END"]
    assert req.session.id == "s-1"
    assert req.session.mode == gateway_pb2.SESSION_MODE_RESET
    assert req.session.ttl_seconds == 600
    assert req.speculation.HasField("num_draft_tokens")
    assert req.speculation.num_draft_tokens == 5
    assert req.speculation.HasField("ssd") and req.speculation.ssd is False


def test_request_defaults_leave_optional_fields_unset():
    req = build_generate_request("hi")
    assert req.max_new_tokens == 128
    # Unset sampling takes the model's generation_config at the gateway (model_defaults).
    assert req.sampling.model_defaults
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        assert not req.sampling.HasField(name), name
    assert list(req.stop) == []
    assert not req.HasField("session")
    assert not req.HasField("speculation")
    assert not req.speculation.HasField("num_draft_tokens")
    assert not req.speculation.HasField("ssd")


def test_request_k_zero_and_ssd_alone_are_set():
    req = build_generate_request("hi", k=0)
    assert req.speculation.HasField("num_draft_tokens") and req.speculation.num_draft_tokens == 0
    assert not req.speculation.HasField("ssd")
    req = build_generate_request("hi", ssd=True)
    assert not req.speculation.HasField("num_draft_tokens")
    assert req.speculation.HasField("ssd") and req.speculation.ssd is True
    req = build_generate_request("hi", seed=0)
    assert req.sampling.HasField("seed") and req.sampling.seed == 0


def test_request_token_ids_and_continue_session():
    req = build_generate_request(token_ids=[5, 6, 7], session_id="abc")
    assert req.WhichOneof("input") == "prompt_token_ids"
    assert list(req.prompt_token_ids.ids) == [5, 6, 7]
    assert req.session.mode == gateway_pb2.SESSION_MODE_CONTINUE
    assert req.session.ttl_seconds == 0
    # An empty prompt is still a prompt (the oneof is set).
    assert build_generate_request("").WhichOneof("input") == "prompt"


def test_request_single_stop_string_is_one_stop():
    assert list(build_generate_request("x", stop="\n").stop) == ["\n"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"prompt": "x", "token_ids": [1]},
        {"prompt": None, "token_ids": None},
    ],
)
def test_request_needs_exactly_one_input(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_request(**kwargs)


def test_request_invalid_arguments_raise_client_side():
    with pytest.raises(ValueError):
        build_generate_request("x", reset_session=True)
    with pytest.raises(ValueError):
        build_generate_request("x", seed=-1)  # uint64
    with pytest.raises(TypeError):
        build_generate_request(token_ids="1,2")
    with pytest.raises(TypeError):
        build_generate_request(b"bytes")  # type: ignore[arg-type]


def test_client_methods_share_the_request_signature():
    """generate/stream of both clients take exactly build_generate_request's args + timeout."""
    expected = list(inspect.signature(build_generate_request).parameters.values())
    for method in (Client.generate, Client.stream, AsyncClient.generate, AsyncClient.stream):
        params = list(inspect.signature(method).parameters.values())
        assert params[0].name == "self"
        assert params[-1].name == "timeout" and params[-1].kind is inspect.Parameter.KEYWORD_ONLY
        got = [(p.name, p.kind, p.default) for p in params[1:-1]]
        assert got == [(p.name, p.kind, p.default) for p in expected], method


def test_channel_options():
    opts = dict(channel_options())
    assert opts["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES == 64 * 1024 * 1024
    assert opts["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES
    opts = dict(channel_options([("grpc.max_receive_message_length", 1), ("grpc.x", "y")]))
    assert opts["grpc.max_receive_message_length"] == 1 and opts["grpc.x"] == "y"


# --------------------------------------------------------------------------- responses


STATS = {
    "rounds": 3,
    "draft_tokens": 12,
    "accepted_tokens": 9,
    "acceptance_rate": 0.75,
    "mean_accepted_length": 4.0,
    "accepted_per_position": [3, 3, 2, 1],
    "num_draft_tokens": 4,
    "ssd": True,
    "ssd_hits": 2,
    "ssd_misses": 1,
    "cache_misses": 1,
    "ssd_branches": 12,
    "ssd_hidden_ms": 150.0,
    "drafter_wait_ms": 20.0,
    "ssd_bytes": 300,
    "ssd_late": 1,
    "ssd_speculates": 3,
    "rounds_by_k": [0, 0, 0, 0, 3],
    "mean_k": 4.0,
    "policy_k0_rounds": 0,
    "mean_fan_out": 4.5,
    "ssd_paused_rounds": 0,
    "mean_verifier_queue": 1.5,
    "drafter_version": "distill-v2",
    "recorded": True,
}


def _stats(**overrides) -> gateway_pb2.SpeculationStats:
    return gateway_pb2.SpeculationStats(
        **{**STATS, "k_policy": gateway_pb2.K_POLICY_ADAPTIVE, **overrides}
    )


def test_generation_from_proto():
    msg = gateway_pb2.GenerateResponse(
        text="hello world",
        token_ids=[10, 11, 12],
        finish_reason=gateway_pb2.FINISH_REASON_EOS,
        usage=gateway_pb2.Usage(prompt_tokens=4, completion_tokens=3, history_tokens=20),
        timings=gateway_pb2.Timings(time_to_first_token_ms=12.5, total_ms=40.0),
        stats=_stats(acceptance_rate=0.8),
        session_id="s-9",
    )
    gen = generation_from_proto(msg)
    assert isinstance(gen, Generation)
    assert gen.text == "hello world"
    assert gen.tokens == (10, 11, 12)
    assert gen.finish_reason == "eos"
    assert (gen.usage.prompt_tokens, gen.usage.completion_tokens, gen.usage.history_tokens) == (
        4,
        3,
        20,
    )
    assert gen.timings.time_to_first_token_ms == 12.5 and gen.timings.total_ms == 40.0
    s = gen.stats
    assert (s.rounds, s.draft_tokens, s.accepted_tokens) == (3, 12, 9)
    assert s.acceptance_rate == 0.8  # float32 0.8 reads back as 0.8, not 0.800000011920929
    assert s.mean_accepted_length == 4.0
    assert s.accepted_per_position == (3, 3, 2, 1)
    assert (s.num_draft_tokens, s.ssd, s.ssd_hits, s.ssd_misses, s.cache_misses) == (
        4,
        True,
        2,
        1,
        1,
    )
    assert gen.session_id == "s-9"
    assert gen.tokens_per_second == pytest.approx(3 / 0.04)
    with pytest.raises(AttributeError):
        gen.text = "frozen"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("reason", "name"),
    [
        (gateway_pb2.FINISH_REASON_LENGTH, "length"),
        (gateway_pb2.FINISH_REASON_EOS, "eos"),
        (gateway_pb2.FINISH_REASON_STOP, "stop"),
        (gateway_pb2.FINISH_REASON_UNSPECIFIED, "unknown"),
    ],
)
def test_finish_reasons(reason, name):
    gen = generation_from_proto(gateway_pb2.GenerateResponse(finish_reason=reason))
    assert gen.finish_reason == name


def test_to_dict_is_json_serialisable():
    gen = generation_from_proto(
        gateway_pb2.GenerateResponse(
            text="é\n",
            token_ids=[1, 2],
            finish_reason=gateway_pb2.FINISH_REASON_STOP,
            usage=gateway_pb2.Usage(prompt_tokens=1, completion_tokens=2, session_turns=3),
            stats=_stats(),
            session_id="s",
        )
    )
    d = json.loads(json.dumps(gen.to_dict()))
    assert d["text"] == "é\n"
    assert d["tokens"] == [1, 2]
    assert d["finish_reason"] == "stop"
    assert d["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "history_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
        "session_turns": 3,
    }
    assert d["timings"] == {"time_to_first_token_ms": 0.0, "total_ms": 0.0}
    assert d["session_id"] == "s"
    assert d["stats"] == {
        **STATS,
        "k_policy": "adaptive",
        "ssd_hit_rate": 2 / 3,
        "method": "",
        "by_source": {},
        "lookup_no_match_rounds": 0,
        "tree_rounds": 0,
        "tree_nodes": 0,
        "tree_other_branch_rounds": 0,
        "feature_bytes": 0,
    }


def test_stream_assembler_concatenates_deltas():
    messages = [
        gateway_pb2.GenerateStreamResponse(text="Hel", token_ids=[1, 2]),
        gateway_pb2.GenerateStreamResponse(text="", token_ids=[3]),  # a partial UTF-8 char
        gateway_pb2.GenerateStreamResponse(text="lo", token_ids=[4]),
        gateway_pb2.GenerateStreamResponse(
            text="!",
            token_ids=[5],
            finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
            usage=gateway_pb2.Usage(prompt_tokens=2, completion_tokens=5),
            timings=gateway_pb2.Timings(time_to_first_token_ms=1.0, total_ms=2.0),
            stats=_stats(),
            session_id="s",
        ),
    ]
    assembler = StreamAssembler()
    chunks = [assembler.feed(m) for m in messages]
    assert all(isinstance(c, StreamChunk) for c in chunks)
    assert [c.text for c in chunks] == ["Hel", "", "lo", "!"]
    assert [c.tokens for c in chunks] == [(1, 2), (3,), (4,), (5,)]
    assert [c.final is None for c in chunks] == [True, True, True, False]
    final = chunks[-1].final
    assert final is assembler.finish()
    assert final.text == "Hello!" == "".join(c.text for c in chunks)
    assert final.tokens == (1, 2, 3, 4, 5)
    assert final.finish_reason == "length"
    assert final.usage.completion_tokens == 5
    assert final.timings.total_ms == 2.0
    assert final.stats.accepted_per_position == (3, 3, 2, 1)
    assert final.session_id == "s"


def test_stream_assembler_protocol_violations():
    assembler = StreamAssembler()
    assembler.feed(gateway_pb2.GenerateStreamResponse(text="a", token_ids=[1]))
    with pytest.raises(InternalError, match="without a final"):
        assembler.finish()
    assembler.feed(gateway_pb2.GenerateStreamResponse(finish_reason=gateway_pb2.FINISH_REASON_EOS))
    with pytest.raises(InternalError, match="after its final"):
        assembler.feed(gateway_pb2.GenerateStreamResponse(text="b"))


# --------------------------------------------------------------------------- errors


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.UNIMPLEMENTED, Unimplemented),
        (grpc.StatusCode.INTERNAL, InternalError),
        (grpc.StatusCode.FAILED_PRECONDITION, SpecdecError),
        (grpc.StatusCode.UNKNOWN, SpecdecError),
        (grpc.StatusCode.CANCELLED, SpecdecError),
    ],
)
def test_error_mapping(code, cls):
    err = from_rpc_error(_FakeRpcError(code, "why it failed"))
    assert type(err) is cls
    assert isinstance(err, SpecdecError)
    assert err.code is code
    assert err.details == "why it failed"
    assert code.name in str(err) and "why it failed" in str(err)


def test_error_without_status():
    err = from_rpc_error(grpc.RpcError("bare"))
    assert type(err) is SpecdecError
    assert err.code is grpc.StatusCode.UNKNOWN


def test_error_defaults_and_pickling():
    import pickle

    err = InvalidArgument("bad k")
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is InvalidArgument and again.details == "bad k" and again.code is err.code


# --------------------------------------------------------------------------- CLI parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_parser_accepts_documented_flags():
    args = _parser().parse_args(
        [
            "generate",
            "--gateway",
            "gw:1234",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "9",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--top-k",
            "50",
            "--seed",
            "3",
            "--stop",
            "\n",
            "--stop",
            "END",
            "--k",
            "4",
            "--no-ssd",
            "--session",
            "sess",
            "--reset-session",
            "--timeout",
            "12.5",
            "--json",
        ]
    )
    assert args.func is run_generate
    assert args.gateway == "gw:1234"
    assert args.prompt == "hi" and args.token_ids is None
    assert args.max_new_tokens == 9
    assert args.temperature == 0.7 and args.top_p == 0.9 and args.top_k == 50
    assert args.seed == 3
    assert args.stop == ["\n", "END"]
    assert args.k == 4
    assert args.ssd is False
    assert args.session == "sess" and args.reset_session is True
    assert args.timeout == 12.5
    assert args.json is True


def test_cli_parser_defaults_and_token_ids():
    args = _parser().parse_args(["generate", "--token-ids", "1, 2,3"])
    assert args.token_ids == [1, 2, 3] and args.prompt is None
    assert args.gateway is None  # resolved at run time: $SPECDEC_GATEWAY, then 127.0.0.1:50051
    assert args.ssd is None and args.k is None and args.seed is None
    assert args.stop == [] and args.session is None and not args.reset_session
    assert args.timeout is None and not args.json
    # Unset sampling: the model's generation_config at the gateway (as the SDK, gRPC, HTTP).
    assert args.max_new_tokens == 128 and args.temperature is None and args.top_p is None
    assert _parser().parse_args(["generate", "--prompt", "x", "--ssd"]).ssd is True


@pytest.mark.parametrize(
    "argv",
    [
        ["generate"],  # no input
        ["generate", "--prompt", "x", "--token-ids", "1"],  # both inputs
        ["generate", "--token-ids", "1,a"],
        ["generate", "--prompt", "x", "--timeout", "0"],
    ],
)
def test_cli_parser_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2


# --------------------------------------------------------------------------- import isolation


def test_sdk_import_is_torch_free():
    code = (
        "import sys, specdec.sdk, specdec.sdk.cli_generate\n"
        "heavy = ('torch', 'transformers', 'tokenizers', 'redis')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "", f"specdec.sdk imported: {out.stdout.strip()}"


# --------------------------------------------------------------------------- wire


class EchoGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """A fake gateway that echoes the request back: it tests the SDK's wire behaviour
    (serialisation, deadlines, streaming, status mapping), not the real gateway.

    Output text is the prompt (or the token ids joined by ","), tokens are the prompt ids
    (or the code points of the prompt). The request and ``context.time_remaining()`` of
    every call are recorded. Special prompts: "sleep" waits for the deadline, "abort-midway"
    streams one chunk then fails, "forever" streams until cancelled. ``max_new_tokens < 1``
    aborts with INVALID_ARGUMENT.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[gateway_pb2.GenerateRequest, float | None]] = []
        self.cancelled = threading.Event()

    def _check(self, request, context) -> None:
        self.calls.append((request, context.time_remaining()))
        if request.max_new_tokens < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be >= 1")
        if request.prompt == "sleep":
            end = time.monotonic() + 10
            while context.is_active() and time.monotonic() < end:
                time.sleep(0.01)

    @staticmethod
    def _echo(request) -> list[tuple[str, int]]:
        """(text, token id) per output token; the texts concatenate to the whole output."""
        if request.WhichOneof("input") == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            return [(("," if n else "") + str(i), i) for n, i in enumerate(ids)]
        return [(c, ord(c)) for c in request.prompt]

    @staticmethod
    def _final_fields(request, n_tokens: int) -> dict:
        spec = request.speculation
        return {
            "finish_reason": (
                gateway_pb2.FINISH_REASON_STOP if request.stop else gateway_pb2.FINISH_REASON_LENGTH
            ),
            "usage": gateway_pb2.Usage(prompt_tokens=n_tokens, completion_tokens=n_tokens),
            "timings": gateway_pb2.Timings(time_to_first_token_ms=1.5, total_ms=10.0),
            "stats": gateway_pb2.SpeculationStats(
                rounds=2,
                draft_tokens=8,
                accepted_tokens=6,
                acceptance_rate=0.75,
                num_draft_tokens=(
                    spec.num_draft_tokens if spec.HasField("num_draft_tokens") else 99
                ),
                ssd=spec.ssd,
            ),
            "session_id": request.session.id,
        }

    def Generate(self, request, context):
        self._check(request, context)
        pieces = self._echo(request)
        return gateway_pb2.GenerateResponse(
            text="".join(t for t, _ in pieces),
            token_ids=[i for _, i in pieces],
            **self._final_fields(request, len(pieces)),
        )

    def GenerateStream(self, request, context):
        self._check(request, context)
        if request.prompt == "forever":
            context.add_callback(self.cancelled.set)
            while context.is_active():
                yield gateway_pb2.GenerateStreamResponse(text="x", token_ids=[1])
                time.sleep(0.01)
            return
        pieces = self._echo(request)
        if request.prompt == "abort-midway":
            yield gateway_pb2.GenerateStreamResponse(text="a", token_ids=[1])
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of KV cache")
        for text, token in pieces[:-1]:
            yield gateway_pb2.GenerateStreamResponse(text=text, token_ids=[token])
        text, tokens = (pieces[-1][0], [pieces[-1][1]]) if pieces else ("", [])
        yield gateway_pb2.GenerateStreamResponse(  # the final message carries the last delta
            text=text, token_ids=tokens, **self._final_fields(request, len(pieces))
        )


@pytest.fixture(scope="module")
def echo_server():
    servicer = EchoGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _deadline_within(remaining: float | None, timeout: float) -> bool:
    """The servicer saw a deadline of about ``timeout`` (grpc-timeout rounds up a little)."""
    return remaining is not None and 0 < remaining <= timeout + 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_generate_roundtrip(echo_server):
    servicer, address = echo_server
    with Client(address, timeout=30) as client:
        gen = client.generate(
            "héllo", max_new_tokens=5, k=3, ssd=True, session_id="s1", stop=["\n"], seed=7
        )
    assert gen.text == "héllo"
    assert gen.tokens == tuple(ord(c) for c in "héllo")
    assert gen.finish_reason == "stop"
    assert gen.session_id == "s1"
    assert gen.stats.num_draft_tokens == 3 and gen.stats.ssd is True
    assert gen.stats.acceptance_rate == 0.75
    assert gen.timings.time_to_first_token_ms == 1.5
    request, remaining = servicer.calls[-1]
    assert request.sampling.seed == 7 and list(request.stop) == ["\n"]
    assert _deadline_within(remaining, 30)


def test_client_token_ids_and_server_defaults(echo_server):
    servicer, address = echo_server
    with Client(address) as client:
        gen = client.generate(token_ids=[3, 4, 5], timeout=5)
    assert gen.text == "3,4,5" and gen.tokens == (3, 4, 5)
    assert gen.finish_reason == "length"
    assert gen.stats.num_draft_tokens == 99  # k unset: the servicer saw no num_draft_tokens
    request, remaining = servicer.calls[-1]
    assert not request.HasField("speculation") and not request.sampling.HasField("seed")
    assert _deadline_within(remaining, 5)  # the per-call timeout wins


def test_client_stream_roundtrip(echo_server):
    servicer, address = echo_server
    with Client(address, timeout=30) as client:
        chunks = list(client.stream("abc", k=0))
    assert [c.text for c in chunks] == ["a", "b", "c"]
    assert [c.final is None for c in chunks] == [True, True, False]
    final = chunks[-1].final
    assert final.text == "abc" and final.tokens == (97, 98, 99)
    assert final.finish_reason == "length" and final.stats.num_draft_tokens == 0
    assert _deadline_within(servicer.calls[-1][1], 30)


def test_client_invalid_argument(echo_server):
    _, address = echo_server
    with Client(address, timeout=30) as client:
        with pytest.raises(InvalidArgument) as exc:
            client.generate("x", max_new_tokens=0)
        assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details == "max_new_tokens must be >= 1"
        assert exc.value.__cause__ is None and exc.value.__suppress_context__
        with pytest.raises(InvalidArgument, match="max_new_tokens"):
            list(client.stream("x", max_new_tokens=0))
        with pytest.raises(ResourceExhausted, match="out of KV cache"):
            list(client.stream("abort-midway"))
        with pytest.raises(ValueError):
            client.stream()  # raised eagerly, before iterating


def test_client_deadline_exceeded(echo_server):
    _, address = echo_server
    with Client(address, timeout=30) as client, pytest.raises(DeadlineExceeded):
        client.generate("sleep", timeout=0.2)


def test_client_unavailable():
    with Client(f"127.0.0.1:{_free_port()}", timeout=10) as client:
        with pytest.raises(Unavailable):
            client.generate("x")
        with pytest.raises(Unavailable):
            list(client.stream("x"))


def test_client_stream_break_cancels_call(echo_server):
    servicer, address = echo_server
    servicer.cancelled.clear()
    with Client(address, timeout=30) as client:
        stream = client.stream("forever")
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        assert servicer.cancelled.wait(5)


async def test_async_client_roundtrip(echo_server):
    servicer, address = echo_server
    async with AsyncClient(address, timeout=30) as client:
        gen = await client.generate("hey", session_id="s2", reset_session=True, ssd=False)
        assert gen.text == "hey" and gen.session_id == "s2" and gen.stats.ssd is False
        request, remaining = servicer.calls[-1]
        assert request.session.mode == gateway_pb2.SESSION_MODE_RESET
        assert _deadline_within(remaining, 30)

        chunks = [c async for c in client.stream(token_ids=[7, 8], timeout=5)]
        assert [c.tokens for c in chunks] == [(7,), (8,)]
        assert chunks[-1].final is not None and chunks[-1].final.tokens == (7, 8)
        assert chunks[-1].final.text == "7,8" == "".join(c.text for c in chunks)
        assert _deadline_within(servicer.calls[-1][1], 5)


async def test_async_client_errors(echo_server):
    _, address = echo_server
    async with AsyncClient(address, timeout=30) as client:
        with pytest.raises(InvalidArgument) as exc:
            await client.generate("x", max_new_tokens=0)
        assert exc.value.details == "max_new_tokens must be >= 1"
        with pytest.raises(InvalidArgument, match="max_new_tokens"):
            [c async for c in client.stream("x", max_new_tokens=0)]
        with pytest.raises(ResourceExhausted, match="out of KV cache"):
            [c async for c in client.stream("abort-midway")]
        with pytest.raises(DeadlineExceeded):
            await client.generate("sleep", timeout=0.2)
        with pytest.raises(ValueError):
            client.stream("x", token_ids=[1])


# --------------------------------------------------------------------------- CLI run


def test_cli_json(echo_server, capsys):
    servicer, address = echo_server
    args = _parser().parse_args(
        ["generate", "--gateway", address, "--prompt", "hi", "--k", "2", "--seed", "1", "--json"]
    )
    assert run_generate(args) == 0
    out = capsys.readouterr().out
    d = json.loads(out)
    assert d["text"] == "hi" and d["tokens"] == [104, 105] and d["finish_reason"] == "length"
    assert {"rounds", "draft_tokens", "accepted_tokens", "acceptance_rate"} <= set(d["stats"])
    assert d["stats"]["num_draft_tokens"] == 2
    assert {"usage", "timings", "session_id"} <= set(d)
    request, remaining = servicer.calls[-1]
    assert request.sampling.seed == 1 and remaining is not None


def test_cli_stream_and_env_gateway(echo_server, capsys, monkeypatch):
    _, address = echo_server
    monkeypatch.setenv("SPECDEC_GATEWAY", address)
    args = _parser().parse_args(["generate", "--prompt", "stream me", "--stop", "!"])
    assert run_generate(args) == 0
    captured = capsys.readouterr()
    assert captured.out == "stream me"
    assert "9 tokens" in captured.err and "finish=stop" in captured.err
    assert "acceptance=75.0%" in captured.err and "tok/s" in captured.err


def test_cli_errors(echo_server, capsys):
    _, address = echo_server
    args = _parser().parse_args(
        ["generate", "--gateway", address, "--prompt", "x", "--max-new-tokens", "0"]
    )
    assert run_generate(args) == 1
    assert capsys.readouterr().err.strip() == (
        "specdec: INVALID_ARGUMENT: max_new_tokens must be >= 1"
    )
    args = _parser().parse_args(
        ["generate", "--gateway", address, "--prompt", "x", "--json", "--max-new-tokens", "0"]
    )
    assert run_generate(args) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "INVALID_ARGUMENT" in captured.err
    args = _parser().parse_args(
        ["generate", "--gateway", f"127.0.0.1:{_free_port()}", "--prompt", "x", "--timeout", "10"]
    )
    assert run_generate(args) == 1
    # nothing listening: one line saying how to start a stack (tests/integration/test_one_line_errors.py)
    err = capsys.readouterr().err
    assert err.startswith("specdec: no gateway answers at ") and "specdec up" in err
    assert err.count("\n") == 1
    args = _parser().parse_args(["generate", "--prompt", "x", "--reset-session"])
    assert run_generate(args) == 2  # rejected before connecting


def test_method_prediction_and_their_statistics():
    req = build_generate_request("x", method="suffix", prediction="def f():")
    assert req.speculation.method == gateway_pb2.SPECULATION_METHOD_SUFFIX
    assert req.prediction.text == "def f():"
    req = build_generate_request(token_ids=[1], prediction=[4, 5])
    assert list(req.prediction.token_ids.ids) == [4, 5] and not req.HasField("speculation")
    with pytest.raises(ValueError, match="method must be one of model, ngram, suffix, hybrid"):
        build_generate_request("x", method="eagle")
    stats = _stats(
        method=gateway_pb2.SPECULATION_METHOD_HYBRID,
        by_source=[gateway_pb2.DraftSourceStats(source="suffix", drafts=2, draft_tokens=9)],
    )
    gen = generation_from_proto(
        gateway_pb2.GenerateResponse(
            usage=gateway_pb2.Usage(accepted_prediction_tokens=3, rejected_prediction_tokens=1),
            stats=stats,
        )
    )
    assert gen.stats.method == "hybrid" and gen.stats.by_source == {"suffix": (2, 9, 0)}
    assert gen.usage.accepted_prediction_tokens == 3
    assert gen.usage.rejected_prediction_tokens == 1
