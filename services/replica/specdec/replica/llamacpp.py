"""The llama.cpp engine (--engine llama.cpp): a replica's forwards on llama.cpp's kernels,
the GGUF loaded as shipped (no dequantization), through llama-cpp-python's low-level API.

Why. On a CPU, llama.cpp's kernels over 4-bit weights run the same model several times
faster than transformers in bfloat16 (docs/concepts/engine.md has the figures); the
drafter's and the verifier's jobs (specdec.drafter.proposer, specdec.drafter.speculate,
specdec.verifier.scorer) are written against the engine seam (specdec.replica.engine) and
run on this engine unchanged: they yield the same `ForwardRequest`s and `BranchStep`s, and
receive fp32 logits [rows, vocab] as torch tensors on the CPU, so the rejection rule, the
request's logits processors, logprobs and grammar masks apply as on the torch engine.

Sessions are llama.cpp sequences of one context whose KV cache is unified (one buffer of
cells for every sequence; a cell may belong to several sequences):

- a session is one sequence id (`LlamaStore`): its history's KV is kept between rounds;
  rollback of rejected drafts removes the sequence's cells from a position on
  (`llama_memory_seq_rm`); a fork (n > 1, `fork_from`) copies the source's first tokens
  into a new sequence, which in a unified cache adds the new id to the same cells
  (`llama_memory_seq_cp`: nothing is copied);
- an SSD branch row or a continued tree leaf (a `BranchGroup` row) is a sequence of its
  own that starts as a copy of the session's first `visible` cells, then holds the row's
  own tokens; its ids go back to the pool when the group is gone;
- a token tree verified in one forward: each leaf of the tree gets a sequence that starts
  as a copy of the session's cells; the plain tokens before the tree belong to the session
  and every leaf, each node to the leaves below it, at position (before the tree) + its
  depth. llama.cpp lets a token attend to the cells of its own first sequence at positions
  up to its own, so a node sees the session, the plain tokens and its ancestors only (a
  sibling sits at the same position in other sequences). After the verdict the accepted
  path is the first cells of one leaf's sequence: copied into the session's
  (`keep_path`), the leaves' sequences dropped.

A forward over several requests is one `llama_decode` of one batch: each request's tokens
at their positions in their sequences, logits asked for only where a job reads them.
llama.cpp splits the batch into micro-batches itself.

Threads: llama.cpp's own pool, sized like torch's (--threads, else the CPUs this process
may use). Everything runs on the model thread (specdec.replica.batching.Scheduler).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.common.cost import Line
from specdec.common.errors import CapacityExceeded, FailedPrecondition
from specdec.common.settings import ConfigError, env_name
from specdec.replica.batching import BranchGroup, BranchStep, ForwardRequest, ModelRequest
from specdec.replica.config import ReplicaConfig
from specdec.replica.cpus import thread_budget
from specdec.replica.features import FeatureAsk
from specdec.replica.kvstore import CacheStore, SessionCache
from specdec.replica.runtime import ModelRuntime
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

ENGINE = "llama.cpp"
# llama.cpp's bound on sequence ids in one context (LLAMA_MAX_SEQ).
MAX_SEQUENCES = 256
# --llama-kv-dtype: ggml's type ids of the KV cells.
KV_TYPES = {"f32": 0, "f16": 1}


def available() -> str:
    """Why the llama.cpp engine cannot run here ('' when it can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return (
            f"llama-cpp-python is not installed ({e}); install the replica's llama.cpp extra "
            "(`pip install './services/replica[llamacpp]'`, or `make install`)"
        )
    return ""


# The child `probe_extra_buffers` runs: load the GGUF with llama.cpp's extra buffer types
# (repacked weights: AMX tiles on a Xeon with AMX, interleaved blocks elsewhere) and decode a
# few tokens. SPECDEC_LLAMACPP_PROBE_FAULT makes it die as the AMX crash does (the tests).
_PROBE = """
import os, signal, sys
import llama_cpp
if os.environ.get("SPECDEC_LLAMACPP_PROBE_FAULT"):
    os.kill(os.getpid(), signal.SIGSEGV)
quiet = llama_cpp.llama_log_callback(lambda *a: None)  # kept: llama.cpp calls it
llama_cpp.llama_log_set(quiet, None)
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.use_extra_bufts = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
assert model, "no model"
cparams = llama_cpp.llama_context_default_params()
cparams.n_ctx, cparams.n_batch, cparams.n_threads = 64, 16, 1
ctx = llama_cpp.llama_init_from_model(model, cparams)
tokens = (llama_cpp.llama_token * 8)(*range(1, 9))
for n in (8, 1):
    assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, n)) == 0
print("ok")
"""


def probe_extra_buffers(gguf: Path) -> tuple[bool, str]:
    """Whether llama.cpp may put the weights in its extra buffer types on this machine, and
    why. On an Intel Xeon with AMX in a VM, llama-cpp-python 0.3.36 crashed (SIGSEGV) at the
    first decode with the weights in its AMX buffer type: a child process loads the GGUF
    that way and decodes first; if it does not come back, the engine runs without them."""
    import subprocess
    import sys

    started = time.monotonic()
    try:
        child = subprocess.run(
            [sys.executable, "-c", _PROBE, str(gguf)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return False, "a decode with extra buffer types did not finish in 600 s"
    seconds = time.monotonic() - started
    if child.returncode == 0 and child.stdout.strip() == "ok":
        return True, f"extra buffer types decoded in a probe ({seconds:.1f} s)"
    if child.returncode < 0:
        import signal

        cause = f"died of {signal.Signals(-child.returncode).name}"
    else:
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        cause = f"exited {child.returncode}: {last}"
    return False, f"a decode with extra buffer types {cause}: they are off"


def find_gguf(model: str, gguf_file: str | None) -> Path:
    """The GGUF the llama.cpp engine loads for --model / --gguf-file: --gguf-file (a path,
    or a name inside --model); else --model itself when it is a .gguf file; else the one
    .gguf inside the --model folder; else the GGUF that `specdec models install` kept
    beside it (the folder's parent holds specdec-model.json). ConfigError naming what was
    looked at when none is found."""
    where = f"--engine {ENGINE} / {env_name('--engine')}"
    folder = Path(model)
    if gguf_file:
        path = Path(gguf_file)
        path = path if path.is_absolute() or os.sep in gguf_file else folder / path
        if not path.is_file():
            raise ConfigError(
                f"--gguf-file / {env_name('--gguf-file')}: no such file {str(path)!r}"
            )
        return path
    if folder.is_file() and folder.suffix == ".gguf":
        return folder
    if not folder.is_dir():
        raise ConfigError(f"{where}: --model {model!r} is neither a folder nor a .gguf file")
    found = sorted(folder.glob("*.gguf"))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ConfigError(
            f"{where}: {model} holds several GGUF files ({names}); name one with --gguf-file"
        )
    marker = folder.parent / "specdec-model.json"
    if marker.is_file():
        kept: Path = folder.parent / json.loads(marker.read_text())["gguf"]["file"]
        if kept.is_file():
            return kept
    raise ConfigError(
        f"{where} loads a GGUF file: none in {model} (nor a specdec-model.json beside it); "
        "give --gguf-file PATH"
    )


@dataclass
class LlamaSession(SessionCache):
    """A session of the llama.cpp engine: `kv` is its sequence id. A token tree forwarded
    and not yet resolved (`LlamaStore.keep_path`) keeps its leaves' sequences here."""

    tree: TreeSequences | None = None


@dataclass
class TreeSequences:
    """The sequences of a token tree's leaves after its forward: node i (0-based, in node
    order) belongs to the sequences leaves[j] for the j in `below[i]`; the tree's first
    node sits at position `base` + 0."""

    base: int
    leaves: list[int]  # sequence ids, one per leaf
    below: list[list[int]]  # per node: indices into leaves


class LlamaContext:
    """A loaded GGUF and one llama.cpp context over it: the C API the engine needs."""

    def __init__(
        self,
        path: Path,
        n_ctx: int,
        n_batch: int,
        threads: int,
        kv_dtype: str = "f16",
        extra_bufts: bool = True,
    ):
        import llama_cpp

        self.lib = llama_cpp
        _quiet_logs(llama_cpp)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = extra_bufts
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path} (not a GGUF it reads?)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.model))
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self.model, buf, ctypes.sizeof(buf))
        self.description = buf.value.decode(errors="replace")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_batch, 512)
        cparams.n_seq_max = MAX_SEQUENCES
        cparams.n_outputs_max = max(n_batch, MAX_SEQUENCES)  # llama.cpp reserves >= n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = True  # forks, branch rows and tree leaves share cells
        cparams.no_perf = True
        # Flash attention on the CPU accumulates in an order that follows the cells' order
        # in the cache, which forks, trees and other sessions change: its logits moved by up
        # to 8e-3 between layouts of the same sequence on the tiny models. Off, they stay
        # within 1.5e-5 (f32 cells) of a one-sequence run.
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.type_k = cparams.type_v = KV_TYPES[kv_dtype]
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not make a context of {n_ctx} cells for {path}")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, MAX_SEQUENCES)

    def decode(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        sequences: Sequence[Sequence[int]],
        outputs: Sequence[bool],
    ) -> torch.Tensor:
        """One llama_decode: token i at positions[i] in sequences[i] (the first is the one
        whose cells it attends to); the logits of the tokens whose outputs[i] is set, in
        batch order [outputs, vocab] fp32."""
        n = len(tokens)
        if n > self.n_batch:
            raise ValueError(f"a forward of {n} tokens exceeds the batch of {self.n_batch}")
        batch = self._batch
        for i in range(n):
            batch.token[i] = tokens[i]
            batch.pos[i] = positions[i]
            seqs = sequences[i]
            batch.n_seq_id[i] = len(seqs)
            row = batch.seq_id[i]
            for j, seq in enumerate(seqs):
                row[j] = seq
            batch.logits[i] = 1 if outputs[i] else 0
        batch.n_tokens = n
        status = self.lib.llama_decode(self.ctx, batch)
        if status == 1:
            raise CapacityExceeded(
                f"llama.cpp found no room for a forward of {n} tokens in its {self.n_ctx} KV "
                "cells (--max-cached-tokens)"
            )
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        count = sum(1 for o in outputs if o)
        if not count:
            return torch.empty(0, self.n_vocab)
        import numpy as np

        # llama.cpp's buffer, reused by the next decode: one copy out of it
        rows = np.ctypeslib.as_array(
            self.lib.llama_get_logits(self.ctx), shape=(count, self.n_vocab)
        )
        return torch.from_numpy(rows.copy())

    def time_shapes(
        self, tokens: Sequence[int], rows: Sequence[int], prefix: int, repeats: int
    ) -> dict[tuple[int, int], float]:
        """{(rows, tokens): median ms} of decodes of `rows` sequences feeding `tokens` each
        after a shared cached prefix of `prefix` tokens (a warm-up, then `repeats`), as the
        engine batches sessions: the same measurement as the torch engines' per-shape table
        (specdec.tools.bench.shapes), on this context (its sequences 0..max(rows)-1)."""
        import statistics

        ids = [(7919 * i + 11) % self.n_vocab for i in range(prefix + max(tokens))]
        top = max(rows)
        for seq in range(top):
            self.seq_rm(seq)
        self.decode(ids[:prefix], range(prefix), [[0]] * prefix, [False] * (prefix - 1) + [True])
        for seq in range(1, top):
            self.seq_cp(0, seq, 0, prefix)
        out: dict[tuple[int, int], float] = {}
        for r in rows:
            for n in tokens:
                feed = [ids[prefix + j] for _ in range(r) for j in range(n)]
                positions = [prefix + j for _ in range(r) for j in range(n)]
                seqs = [[s] for s in range(r) for _ in range(n)]
                outputs = [True] * (r * n)
                samples = []
                for i in range(repeats + 1):
                    started = time.perf_counter()
                    self.decode(feed, positions, seqs, outputs)
                    took = time.perf_counter() - started
                    for seq in range(r):
                        self.seq_rm(seq, prefix, -1)
                    if i:
                        samples.append(took)
                out[(r, n)] = round(statistics.median(samples) * 1e3, 2)
        for seq in range(top):
            self.seq_rm(seq)
        return out

    def seq_rm(self, seq: int, start: int = -1, end: int = -1) -> None:
        """Drop the sequence's cells at positions [start, end) (-1: open)."""
        self.lib.llama_memory_seq_rm(self.memory, seq, start, end)

    def seq_cp(self, source: int, dest: int, start: int, end: int) -> None:
        """Make the source's cells at positions [start, end) the dest's too (no copy)."""
        self.lib.llama_memory_seq_cp(self.memory, source, dest, start, end)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None


_LOG_CALLBACK: Any = None  # kept alive: llama.cpp calls it for as long as it runs


def _quiet_logs(llama_cpp: Any) -> None:  # the llama_cpp module (untyped ctypes bindings)
    """llama.cpp's own log lines would break the replica's JSON logs: errors and warnings
    go through this module's logger, the rest is dropped."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    def forward_line(level: int, text: bytes, _user_data: object) -> None:
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
            message = text.decode(errors="replace").strip()
            if message:
                log.warning("llama.cpp: %s", message)

    callback = llama_cpp.llama_log_callback(forward_line)  # a ctypes callback
    _LOG_CALLBACK = callback
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


class LlamaStore(CacheStore):
    """The sessions' sequences of one llama.cpp context, bounded in cached tokens like the
    other stores (least recently used go first) and in sequence ids (MAX_SEQUENCES, shared
    with the branch rows and tree leaves in flight). Model thread only, except that a
    branch group's sequences come back through `_returned` from wherever the group is
    collected."""

    def __init__(self, max_cached_tokens: int, context: LlamaContext):
        super().__init__(max_cached_tokens)
        self.context = context
        self._free: list[int] = list(range(MAX_SEQUENCES - 1, -1, -1))  # pop() takes 0 first
        self._groups: dict[int, list[int]] = {}  # id(BranchGroup) -> its rows' sequences
        self._returned: deque[int] = deque()  # sequences of collected groups (any thread)
        self._lock = threading.Lock()

    # -- sequence ids -------------------------------------------------------------------

    def take_sequence(self, keep: str = "") -> int:
        """A free sequence id; least recently used idle sessions other than `keep` are
        evicted when none is free."""
        self._reclaim()
        while not self._free:
            victim = next((v for v in self._sessions if v != keep and self._evictable(v)), None)
            if victim is None:
                raise CapacityExceeded(
                    f"the llama.cpp engine has no free sequence: {MAX_SEQUENCES} are held by "
                    "sessions in use, branch rows and tree leaves"
                )
            self.release(victim)
        return self._free.pop()

    def give_back(self, seq: int) -> None:
        self.context.seq_rm(seq)
        self._free.append(seq)

    def _reclaim(self) -> None:
        """Return the sequences of branch groups that are gone."""
        while self._returned:
            self.give_back(self._returned.popleft())

    def group_sequences(self, group: BranchGroup) -> list[int]:
        """The sequences of a branch group's rows: made at its first step, each a copy of
        the session's first visible[i] cells; given back once the group is collected."""
        seqs = self._groups.get(id(group))
        if seqs is not None:
            return seqs
        session = group.session
        seqs = []
        try:
            for visible in group.visible:
                seq = self.take_sequence()
                seqs.append(seq)
                self.context.seq_cp(session.kv, seq, 0, visible)
        except BaseException:
            for seq in seqs:
                self.give_back(seq)
            raise
        self._groups[id(group)] = seqs
        weakref.finalize(group, self._collected, id(group))
        return seqs

    def _collected(self, key: int) -> None:
        with self._lock:
            seqs = self._groups.pop(key, [])
        self._returned.extend(seqs)

    # -- the KV operations --------------------------------------------------------------

    def _new_session(self) -> LlamaSession:
        return LlamaSession(tokens=[], kv=self.take_sequence())

    def _copy(self, source: SessionCache, length: int) -> LlamaSession:
        seq = self.take_sequence()
        self.context.seq_cp(source.kv, seq, 0, length)
        return LlamaSession(tokens=source.tokens[:length], kv=seq)

    def _crop(self, session: SessionCache, length: int) -> None:
        self.context.seq_rm(session.kv, length, -1)

    def _drop(self, session: SessionCache) -> None:
        assert isinstance(session, LlamaSession)
        self._drop_tree(session)
        self.give_back(session.kv)

    def _evictable(self, session_id: str) -> bool:
        """Not a session a job works on: its sequence would be reused under it."""
        return session_id not in self._held

    # -- token trees ----------------------------------------------------------------------

    def tree_sequences(
        self, session: LlamaSession, base: int, parents: Sequence[int]
    ) -> TreeSequences:
        """Sequences for a token tree whose first node will sit at position `base`: one per
        leaf, each a copy of the session's cached cells (the plain tokens fed before the tree
        in the same forward join every leaf's sequence, `LlamaCppRuntime._rows`)."""
        self._drop_tree(session)
        m = len(parents)
        children = [0] * m
        for p in parents:
            if p >= 0:
                children[p] += 1
        leaf_nodes = [i for i in range(m) if children[i] == 0]
        leaves: list[int] = []
        try:
            for _ in leaf_nodes:
                seq = self.take_sequence()
                leaves.append(seq)
                self.context.seq_cp(session.kv, seq, 0, len(session.tokens))
        except BaseException:
            for seq in leaves:
                self.give_back(seq)
            raise
        below: list[list[int]] = [[] for _ in range(m)]
        for j, leaf in enumerate(leaf_nodes):
            node = leaf
            while node >= 0:
                below[node].append(j)
                node = parents[node]
        session.tree = TreeSequences(base, leaves, below)
        return session.tree

    def keep_path(self, session: SessionCache, base: int, path: Sequence[int]) -> None:
        """After a tree forward (nodes from position `base` on, in node order), keep only
        the accepted path: the cells of the path's nodes are the first len(path) cells of
        any leaf's sequence below its last node, copied into the session's sequence; the
        other nodes' cells go with the leaves' sequences."""
        assert isinstance(session, LlamaSession)
        tree = session.tree
        if tree is None or tree.base != base:
            raise RuntimeError("keep_path without the token tree's forward on this session")
        self.context.seq_rm(session.kv, base, -1)
        if path:
            leaf = tree.leaves[tree.below[path[-1]][0]]
            self.context.seq_cp(leaf, session.kv, base, base + len(path))
            session.tokens[base : base + len(path)] = [session.tokens[base + i] for i in path]
        self._drop_tree(session)
        self.truncate(session, base + len(path))

    def _drop_tree(self, session: LlamaSession) -> None:
        if session.tree is not None:
            for seq in session.tree.leaves:
                self.give_back(seq)
            session.tree = None


@dataclass
class _Rows:
    """One batch being laid out: each request's tokens, positions, sequences and which of
    them return logits."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sequences: list[list[int]] = field(default_factory=list)
    outputs: list[bool] = field(default_factory=list)

    def add(self, token: int, position: int, seqs: list[int], output: bool) -> None:
        self.tokens.append(token)
        self.positions.append(position)
        self.sequences.append(seqs)
        self.outputs.append(output)


class LlamaCppRuntime(ModelRuntime):
    """A replica's engine on llama.cpp: the ModelRuntime's queue, scheduler, validation and
    jobs, with the model, the sessions' KV and the forwards in llama.cpp."""

    # A forward is its rows' tokens laid end to end (no pads): it costs the tokens it
    # computes, and the replica's cost curve is one line over them (specdec.common.cost).
    RAGGED = True

    def __init__(self, config: ReplicaConfig):
        super().__init__(config)
        self.context: LlamaContext | None = None
        self.gguf: Path | None = None

    def load(self) -> None:
        """Load the GGUF into llama.cpp, the tokenizer and the model's facts beside it."""
        from specdec.replica.loading import load_facts

        cfg = self.config
        started = time.monotonic()
        self.gguf = find_gguf(cfg.model, cfg.gguf_file)
        facts = load_facts(cfg, gguf=self.gguf)
        threads = thread_budget(cfg.threads).threads
        extra, why = probe_extra_buffers(self.gguf)
        if not extra:
            log.warning("llama.cpp extra buffer types off", extra={"why": why})
        # The cells: the sessions' bound, and the rows a forward may add beside it (branch
        # rows and tree nodes live in cells of their own until they are dropped).
        n_ctx = cfg.max_cached_tokens + cfg.max_batch_tokens
        n_batch = max(cfg.max_batch_tokens, cfg.prefill_chunk or 0, 2 * (cfg.max_draft_tokens + 1))
        self.context = LlamaContext(
            self.gguf, n_ctx, n_batch, threads, cfg.llama_kv_dtype, extra_bufts=extra
        )
        self.model = None
        self.vocab_size = self.context.n_vocab
        if facts.vocab_size and facts.vocab_size != self.vocab_size:
            log.info(
                "the GGUF's vocabulary differs from the checkpoint config's",
                extra={"gguf": self.vocab_size, "config": facts.vocab_size},
            )
        self.max_context = min(
            x for x in (self.context.n_ctx_train, cfg.max_context, facts.max_context) if x
        )
        self.adopt_facts(facts)
        self.dtype_reason = f"GGUF as shipped: {self.context.description} ({self.gguf.name}); {why}"
        self.store = LlamaStore(cfg.max_cached_tokens, self.context)
        if cfg.cost_probe:
            self.probe_cost()
        log.info(
            "model loaded",
            extra={
                "model": cfg.model,
                "gguf": str(self.gguf),
                "engine": ENGINE,
                "description": self.context.description,
                "threads": threads,
                "kv_cells": self.context.n_ctx,
                "extra_buffer_types": extra,
                "vocab_size": self.vocab_size,
                "max_context": self.max_context,
                "seconds": round(time.monotonic() - started, 2),
            },
        )

    @property
    def dtype_name(self) -> str:
        return "gguf" if self.context is not None else ""

    def feature_ask(self, msg: common_pb2.FeatureRequest) -> FeatureAsk:
        """Refused: llama.cpp's decode gives logits, not the layers' hidden states."""
        raise FailedPrecondition(
            f"features (the target's hidden states, for a head drafter) are not available "
            f"with --engine {ENGINE}; run the verifier with --engine dense or paged"
        )

    # -- forwards -----------------------------------------------------------------------

    def _run_batch(self, requests: list[ModelRequest]) -> list[torch.Tensor]:
        """One llama_decode over the requests; each request's logits (a ForwardRequest's
        last `keep` rows [keep, vocab], a BranchStep's one row per branch [rows, vocab])."""
        store = self.store
        assert isinstance(store, LlamaStore) and self.context is not None
        store._reclaim()
        rows = _Rows()
        counts: list[int] = []
        for request in requests:
            counts.append(self._rows(store, request, rows))
        tokens = len(rows.tokens)
        fresh = all(r.fresh for r in requests)
        longest = max(r.width for r in requests)
        started = time.perf_counter()
        with self.obs.forward(tokens, sum(r.rows for r in requests), fresh, sessions=len(requests)):
            logits = self.context.decode(rows.tokens, rows.positions, rows.sequences, rows.outputs)
        for request in requests:
            if isinstance(request, ForwardRequest):
                request.session.append(request.tokens)
            else:
                request.group.fed += 1
        self._timed(longest, sum(r.rows for r in requests), started, computed=tokens)
        return list(torch.split(logits, counts))

    def _rows(self, store: LlamaStore, request: ModelRequest, rows: _Rows) -> int:
        """Lay a request out in the batch; how many logits rows it returns."""
        tokens = request.tokens
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if isinstance(request, BranchStep):
            group = request.group
            seqs = store.group_sequences(group)
            for seq, position, token in zip(seqs, group.positions(), values, strict=True):
                rows.add(token, position, [seq], True)
            return len(values)
        session = request.session
        cached, n, keep = len(session.tokens), len(values), request.keep
        if not request.tree:
            for j, token in enumerate(values):
                rows.add(token, cached + j, [session.kv], j >= n - keep)
            return keep
        parents = request.tree
        m = len(parents)
        h = n - m
        tree = store.tree_sequences(session, cached + h, parents)
        plain = [session.kv, *tree.leaves]
        for j in range(h):
            rows.add(values[j], cached + j, plain, j >= n - keep)
        depth = [0] * m
        for i, p in enumerate(parents):
            depth[i] = 0 if p < 0 else depth[p] + 1
            seqs = [tree.leaves[leaf] for leaf in tree.below[i]]
            rows.add(values[h + i], cached + h + depth[i], seqs, h + i >= n - keep)
        return keep

    PROBE_SEQUENCE_NAME = "\x00probe"

    def probe_cost(self) -> Line:
        """Time decodes of PROBE_WIDTHS tokens after a short context in a scratch session,
        the fastest of a few sweeps per width; their line seeds the cost curve."""
        store = self.store
        assert isinstance(store, LlamaStore) and self.context is not None
        widths = self.probe_widths()
        ids = self.probe_ids(self.PROBE_CONTEXT + max(widths) + 2)
        name = self.PROBE_SEQUENCE_NAME
        session = store.acquire(name, 0, 0, self.PROBE_CONTEXT + max(widths))
        try:
            self.forward(session, ids[: self.PROBE_CONTEXT], keep=1)
            self.forward(session, ids[self.PROBE_CONTEXT : self.PROBE_CONTEXT + 1])  # warm-up
            best: dict[int, float] = {}
            spent = 0.0
            for _ in range(self.PROBE_SWEEPS):
                for n in widths:
                    store.truncate(session, self.PROBE_CONTEXT)
                    started = time.perf_counter()
                    self.forward(session, ids[self.PROBE_CONTEXT : self.PROBE_CONTEXT + n], keep=n)
                    ms = (time.perf_counter() - started) * 1e3
                    best[n] = min(ms, best.get(n, ms))
                    spent += ms / 1e3
                if spent >= self.PROBE_BUDGET_S:
                    break
        finally:
            store.release(name)
        return self.seed_cost(best)

    def compile(self) -> None:
        raise ConfigError(
            f"--compile: compiled forwards are the torch engines'; --engine {ENGINE} runs llama.cpp's own"
        )


@dataclass(frozen=True)
class EngineChoice:
    """What --engine auto runs on, why, and what was measured ({engine: {tokens: ms}})."""

    engine: str
    reason: str
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict)


def llama_candidate(cfg: ReplicaConfig) -> tuple[Path | None, str]:
    """The GGUF --engine auto may run this replica on through llama.cpp, or why not."""
    if cfg.device != "cpu" or cfg.compile or cfg.tensor_parallel > 1:
        return None, "llama.cpp runs on the CPU without --compile or --tensor-parallel"
    if cfg.pack_weights == "true":
        return None, "--pack-weights true asks for the torch engine"
    if (
        getattr(cfg, "quantize", "none") != "none"
        or getattr(cfg, "draft_vocab", 0)
        or getattr(cfg, "draft_vocab_file", "")
    ):
        return None, "--quantize and --draft-vocab are the torch engine's"
    if getattr(cfg, "head", ""):
        return None, "a head drafter (--head) runs on the torch engines"
    missing = available()
    if missing:
        return None, "llama-cpp-python is not installed"
    try:
        return find_gguf(cfg.model, cfg.gguf_file), ""
    except ConfigError:
        return None, "no GGUF beside the model"


# The share of draft tokens a verifier's price assumes accepted, each independently: between
# the hybrid drafts' 42% and the draft model's 78% on the pretrained pair (2026-11-28,
# docs/benchmarks/2026-11-28-llamacpp.md).
ACCEPTANCE_PRIOR = 0.6


def role_price(timings: dict[int, float], drafter: bool) -> float:
    """What a forward curve (ms by tokens: {1: t(1), 8: t(8)}) costs a role, in ms: a
    drafter its one-token step; a verifier the ms per emitted token of a round verifying
    k + 1 tokens, t(k + 1) over the tokens it emits at ACCEPTANCE_PRIOR ((1 - a^(k+1)) /
    (1 - a)), at its best k from 0 (a plain decode) to 7, t on the line through the two
    points. A curve whose extra tokens cost nearly a step each (llama.cpp's CPU kernels)
    is priced by its step; a flat one (torch's packed layouts) by its verify."""
    if drafter:
        return timings[1]
    (n0, t0), (n1, t1) = sorted(timings.items())[:2]
    slope = (t1 - t0) / (n1 - n0)
    a = ACCEPTANCE_PRIOR
    return min((t0 + slope * k) / ((1 - a ** (k + 1)) / (1 - a)) for k in range(n1))


def choose_engine(cfg: ReplicaConfig) -> EngineChoice:
    """--engine auto: the engine that gives this replica's role the most tokens per second
    here, by measurement. Where llama.cpp can run the model (`llama_candidate`), its
    forwards of 1 and 8 tokens after a short prefix (with the replica's threads) are timed
    against the torch engine's in the dtype it would load (specdec.replica.calibrate, cached
    per machine), and each engine is priced for the role (`role_price`): a drafter by its
    one-token step, a verifier by the milliseconds per emitted token of its verify curve at
    its best draft length. Otherwise the torch engines' own choice (ReplicaConfig.kv_engine)."""
    from specdec.replica import calibrate

    torch_engine = cfg.kv_engine
    gguf, why = llama_candidate(cfg)
    if gguf is None:
        return EngineChoice(torch_engine, f"engine {torch_engine}: {why}")
    drafter = cfg.role == "drafter"
    threads = thread_budget(cfg.threads).threads
    context = LlamaContext(gguf, 256, 64, threads, cfg.llama_kv_dtype)
    try:
        measured = context.time_shapes(calibrate.SIZES, (1,), calibrate.PREFIX_TOKENS, 3)
    finally:
        context.close()
    llama = {n: ms for (_, n), ms in measured.items()}
    # The torch engine's forwards, in the dtype and layout it would load: the calibration's
    # (measured once per machine and cached), read for --dtype as given.
    choice = calibrate.fastest_dtype(
        cfg.model,
        device=cfg.device,
        threads=cfg.threads,
        gguf_file=cfg.gguf_file if cfg.gguf_file and os.sep not in cfg.gguf_file else None,
        trust_remote_code=cfg.trust_remote_code,
    )
    if cfg.dtype in (calibrate.FASTEST, "auto"):
        labels = [choice.label]
    else:
        labels = [cfg.dtype, cfg.dtype + calibrate.PACKED][
            : 1 if cfg.pack_weights == "false" else 2
        ]
    measured_torch = {lab: choice.timings_ms[lab] for lab in labels if lab in choice.timings_ms}
    timings = {ENGINE: llama}
    if not measured_torch:
        return EngineChoice(
            torch_engine, f"engine {torch_engine}: --dtype {cfg.dtype} was not measured", timings
        )
    label = min(measured_torch, key=lambda lab: role_price(measured_torch[lab], drafter))
    torch_ms = measured_torch[label]
    timings[f"{torch_engine} {label}"] = torch_ms
    ours, theirs = role_price(llama, drafter), role_price(torch_ms, drafter)
    price = (
        "a draft step"
        if drafter
        else f"ms per token at the best draft length (acceptance {ACCEPTANCE_PRIOR:.0%})"
    )
    engine = ENGINE if ours < theirs else torch_engine
    reason = (
        f"engine {engine}, measured: {price} {ours:.0f} ms on llama.cpp ({gguf.name}) "
        f"against {theirs:.0f} ms on {torch_engine} {label}"
    )
    return EngineChoice(engine, reason, timings)
