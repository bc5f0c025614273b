"""What `specdec demo` and `specdec bench` tell about the machine and the cost of a round.

- `machine_line`: the CPU (model name and the flags that decide what a bf16 matmul costs)
  and the CUDA device when there is one;
- `replica_costs`: each replica's dtype and its measured forward cost curve, from its Info
  (specdec.common.cost: t(n) = a + b·n, fitted on the replica);
- `policy_line`: what the adaptive policy chose in a request (the draft length per round,
  the sources);
- `verdict`: when speculation did not pay on this machine, why, in the curve's terms.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import grpc

from specdec.common.cost import Line, ReportedCost
from specdec.replica.cpus import cpu_info
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc


def machine_line() -> str:
    """'CPU: <model> (<flags>)[; CUDA: <device>]'."""
    cpu = cpu_info()
    text = f"CPU: {cpu.describe()}; {cpu.bf16_note()}"
    try:
        import torch

        if torch.cuda.is_available():
            text += f"; CUDA: {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover - the tools install torch
        pass
    return text


@dataclass(frozen=True)
class ReplicaCost:
    role: str
    dtype: str
    line: Line | None  # one row's forward (batch bucket 1)

    def describe(self) -> str:
        if self.line is None:
            return f"{self.role}: {self.dtype}, no forward cost reported"
        line = self.line
        return (
            f"{self.role} ({self.dtype}): {line.formula()}"
            f" (a 1-token forward {line.ms(1):.1f} ms; one of 4 tokens costs"
            f" {line.ms(4) / line.ms(1):.2f} of it, of 9 tokens {line.ms(9) / line.ms(1):.2f})"
        )


def replica_costs(drafter: str, verifier: str, timeout: float = 10.0) -> list[ReplicaCost]:
    """Info from the drafter and the verifier at these gRPC addresses (plaintext)."""
    out = []
    for role, address, stub in (
        ("drafter", drafter, drafter_pb2_grpc.DrafterServiceStub),
        ("verifier", verifier, verifier_pb2_grpc.VerifierServiceStub),
    ):
        with grpc.insecure_channel(address) as channel:
            info = stub(channel).Info(common_pb2.InfoRequest(), timeout=timeout)
        reported = ReportedCost.from_proto(info.forward_cost)
        out.append(ReplicaCost(role, info.dtype, reported.line(1) if reported else None))
    return out


def policy_line(stats) -> str:
    """What a request's policy chose: its draft lengths and sources (SpeculationStats)."""
    by_k = ", ".join(f"k={k}: {n}" for k, n in enumerate(stats.rounds_by_k) if n)
    sources = ", ".join(
        f"{name} {accepted}/{tokens}"
        for name, (_, tokens, accepted) in sorted(stats.by_source.items())
    )
    return (
        f"{stats.k_policy or 'fixed'} policy: {stats.rounds} rounds ({by_k or 'none'}), "
        f"mean draft {stats.mean_k:.2f} tokens; accepted/drafted by source: {sources or 'none'}"
    )


def verdict(speedup: float, stats, verifier: Line | None, drafter: Line | None) -> str | None:
    """Why speculation did not pay (speedup < 1), in the measured curve's terms; None when
    it paid."""
    if speedup >= 1.0:
        return None
    parts = [f"speculation ran at {speedup:.2f}x the target alone here"]
    if verifier is not None:
        parts.append(
            f"verifying a first draft token costs {verifier.first_share:.2f} of a target step "
            f"on this verifier and each further one {verifier.step_share:.2f} "
            f"(b = {verifier.per_token_ms:.2f} ms against one step of {verifier.ms(1):.1f} ms)"
        )
        if drafter is not None and verifier.ms(1) > 0:
            parts.append(f"a draft token costs c = {drafter.ms(1) / verifier.ms(1):.2f} of a step")
    if stats.draft_tokens:
        parts.append(f"{stats.acceptance_rate:.0%} of the draft tokens were accepted")
    if stats.k_policy == "adaptive":
        parts.append(
            f"the adaptive policy drafted nothing in {stats.rounds_by_k[0] if stats.rounds_by_k else 0}"
            f" of {stats.rounds} rounds; what is left is the loop's own cost per round and "
            "the rounds that measured the drafts"
        )
    parts.append(
        "speculation pays where one more verified token costs little (b near 0: a GPU, a CPU "
        "with bf16 matrix units, or float32 on a CPU without them) and drafts are accepted"
    )
    return "; ".join(parts) + "."


def machine() -> dict:
    """The machine of a benchmark's figures: the CPU, the CPUs this process may use, the
    platform, and `machine_line`."""
    return {
        "cpu": cpu_info().name,
        "cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "describe": machine_line(),  # the CPU flags that decide bf16's cost, CUDA's device
    }
