"""The verifier's configuration: a replica's settings, and tensor parallelism, which only
the verifier runs (the drafter is not offered the flag)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.common.settings import positive, setting
from specdec.replica.config import ReplicaConfig


@dataclass(frozen=True)
class VerifierConfig(ReplicaConfig):
    # specdec.replica.tp; declared here, it keeps ReplicaConfig's field (and flag) order
    tensor_parallel: int = setting(
        1,
        "run the replica as N ranks on this machine, the model's layers sharded across "
        "them (transformers' tp_plan; gloo on cpu, NCCL on cuda, one GPU a rank); rank 0 "
        "serves",
        check=positive,
    )

    ROLE: ClassVar[str] = "verifier"
