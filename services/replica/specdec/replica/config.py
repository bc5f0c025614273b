"""A model replica's configuration, read once at start-up from flags and environment
variables.

`ReplicaConfig` is what every model replica (drafter, verifier) is configured with, each
setting declared once as a field; the setting helpers (fields that are flags with SPECDEC_*
variables, ConfigError naming the setting) are specdec.common.settings. Torch-free: `specdec
serve` builds every service's flags from it in any process.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from specdec.common.settings import (
    ConfigError,
    add_settings,
    env_name,
    non_negative,
    one_of,
    port_number,
    positive,
    read_settings,
    setting,
    settings_group,
)
from specdec.common.tls import ServerTls, ServerTlsSettings

# auto: as stored in the checkpoint; fastest: whichever of float32 and bfloat16 (float16 too
# on CUDA) runs this model fastest here, measured at start-up and cached
# (specdec.replica.calibrate).
DTYPES = ("auto", "float32", "bfloat16", "float16", "fastest")
# Linear layers in oneDNN's blocked layout on a CPU (specdec.replica.packing): auto: when
# --dtype fastest measures it faster; true: always; false: never.
PACK_WEIGHTS = ("auto", "true", "false")
# The replica's engine: the sessions' KV of the transformers engine (dense, paged:
# specdec.replica.paged) or llama.cpp (specdec.replica.llamacpp); auto: ReplicaConfig.kv_engine.
LLAMA_CPP = "llama.cpp"
ENGINES = ("auto", "dense", "paged", LLAMA_CPP)


def _data_port(value: int) -> str | None:
    return None if -1 <= value <= 65535 else "must be a port number, 0 (any free) or -1 (off)"


def _check_device(value: str) -> str | None:
    """The device's spelling; whether this machine has it is the replica's check
    (specdec.replica.replica.check_device), so that this module stays torch-free."""
    if value in ("cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return None
    return "must be cpu, cuda or cuda:N"


@dataclass(frozen=True)
class ReplicaConfig:
    """What every model replica (drafter or verifier) is configured with.

    Each field declared with `setting` is a flag of `specdec serve drafter|verifier` and a
    SPECDEC_* variable (specdec.common.settings). The drafter and the verifier each subclass
    it (specdec.drafter.config, specdec.verifier.config) with their role and any settings of
    their own, which follow these flags.
    """

    role: str  # "drafter" | "verifier"
    model: str = setting(
        help="model directory or hub id (or the dir holding --gguf-file)",
        check=lambda v: None if v else "must not be empty",
    )
    gguf_file: str | None = setting(
        None, "GGUF file name inside --model, or a GGUF path", blank=True
    )
    # Run the model's own code from its directory (config.json auto_map), as transformers'
    # trust_remote_code: only for model directories you trust.
    trust_remote_code: bool = setting(
        False,
        "run modeling code shipped in the model directory (config.json auto_map); only "
        "for models you trust",
    )
    dtype: str = setting(
        "float32",
        f"weights dtype, one of {', '.join(DTYPES)} (auto: as stored in the checkpoint; "
        "fastest: load in float32, time a few forwards in float32 and in bfloat16 (float16 "
        "too on CUDA) and keep the fastest; cached per machine in "
        "$SPECDEC_CACHE_DIR/calibration.json)",
        check=one_of(DTYPES),
    )
    pack_weights: str = setting(
        "auto",
        "CPU only: hold the linear layers' weights in oneDNN's blocked layout, so a "
        "forward of several tokens (a verify, a batch) reads each weight once; one of "
        f"{', '.join(PACK_WEIGHTS)} (auto: when --dtype fastest measures it faster)",
        check=one_of(PACK_WEIGHTS),
    )
    device: str = setting("cpu", "torch device: cpu, cuda or cuda:N", check=_check_device)
    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(50051, "gRPC port (0: any free port)", check=port_number)
    metrics_port: int = setting(0, "Prometheus /metrics port (0: off)", check=port_number)
    # The data plane's port (specdec.replica.dataplane): 0 any free port, -1 none.
    data_port: int = setting(
        0,
        "data plane port: the round's calls from gateways over one TCP connection each, "
        "answered on the model thread (0: any free port, -1: off)",
        check=_data_port,
    )
    max_cached_tokens: int = setting(65536, "KV cache bound over all sessions", check=positive)
    max_draft_tokens: int = setting(16, "largest draft length k accepted", check=positive)
    max_context: int = setting(0, "context limit (0: the model's own)", check=non_negative)
    threads: int = setting(
        0,
        "torch CPU threads (0: the CPUs this process may use: affinity mask, cgroup quota)",
        check=non_negative,
    )
    max_queue: int = setting(
        64,
        "model requests that may wait behind the running one; more are refused with "
        "RESOURCE_EXHAUSTED (replica busy) so the gateway tries another replica",
        check=non_negative,
    )
    replica_id: str = setting("", "name reported in Info and logs (default host:port)")
    grace_seconds: float = setting(10.0, "graceful shutdown window on SIGTERM", check=non_negative)
    prefill_chunk: int = setting(
        512, "tokens per forward of a long input (0: all at once)", check=non_negative
    )
    # Batching across sessions (specdec.replica.batching).
    max_batch_size: int = setting(
        16,
        "sessions whose forwards run as one batched forward (1: one session at a time)",
        check=positive,
    )
    max_batch_tokens: int = setting(
        2048, "bound on one batched forward: rows x the longest row's new tokens", check=positive
    )
    # specdec.replica.batching.Scheduler._gathering
    max_batch_wait_ms: float = setting(
        20.0,
        "how long a forward may wait for the sessions of the previous forward to send "
        "their next request, so they stay in one batch (at most a quarter of a forward, "
        "and not for a session whose last return took longer; 0: never wait)",
        check=non_negative,
    )
    # The sessions' KV (specdec.replica.paged).
    engine: str = setting(
        "auto",
        "the engine: transformers with the sessions' KV dense (a DynamicCache per "
        "session, a padded copy of the batch's KV per batched forward) or paged (blocks of "
        "one pool per layer, read in place; forks share blocks copy-on-write); llama.cpp "
        "(the model's GGUF as shipped, on llama.cpp's CPU kernels; needs llama-cpp-python); "
        "or auto (paged on a CPU; dense on CUDA, with --compile or with --tensor-parallel > 1)",
        check=one_of(ENGINES),
    )
    kv_block_size: int = setting(16, "tokens per KV block of the paged engine", check=positive)
    # specdec.replica.llamacpp
    llama_kv_dtype: str = setting(
        "f16",
        "llama.cpp engine: the KV cells' type, f16 (as llama.cpp's default) or f32 (twice "
        "the memory; a token's logits within 1e-5 of a one-sequence run of the same GGUF)",
        check=one_of(("f16", "f32")),
    )
    # specdec.replica.tp: a flag of the verifier only (VerifierConfig), 1 for the drafter
    tensor_parallel: int = 1
    # specdec.replica.compiled
    compile: bool = setting(
        False,
        "compile the model's forwards of up to --max-draft-tokens + 1 tokens a row (decode, "
        "verify, SSD branch steps) with torch.compile, token counts padded to buckets (CUDA: "
        "graph capture); dense engine only; compile time is logged at start-up",
    )
    # The first points of the forward cost curve (specdec.common.cost).
    cost_probe: bool = setting(
        True,
        "once loaded, time a few forwards of 1 to 16 tokens, and with --max-batch-size "
        "above 1 batched forwards of 2 to 16 rows: the first points of the forward cost "
        "curve reported to gateways (whose adaptive policy prices drafts with it) before "
        "any request has run",
    )
    tls: ServerTls | None = settings_group(ServerTlsSettings)

    ROLE: ClassVar[str] = ""

    @property
    def kv_engine(self) -> str:
        """The engine the replica runs: --engine, or for auto the paged engine on a CPU
        (it was at least as fast as the dense one there, through the stack, and a batched
        forward copies no KV) and the dense one on CUDA (where the paged engine has not
        run yet), with --compile (compiled forwards are dense) or with --tensor-parallel
        > 1 (the pool is not sharded)."""
        if self.engine != "auto":
            return self.engine
        dense = self.device != "cpu" or self.compile or self.tensor_parallel > 1
        return "dense" if dense else "paged"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, default_port: int) -> None:
        add_settings(parser, cls, port=default_port)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplicaConfig:
        values = read_settings(cls, args)
        gguf, device = values["gguf_file"], values["device"]
        if gguf and os.sep in gguf and not os.path.isfile(gguf):  # a path must exist
            raise ConfigError(f"--gguf-file / {env_name('--gguf-file')}: no such file {gguf!r}")
        if values["pack_weights"] == "true" and device != "cpu":
            raise ConfigError(
                f"--pack-weights / {env_name('--pack-weights')}: packed weights are for "
                f"--device cpu (got --device {device})"
            )
        if values["engine"] == LLAMA_CPP:
            check_llama_cpp(values)
        if values.get("tensor_parallel", 1) > 1:
            check_tensor_parallel(
                cls.ROLE,
                values["tensor_parallel"],
                values["dtype"],
                values["pack_weights"],
                values["engine"],
                device,
                values["compile"],
            )
        cls.check_role_settings(values)
        return cls(role=cls.ROLE, **values)

    @classmethod
    def check_role_settings(cls, values: dict[str, Any]) -> None:
        """ConfigError for combinations of this role's settings it refuses (none here)."""


def check_llama_cpp(values: dict[str, Any]) -> None:
    """ConfigError for the settings the llama.cpp engine does not run with."""
    where = f"--engine {LLAMA_CPP}"
    refusals = [
        (values["device"] != "cpu", f"runs on the CPU (got --device {values['device']})"),
        (values["compile"], "--compile compiles the torch engines' forwards; leave it off"),
        (
            values.get("tensor_parallel", 1) > 1,
            "--tensor-parallel shards a torch model; set it to 1",
        ),
        (values["pack_weights"] == "true", "--pack-weights packs torch's weights; leave it auto"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{where}: {why}")


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
            engine == "paged",
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
