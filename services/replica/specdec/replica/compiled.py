"""Compiled forwards (--compile): the model's decoder through torch.compile, for the
forwards whose shapes repeat.

What is compiled. The forwards a replica runs over and over are short: a decode step (one
token a row), a verify of k + 1 tokens, an SSD branch step (one token per branch row), the
drafter's feed of the accepted tokens. With --compile the runtime (ModelRuntime._run_batch)
sends every forward of at most `max(buckets)` tokens a row after a cached prefix of at
least 2 slots through one path: the padded batch layout (specdec.replica.batching.Layout,
used unchanged by the dense engine's batched forwards) and the model's decoder compiled
here, then the output head (or the drafter's reduced head) eager on the kept rows.
Prefill, long feeds and token trees run the eager forwards as without --compile.

Bucketed shapes. The layout's input width N (tokens a row) is padded up to the next
bucket (1, 2, 4, 8, 16, ... up to the bucket of --max-draft-tokens + 1); the pads are
right pads, masked like any other (no real query sees one, their keys/values are never
written back), so a forward's result is the unpadded one's. The cached width L (keys and
values a row attends to) grows every step: it is a dynamic dimension of the compiled graph
(torch._dynamo.mark_dynamic on the cache's and the mask's length), and so is the row count R
when it is at least 2 (torch specialises a size of 1). So the graphs are at most one per
(bucket, R == 1 or R >= 2): `Compiled.graph_limit`. Dynamo's recompile limit is set to that,
and reaching it raises instead of running eager (torch's default is a silent fallback).

On CUDA the compile mode is "reduce-overhead": each graph's kernels are captured as CUDA
graphs, one recording per concrete shape, so there L is also padded up to a multiple of
`CUDA_WIDTH_MULTIPLE` (left pads, masked): recordings stay bounded by the context over
that multiple times the graphs. That path has not been run on a GPU yet.

Compile cost. A graph compiles when its shape first runs: the replica runs every shape
while it loads (ModelRuntime.compile), so that a machine that cannot compile (no C++
compiler for inductor's CPU kernels) fails at start-up with the reason and no request waits
for a compile later. Each compile is logged; `seconds` (the total) is in Info
(ModelInfo.compile_seconds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CUDA_WIDTH_MULTIPLE = 256  # cached slots: CUDA graph recordings per L bucket


class CompileError(RuntimeError):
    """torch.compile could not compile the model's forward on this machine."""


def buckets_for(max_tokens: int) -> tuple[int, ...]:
    """The buckets covering forwards of up to max_tokens tokens a row."""
    top = next((b for b in BUCKETS if b >= max_tokens), BUCKETS[-1])
    return tuple(b for b in BUCKETS if b <= top)


class Compiled:
    """The model's decoder compiled for bucketed token counts (see the module docstring).
    Call it with the batched forward's inputs (input_ids [R, N] with N a bucket,
    attention_mask [R, L + N], position_ids [R, N], cache: a DynamicCache of [R, heads, L,
    dim] per layer); returns the decoder's last hidden states [R, N, hidden]."""

    def __init__(self, model: Any, device: torch.device, max_tokens: int):  # a transformers LM
        self.buckets = buckets_for(max_tokens)
        self.cuda = device.type == "cuda"
        self.width_multiple = CUDA_WIDTH_MULTIPLE if self.cuda else 1
        self.mode = "reduce-overhead" if self.cuda else None
        self.graph_limit = 2 * len(self.buckets)  # (bucket, R == 1 or R >= 2)
        self.shapes: dict[tuple[int, bool], float] = {}  # (bucket, batched): compile seconds
        self.seconds = 0.0  # compile seconds so far
        if not self.cuda:
            _check_compiler()
        self._decoder = model.get_decoder()
        # Dynamo keeps graphs per code object; our limit replaces its default (8) and a
        # shape beyond it raises (fail_on_recompile_limit_hit) rather than running eager.
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, self.graph_limit
        )
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self._compiled: Callable[..., Any] = torch.compile(
            self._decoder, mode=self.mode, dynamic=False
        )

    @property
    def top(self) -> int:
        """The most tokens a row a compiled forward takes."""
        return self.buckets[-1]

    def bucket(self, tokens: int) -> int:
        """The input width a forward of `tokens` tokens a row is padded to."""
        return next(b for b in self.buckets if b >= tokens)

    def width(self, cached: int) -> int:
        """The cached width L a forward whose longest row caches `cached` slots uses."""
        m = self.width_multiple
        return -(-cached // m) * m

    def takes(self, longest: int, width: int) -> bool:
        """Whether a forward of `longest` tokens a row after `width` cached slots (its
        longest row's) runs compiled: short inputs after a cache of at least 2 slots (torch
        specialises a dimension of size 0 or 1; the first forward of a session is eager)."""
        return longest <= self.top and width >= 2

    def __call__(self, **inputs: Any) -> torch.Tensor:
        input_ids, mask, cache = inputs["input_ids"], inputs["attention_mask"], inputs["cache"]
        rows, n = input_ids.shape
        assert n in self.buckets, f"input width {n} is not a bucket {self.buckets}"
        batched = rows >= 2
        torch._dynamo.mark_dynamic(mask, 1)
        for layer in cache.layers:
            torch._dynamo.mark_dynamic(layer.keys, 2)
            torch._dynamo.mark_dynamic(layer.values, 2)
        if batched:
            for tensor in (input_ids, mask, inputs["position_ids"]):
                torch._dynamo.mark_dynamic(tensor, 0)
            for layer in cache.layers:
                torch._dynamo.mark_dynamic(layer.keys, 0)
                torch._dynamo.mark_dynamic(layer.values, 0)
        key = (n, batched)
        if key in self.shapes:
            hidden: torch.Tensor = self._compiled(**inputs, use_cache=True).last_hidden_state
            return hidden
        started = time.perf_counter()
        try:
            out: torch.Tensor = self._compiled(**inputs, use_cache=True).last_hidden_state
        except Exception as e:
            raise CompileError(
                f"--compile: torch.compile ({'inductor, ' + self.mode if self.mode else 'inductor'}) "
                f"failed for forwards of {n} tokens x {'R >= 2' if batched else '1'} rows: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from e
        took = time.perf_counter() - started
        self.shapes[key] = took
        self.seconds += took
        log.info(
            "forward shape compiled",
            extra={"tokens": n, "rows": "2+" if batched else "1", "seconds": round(took, 2)},
        )
        return out


def _check_compiler() -> None:
    """CompileError unless inductor finds the C++ compiler its CPU kernels need."""
    from torch._inductor import config, cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        tried = [c for c in config.cpp.cxx if c]
        raise CompileError(
            f"--compile: no C++ compiler for torch.compile's CPU kernels (tried {tried}; "
            f"install g++, or set CXX to one)"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
