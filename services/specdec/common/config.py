"""Typed service configuration, read once at start-up from flags and environment variables.

`ReplicaConfig` is what every model replica is configured with; the setting helpers
(flags with SPECDEC_* variables, ConfigError naming the setting) are in
specdec.common.settings and re-exported here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from specdec.common.settings import (
    ENV_PREFIX,
    ConfigError,
    add_setting,
    boolean,
    env_name,
    non_negative,
    one_of,
    parse_value,
    port_number,
    positive,
)
from specdec.common.tls import add_server_tls_arguments, server_tls_from_args

__all__ = [
    "DTYPES",
    "ENGINES",
    "ENV_PREFIX",
    "MAX_FAN_OUT",
    "MAX_TREE_WIDTH",
    "ConfigError",
    "ReplicaConfig",
    "add_setting",
    "boolean",
    "env_name",
    "non_negative",
    "one_of",
    "parse_value",
    "port_number",
    "positive",
]


# auto: as stored in the checkpoint; fastest: whichever of float32 and bfloat16 (float16 too
# on CUDA) runs this model fastest here, measured at start-up and cached
# (specdec.replica.calibrate).
DTYPES = ("auto", "float32", "bfloat16", "float16", "fastest")
# Linear layers in oneDNN's blocked layout on a CPU (specdec.replica.packing): auto: when
# --dtype fastest measures it faster; true: always; false: never.
PACK_WEIGHTS = ("auto", "true", "false")
ENGINES = ("dense", "paged")  # the sessions' KV: specdec.replica.paged
MAX_FAN_OUT = 64  # SSD branches per round (drafter and gateway settings, Speculate requests)
# Children of a token tree's node (SpeculationParams.tree_width, DraftRequest.tree_width).
MAX_TREE_WIDTH = 8


@dataclass(frozen=True)
class ReplicaConfig:
    """What every model replica (drafter or verifier) is configured with.

    The drafter and the verifier each subclass it (specdec.drafter.config,
    specdec.verifier.config) with their role and any settings of their own.
    """

    role: str  # "drafter" | "verifier"
    model: str
    gguf_file: str | None = None
    # Run the model's own code from its directory (config.json auto_map), as transformers'
    # trust_remote_code: only for model directories you trust.
    trust_remote_code: bool = False
    dtype: str = "float32"
    pack_weights: str = "auto"
    device: str = "cpu"
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    max_cached_tokens: int = 65536
    max_draft_tokens: int = 16
    max_context: int = 0  # 0: the model's own max_position_embeddings
    threads: int = 0  # 0: the CPUs this process may use (affinity mask, cgroup quota)
    max_queue: int = 64  # model requests that may wait behind the running one
    replica_id: str = ""  # empty: hostname:port, known once the port is bound
    grace_seconds: float = 10.0
    prefill_chunk: int = 512  # tokens per forward when feeding a long input; 0: one forward
    # Batching across sessions (specdec.replica.batching): sessions per forward (1: none) and
    # padded tokens per forward (rows x longest input).
    max_batch_size: int = 16
    max_batch_tokens: int = 2048
    # How long a forward may wait for the sessions of the previous one to come back
    # (specdec.replica.batching.Scheduler._gathering); never more than a quarter of a forward.
    max_batch_wait_ms: float = 1.0
    # The sessions' KV (specdec.replica.paged): "dense", a DynamicCache per session and a
    # padded copy per batched forward, or "paged", blocks of a per-layer pool read in place.
    engine: str = "dense"
    kv_block_size: int = 16  # tokens per block of the paged engine
    # Ranks one verifier replica runs as (specdec.replica.tp): 1, or N sharding the model
    # with transformers' tp_plan under torch.distributed; rank 0 serves.
    tensor_parallel: int = 1
    # Compile the decoder for the short forwards that repeat (specdec.replica.compiled).
    compile: bool = False
    tls: Any = None  # specdec.common.tls.ServerTls, or None: plaintext
    # The data plane's port (specdec.common.dataplane): 0 any free port, -1 none.
    data_port: int = 0
    # Time forwards of 1 to 16 tokens once loaded, the first points of the forward cost
    # curve (specdec.common.cost) the replica reports.
    cost_probe: bool = True

    ROLE: ClassVar[str] = ""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, default_port: int) -> None:
        add_setting(parser, "--model", "model directory or hub id (or the dir holding --gguf-file)")
        add_setting(parser, "--gguf-file", "GGUF file name inside --model, or a GGUF path")
        add_setting(
            parser,
            "--trust-remote-code",
            "run modeling code shipped in the model directory (config.json auto_map); only "
            "for models you trust",
            False,
        )
        add_setting(
            parser,
            "--dtype",
            f"weights dtype, one of {', '.join(DTYPES)} (auto: as stored in the checkpoint; "
            "fastest: load in float32, time a few forwards in float32 and in bfloat16 (float16 "
            "too on CUDA) and keep the fastest; cached per machine in "
            "$SPECDEC_CACHE_DIR/calibration.json)",
            "float32",
        )
        add_setting(
            parser,
            "--pack-weights",
            "CPU only: hold the linear layers' weights in oneDNN's blocked layout, so a "
            "forward of several tokens (a verify, a batch) reads each weight once; one of "
            f"{', '.join(PACK_WEIGHTS)} (auto: when --dtype fastest measures it faster)",
            "auto",
        )
        add_setting(parser, "--device", "torch device: cpu, cuda or cuda:N", "cpu")
        add_setting(parser, "--host", "address to listen on", "0.0.0.0")
        add_setting(parser, "--port", "gRPC port (0: any free port)", default_port)
        add_setting(parser, "--metrics-port", "Prometheus /metrics port (0: off)", 0)
        add_setting(
            parser,
            "--data-port",
            "data plane port: the round's calls from gateways over one TCP connection each, "
            "answered on the model thread (0: any free port, -1: off)",
            0,
        )
        add_setting(parser, "--max-cached-tokens", "KV cache bound over all sessions", 65536)
        add_setting(parser, "--max-draft-tokens", "largest draft length k accepted", 16)
        add_setting(parser, "--max-context", "context limit (0: the model's own)", 0)
        add_setting(
            parser,
            "--threads",
            "torch CPU threads (0: the CPUs this process may use: affinity mask, cgroup quota)",
            0,
        )
        add_setting(
            parser,
            "--max-queue",
            "model requests that may wait behind the running one; more are refused with "
            "RESOURCE_EXHAUSTED (replica busy) so the gateway tries another replica",
            64,
        )
        add_setting(
            parser, "--replica-id", "name reported in Info and logs (default host:port)", ""
        )
        add_setting(parser, "--grace-seconds", "graceful shutdown window on SIGTERM", 10.0)
        add_setting(
            parser, "--prefill-chunk", "tokens per forward of a long input (0: all at once)", 512
        )
        add_setting(
            parser,
            "--max-batch-size",
            "sessions whose forwards run as one batched forward (1: one session at a time)",
            16,
        )
        add_setting(
            parser,
            "--max-batch-tokens",
            "bound on one batched forward: rows x the longest row's new tokens",
            2048,
        )
        add_setting(
            parser,
            "--max-batch-wait-ms",
            "how long a forward may wait for the sessions of the previous forward to send "
            "their next request, so they stay in one batch (at most a quarter of a forward; "
            "0: never wait)",
            1.0,
        )
        add_setting(
            parser,
            "--engine",
            "the sessions' KV: dense (a transformers DynamicCache per session, a padded copy "
            "of the batch's KV per batched forward) or paged (blocks of one pool per layer, "
            "read in place; forks share blocks copy-on-write)",
            "dense",
        )
        add_setting(parser, "--kv-block-size", "tokens per KV block of the paged engine", 16)
        add_setting(
            parser,
            "--tensor-parallel",
            "verifier only: run the replica as N ranks on this machine, the model's layers "
            "sharded across them (transformers' tp_plan; gloo on cpu, NCCL on cuda, one GPU a "
            "rank); rank 0 serves",
            1,
        )
        add_setting(
            parser,
            "--compile",
            "compile the model's forwards of up to --max-draft-tokens + 1 tokens a row (decode, "
            "verify, SSD branch steps) with torch.compile, token counts padded to buckets (CUDA: "
            "graph capture); dense engine only; compile time is logged at start-up",
            False,
        )
        add_setting(
            parser,
            "--cost-probe",
            "once loaded, time a few forwards of 1 to 16 tokens: the first points of the "
            "forward cost curve reported to gateways (whose adaptive policy prices drafts "
            "with it) before any request has run",
            True,
        )
        add_server_tls_arguments(parser)
        cls.add_role_arguments(parser)

    @classmethod
    def add_role_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Settings only this role has (none here)."""

    @classmethod
    def role_settings(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Values of the settings add_role_arguments added, by field name."""
        return {}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplicaConfig:
        model = parse_value(args, "--model", str, lambda v: None if v else "must not be empty")
        gguf = args.gguf_file or None
        if gguf and os.sep in gguf and not os.path.isfile(gguf):  # a path must exist
            raise ConfigError(f"--gguf-file / {env_name('--gguf-file')}: no such file {gguf!r}")
        dtype = parse_value(args, "--dtype", str, one_of(DTYPES))
        device = parse_value(args, "--device", str, _check_device)
        pack = parse_value(
            args,
            "--pack-weights",
            str,
            one_of(PACK_WEIGHTS),
        )
        if pack == "true" and device != "cpu":
            raise ConfigError(
                f"--pack-weights / {env_name('--pack-weights')}: packed weights are for "
                f"--device cpu (got --device {device})"
            )
        port = parse_value(args, "--port", int, port_number)
        engine = parse_value(args, "--engine", str, one_of(ENGINES))
        tensor_parallel = parse_value(args, "--tensor-parallel", int, positive)
        compile_ = parse_value(args, "--compile", boolean)
        if tensor_parallel > 1:
            check_tensor_parallel(cls.ROLE, tensor_parallel, dtype, pack, engine, device, compile_)
        return cls(
            role=cls.ROLE,
            model=model,
            gguf_file=gguf,
            trust_remote_code=parse_value(args, "--trust-remote-code", boolean),
            dtype=dtype,
            pack_weights=pack,
            device=device,
            host=parse_value(args, "--host", str),
            port=port,
            metrics_port=parse_value(args, "--metrics-port", int, port_number),
            max_cached_tokens=parse_value(args, "--max-cached-tokens", int, positive),
            max_draft_tokens=parse_value(args, "--max-draft-tokens", int, positive),
            max_context=parse_value(args, "--max-context", int, non_negative),
            threads=parse_value(args, "--threads", int, non_negative),
            max_queue=parse_value(args, "--max-queue", int, non_negative),
            replica_id=args.replica_id or "",
            grace_seconds=parse_value(
                args, "--grace-seconds", float, lambda v: None if v >= 0 else "must be >= 0"
            ),
            prefill_chunk=parse_value(args, "--prefill-chunk", int, non_negative),
            max_batch_size=parse_value(args, "--max-batch-size", int, positive),
            max_batch_tokens=parse_value(args, "--max-batch-tokens", int, positive),
            max_batch_wait_ms=parse_value(
                args, "--max-batch-wait-ms", float, lambda v: None if v >= 0 else "must be >= 0"
            ),
            engine=engine,
            tensor_parallel=tensor_parallel,
            kv_block_size=parse_value(args, "--kv-block-size", int, positive),
            compile=compile_,
            tls=server_tls_from_args(args),
            data_port=parse_value(args, "--data-port", int, _data_port),
            cost_probe=parse_value(args, "--cost-probe", boolean),
            **cls.role_settings(args),
        )


def check_tensor_parallel(
    role: str,
    ranks: int,
    dtype: str,
    pack: str,
    engine: str,
    device: str,
    compile_: bool = False,
) -> None:
    """ConfigError for the combinations --tensor-parallel N > 1 does not run (yet)."""
    where = f"--tensor-parallel / {env_name('--tensor-parallel')}"
    refusals = [
        (
            role != "verifier",
            f"only the verifier runs tensor-parallel; the {role} runs on one device (set it to 1)",
        ),
        (
            engine != "dense",
            "the paged engine's pool is not sharded across ranks; run --engine dense",
        ),
        (pack == "true", "packed weights (--pack-weights true) are not sharded across ranks"),
        (
            dtype == "fastest",
            "--dtype fastest times forwards on each rank and the ranks could "
            "choose differently; name the dtype (float32, bfloat16, ...)",
        ),
        (device.startswith("cuda:"), f"rank r runs on cuda:r; give --device cuda (got {device})"),
        (compile_, "compiled forwards (--compile) are not built for sharded models; leave it off"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{where} {ranks}: {why}")


def _data_port(value: int) -> str | None:
    return None if -1 <= value <= 65535 else "must be a port number, 0 (any free) or -1 (off)"


def _check_device(value: str) -> str | None:
    """The device's spelling; whether this machine has it is the replica's check
    (specdec.replica.replica.check_device), so that this module stays torch-free."""
    if value in ("cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return None
    return "must be cpu, cuda or cuda:N"
