"""A newcomer's first mistakes each get one line that names what is wrong and what was
expected, from the real processes: a missing or malformed model (was a 46-74 line
traceback ending in "Repo id must use alphanumeric chars"), a gateway whose replicas do not
serve (was silent for up to 900 s), `specdec generate` where nothing listens (was raw gRPC
text)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.conftest import start_up_error
from tests.integration.test_gateway import _free_port

pytestmark = pytest.mark.integration

EXPECTED = (
    "expected a model directory (config.json, weights, tokenizer), the directory of "
    "--gguf-file, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
)


def malformed(tmp_path, kind: str) -> str:
    if kind == "missing":
        return "/nonexistent/model"
    model = tmp_path / kind
    model.mkdir()
    if kind == "bad-json":
        (model / "config.json").write_text("{not json")
    if kind == "no-weights":
        (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(model)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("missing", "no such directory '/nonexistent/model'"),
        ("empty", "no config.json in '{path}'"),
        ("bad-json", "cannot load '{path}': It looks like the config file at "),
        ("no-weights", "cannot load '{path}': "),
    ],
)
def test_a_missing_or_malformed_model_is_one_line(tmp_path, kind, why):
    path = malformed(tmp_path, kind)
    lines = start_up_error("drafter", path).strip().splitlines()
    assert len(lines) == 1, lines
    prefix = "specdec: configuration error: --model / SPECDEC_MODEL: " + why.format(path=path)
    assert lines[0].startswith(prefix), lines[0]
    assert lines[0].endswith(EXPECTED), lines[0]


def test_up_with_a_missing_model_says_so_in_one_line(test_models):
    """`specdec up` reports the replica's own line, not the end of its log."""
    argv = ["up", "--draft-model", "/nonexistent/model", "--target-model"]
    argv += [str(test_models.target), "--port", "0", "--dtype", "float32"]
    argv += ["--draft-threads", "1", "--target-threads", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "specdec", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "REDIS_URL"},
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "specdec up: drafter exited with code 2: specdec: configuration error: --model / "
        f"SPECDEC_MODEL: no such directory '/nonexistent/model'; {EXPECTED}"
    ]


@pytest.fixture
def loading_replica():
    """A gRPC server whose health check answers NOT_SERVING, as a replica that is still
    loading its model does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_the_gateway_says_which_replica_it_waits_for_and_why(loading_replica):
    """Every few seconds one log line names each replica start-up waits for and why (one
    unreachable, one still loading); when --startup-timeout runs out, one line on stderr."""
    closed = f"127.0.0.1:{_free_port()}"
    argv = ["serve", "gateway", "--port", "0", "--host", "127.0.0.1", "--drafter", closed]
    argv += ["--verifier", loading_replica, "--startup-timeout", "7"]
    done = subprocess.run(
        [sys.executable, "-m", "specdec", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    logs = [json.loads(line) for line in done.stdout.splitlines()]
    waits = [r for r in logs if r["message"].startswith("waiting for replicas: ")]
    assert waits and all(r["severity"] == "WARNING" for r in waits), logs
    unreachable = f"drafter@{closed} (unreachable: UNAVAILABLE: failed to connect"
    loading = f"verifier@{loading_replica} (health NOT_SERVING (loading its model"
    for r in waits:
        assert unreachable in r["message"] and loading in r["message"], r["message"]
        assert "Connection refused" in r["message"]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "specdec: the gateway did not start: replicas not serving after 7s: "
    )
    assert unreachable in lines[0] and loading in lines[0]


def test_generate_with_nothing_listening_says_how_to_start_a_stack():
    """One line, with gRPC's own INFO lines kept off stderr: here its `api` trace, which
    writes dozens at INFO (a replica's GOAWAY at shutdown once put one before `specdec
    up`'s line), unless GRPC_VERBOSITY says otherwise."""
    address = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    done = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "--gateway", address, "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "GRPC_TRACE": "api"},
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"specdec: no gateway answers at {address} (Connection refused); start a stack with "
        "`specdec up --draft-model DIR --target-model DIR` (or `specdec demo`), or point "
        "--gateway / SPECDEC_GATEWAY at a running one"
    ]
