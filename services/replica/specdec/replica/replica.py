"""What the drafter and the verifier share: Info, Release, start-up and the serve loop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc

from specdec.common import cost
from specdec.common.errors import InvalidRequest, NotReady
from specdec.common.logs import setup_logging
from specdec.common.serving import rpc_errors, serve
from specdec.common.settings import ConfigError, env_name
from specdec.common.telemetry import setup_tracing
from specdec.common.version import note_model_version, read_model_version
from specdec.replica.config import LLAMA_CPP, ReplicaConfig
from specdec.replica.dataplane import DataPlaneServer
from specdec.replica.engine import Engine, Prefix
from specdec.replica.loading import log_libraries_as_json
from specdec.replica.metrics import start_metrics_server
from specdec.replica.runtime import ModelRuntime
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

MAX_SESSION_ID_LEN = 256
C = TypeVar("C", bound=ReplicaConfig)  # a replica's config: ReplicaConfig or a subclass
ResponseT = TypeVar("ResponseT")  # a model call's response message
_ROLES = {"drafter": common_pb2.ROLE_DRAFTER, "verifier": common_pb2.ROLE_VERIFIER}


def check_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidRequest("session_id is empty")
    if len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidRequest(f"session_id is longer than {MAX_SESSION_ID_LEN} characters")


def check_fork(fork_from: str) -> None:
    """A Draft's or Verify's fork_from: empty, or a session id."""
    if len(fork_from) > MAX_SESSION_ID_LEN:
        raise InvalidRequest(f"fork_from is longer than {MAX_SESSION_ID_LEN} characters")


class JobCall(Protocol):
    """A request's validated arguments for the model (DraftCall, SpeculateCall, VerifyCall):
    a frozen dataclass with named fields, the session its job works on, and the job."""

    @property
    def session_id(self) -> str: ...

    def job(self) -> Any:
        """The job for the model thread over these arguments (a generator of forwards)."""
        ...


@dataclass(frozen=True)
class ModelCall(Generic[ResponseT]):
    """A request validated for the model: its arguments (`call`, whose job runs on the
    model thread; the jobs of its session run one at a time, in order) and how the job's
    result becomes the response message. The gRPC methods and the data plane
    (specdec.replica.dataplane) both build and answer their calls through these."""

    call: JobCall
    respond: Callable[[Any], ResponseT]  # the job's result -> the response message

    @property
    def job(self) -> Callable[[], Any]:
        return self.call.job

    @property
    def session(self) -> str:
        return self.call.session_id


class ReplicaServicer:
    """Info and Release, shared by DrafterService and VerifierService, and the model calls
    of the role (`model_calls`), over the replica's engine (specdec.replica.engine)."""

    def __init__(self, runtime: Engine[Any]):
        self.runtime = runtime
        self.replica_id = runtime.config.replica_id
        self.data_port = 0  # the data plane's port (specdec.replica.dataplane); 0: none
        # specdec_version.json of the model directory (specdec.common.version; a head
        # drafter's: its head folder's, `versioned`); "": none.
        self.model_version = read_model_version(*self.versioned())
        note_model_version(runtime.config.role, self.model_version)

    def versioned(self) -> tuple[str, str]:
        """The folder whose version the replica reports, and the flag that names it."""
        return self.runtime.config.model, "--model"

    def model_calls(self) -> dict[str, Callable[[Any], ModelCall[Any]]]:
        """RPC name -> its request -> the validated ModelCall (raises SpecdecError)."""
        return {}

    async def answer(self, call: ModelCall[ResponseT]) -> ResponseT:
        """Run a model call on the model thread (bounded by --max-queue) and respond."""
        rt = self.runtime
        return call.respond(await rt.run(call.job, session=call.session))

    def on_port(self, port: int) -> None:
        if not self.replica_id:
            self.replica_id = f"{socket.gethostname()}:{port}"

    def ready_runtime(self) -> Engine[Any]:
        if self.runtime.store is None:
            raise NotReady("model is still loading")
        return self.runtime

    def check_extent(
        self, session_id: str, prefix: Prefix, new_tokens: Sequence[int], extra: int
    ) -> None:
        check_session_id(session_id)
        self.ready_runtime().validate_extent(prefix, new_tokens, extra)

    @rpc_errors
    async def Info(
        self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ModelInfo:
        rt = self.ready_runtime()
        cfg = rt.config
        cached_tokens, cached_sessions = await rt.run(
            lambda: (rt.ready_store.cached_tokens, len(rt.ready_store)), bounded=False
        )
        info = common_pb2.ModelInfo(
            role=_ROLES[cfg.role],
            model_id=cfg.model + (f"#{cfg.gguf_file}" if cfg.gguf_file else ""),
            vocab_size=rt.vocab_size,
            tokenizer_fingerprint=rt.tokenizer_fingerprint,
            max_context=rt.max_context,
            max_draft_tokens=cfg.max_draft_tokens,
            eos_token_ids=rt.eos_token_ids,
            dtype=rt.dtype_name,
            dtype_reason="; ".join(r for r in (rt.engine_reason, rt.dtype_reason) if r),
            device=str(rt.device),
            max_cached_tokens=cfg.max_cached_tokens,
            cached_tokens=cached_tokens,
            cached_sessions=cached_sessions,
            replica_id=self.replica_id,
            chat_template=rt.chat_template,
            bos_token_id=rt.bos_token_id,
            special_tokens=rt.special_tokens,
            data_port=self.data_port,
            model_version=self.model_version,
            engine=cfg.kv_engine,
            tensor_parallel=cfg.tensor_parallel,
            sampling_defaults=rt.sampling_defaults.to_proto(),
            compiled=rt.compiled is not None,
            compile_seconds=rt.compiled.seconds if rt.compiled is not None else 0.0,
            forward_cost=self.forward_cost(),
        )
        if rt.head_features is not None:
            info.features.CopyFrom(rt.head_features.to_proto())
        if request.include_tokenizer:
            info.tokenizer_json_zlib = rt.tokenizer_json
        return info

    def forward_cost(self) -> common_pb2.ForwardCost:
        """The replica's forward cost curve as fitted now and its load (specdec.common.cost)."""
        rt = self.runtime
        load = rt.load_window.load(time.perf_counter(), rt.pending)
        return cost.to_proto(rt.cost_lines, load, rt.RAGGED, rt.cost_points)

    def release(self, session_id: str) -> bool:
        """Drop everything this replica keeps for the session (model thread)."""
        return self.runtime.release(session_id)

    @rpc_errors
    async def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        check_session_id(request.session_id)
        rt = self.ready_runtime()
        released = await rt.run(
            self.release, request.session_id, bounded=False, session=request.session_id
        )
        return common_pb2.ReleaseResponse(released=released)


def check_device(device: str, ranks: int = 1) -> None:
    """ConfigError unless this machine has the --device the replica was given (its
    spelling was checked with the rest of the config), and, for --tensor-parallel ranks > 1
    on cuda, a GPU for each rank."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        where = f"--device / {env_name('--device')}"
        raise ConfigError(f"{where}: CUDA is not available on this machine (got {device!r})")
    if ranks == 1:
        return
    where = f"--tensor-parallel / {env_name('--tensor-parallel')} {ranks}"
    if device == "cpu" and torch.cuda.is_available():  # transformers shards onto the GPUs
        raise ConfigError(f"{where}: with --device cpu on a machine with CUDA; give --device cuda")
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ConfigError(
            f"{where}: one GPU a rank, and this machine has {torch.cuda.device_count()}"
        )


def run_replica(
    config_type: type[C],
    args: argparse.Namespace,
    service_name: str,
    make_servicer: Callable[[Engine[Any]], ReplicaServicer],
    add_to_server: Callable[[ReplicaServicer, grpc.aio.Server], None],
    runtime_type: Callable[[C], Engine[Any]] = ModelRuntime,
) -> None:
    """`specdec serve drafter|verifier`: config, logging, serve until SIGTERM. runtime_type
    makes the engine (the transformers ModelRuntime, or the drafter's DrafterRuntime); with
    --tensor-parallel N > 1 the verifier's is rank 0 of N (specdec.replica.tp), with
    --engine llama.cpp either role's is a LlamaCppRuntime (specdec.replica.llamacpp)."""
    config = config_type.from_args(args)
    assert isinstance(config, config_type)  # from_args is typed as ReplicaConfig's
    check_device(config.device, config.tensor_parallel)
    setup_logging(config.role)
    log_libraries_as_json()
    tracing = setup_tracing(config.role)
    if config.metrics_port:
        start_metrics_server(config.metrics_port, config.host)
    if config.tensor_parallel > 1:  # rank 0 of several (checked: the verifier, dense)
        from specdec.replica.tp import TensorParallelRuntime

        runtime_type = TensorParallelRuntime
    engine_reason = ""
    if config.engine == "auto" and config.tensor_parallel == 1:
        from specdec.replica.llamacpp import choose_engine

        choice = choose_engine(config)
        engine_reason = choice.reason
        log.info(
            "engine chosen",
            extra={
                "engine": choice.engine,
                "reason": choice.reason,
                "timings_ms": choice.timings_ms,
            },
        )
        if choice.engine == LLAMA_CPP:
            config = dataclasses.replace(config, engine=LLAMA_CPP)
    if config.kv_engine == LLAMA_CPP:  # the drafter's too: it refuses its torch options
        from specdec.replica.llamacpp import LlamaCppRuntime, available

        missing = available()
        if missing:
            raise ConfigError(f"--engine {LLAMA_CPP}: {missing}")
        runtime_type = LlamaCppRuntime
    runtime = runtime_type(config)
    runtime.engine_reason = engine_reason
    servicer = make_servicer(runtime)
    data_plane = None
    if config.data_port >= 0:
        data_plane = DataPlaneServer(
            servicer, service_name, config.host, config.data_port, config.tls
        )
        servicer.data_port = data_plane.port

    async def ready() -> None:
        load = runtime.load
        if data_plane is not None:  # answers "model is still loading" meanwhile
            load = functools.partial(data_plane.while_loading, runtime.load)
        await runtime.run(load, bounded=False)

    try:
        asyncio.run(
            serve(
                service_name=service_name,
                add_servicers=lambda server: add_to_server(servicer, server),
                reflect=[service_name],
                host=config.host,
                port=config.port,
                ready=ready,
                grace_seconds=config.grace_seconds,
                on_stop=runtime.shutdown,
                on_port=servicer.on_port,
                credentials=config.tls.credentials() if config.tls else None,
                health_port=config.tls.health_port if config.tls else 0,
                data_plane=data_plane,
            )
        )
    finally:
        if tracing:
            tracing.shutdown()  # flush the spans of the graceful stop
