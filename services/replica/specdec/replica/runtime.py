"""Model runtime shared by the drafter and the verifier: forwards on the model thread.

A `ModelRuntime` holds the loaded model (specdec.replica.loading) and its sessions' KV
caches (specdec.replica.kvstore), bounds the model requests that may queue (backpressure),
and runs every forward in one dedicated thread so the event loop never blocks. What only
the drafter does (a reduced output layer, int8 weights) lives in specdec.drafter.runtime;
the generic hook it uses is `head`.

Threading rule: everything that touches the model or a ``SessionCache`` runs on the model
thread (``ModelRuntime.scheduler``, specdec.replica.batching), so sessions need no locks;
the event loop only validates requests and awaits ``ModelRuntime.run``. A model call is a
job that yields its forwards (`forward_steps`); the scheduler batches the forwards of
concurrent jobs of different sessions into one (see specdec.replica.batching).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

import torch

from specdec.common.cost import CostCurve, Line, LoadWindow
from specdec.common.errors import (
    BUSY_PREFIX,
    CacheMiss,
    CapacityExceeded,
    InvalidRequest,
    NotReady,
    ReplicaBusy,
    Unimplemented,
)
from specdec.replica.batching import (
    BranchStep,
    ForwardRequest,
    Layout,
    ModelRequest,
    Scheduler,
    tree_visibility,
)
from specdec.replica.compiled import Compiled
from specdec.replica.config import ReplicaConfig
from specdec.replica.engine import Prefix, TransformersStore
from specdec.replica.features import FeatureAsk, FeatureSink, ask_from_proto, recording
from specdec.replica.kvstore import CacheStore, SessionCache
from specdec.replica.loading import LoadedModel, check_batchable, check_rollback, load_model
from specdec.replica.metrics import ReplicaObserver
from specdec.replica.paged import BlockPool, PagedStore
from specdec.sdk.request import Sampling
from specdec.v1 import common_pb2

if TYPE_CHECKING:
    from transformers import DynamicCache

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["CacheStore", "ModelRuntime", "SessionCache"]


class ModelRuntime:
    """A causal LM with per-session KV caches, driven from one model thread."""

    # A batched forward pads every row to its widest (torch): its cost curve has a line per
    # batch bucket over tokens a row. True: no pads (specdec.common.cost, "ragged").
    RAGGED: ClassVar[bool] = False

    def __init__(self, config: ReplicaConfig):
        self.config = config
        self.scheduler = Scheduler(
            f"{config.role}-model",
            config.max_batch_size,
            config.max_batch_tokens,
            run_batch=self._run_batch,
            note_member=self._note_member,
            max_batch_wait=config.max_batch_wait_ms / 1e3,
        )
        # Model requests submitted and not finished (the running one included), and the
        # lock that guards the count: bounded by config.max_queue (backpressure, `run`).
        self.pending = 0
        self._pending_lock = threading.Lock()
        self.model: Any = None  # the transformers model, once loaded (load)
        self.device = torch.device(config.device)
        self.vocab_size = 0
        self.max_context = 0
        self.eos_token_ids: list[int] = []
        self.sampling_defaults = Sampling().resolve()  # the model's generation_config's
        self.bos_token_id: int = -1
        self.tokenizer_json = b""
        self.tokenizer_fingerprint = ""
        self.chat_template = ""
        self.special_tokens: dict[str, str] = {}  # bos_token, eos_token, ... (chat templates)
        self.dtype_reason = ""  # why the weights are in their dtype (--dtype fastest: measured)
        self.engine_reason = ""  # why --engine auto chose this engine (measured), Info
        self.store: TransformersStore[SessionCache] | None = None
        self.obs = ReplicaObserver(self)  # metrics and spans (specdec.replica.metrics)
        self._keeps_logits = False  # the model's forward takes logits_to_keep
        # The drafter's reduced output layer (specdec.drafter.vocab.ReducedHead): hidden
        # states [..., hidden] -> fp32 logits [..., vocab], -inf outside its subset. None:
        # the model's own output layer (the verifier always).
        self.head: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The forward cost curve (specdec.common.cost), fed on the model thread; `cost_lines`
        # is its latest fit, an immutable snapshot the servicers read from the event loop.
        self.cost = CostCurve(ragged=self.RAGGED)
        self.cost_lines: list[tuple[int, Line]] = []
        self.cost_points: list[tuple[float, float, float]] = []  # RAGGED: the measured points
        # Every forward of the last seconds, reported as the replica's load with the curve.
        self.load_window = LoadWindow(since=time.perf_counter())
        self._timing = True  # False while a probe's untimed forwards run (`_untimed`)
        self._probing = False  # the batched probe runs: its forwards are no served forwards
        # --compile: the decoder compiled for the short forwards (specdec.replica.compiled).
        self.compiled: Compiled | None = None
        # A head drafter (specdec.drafter.head): the target's features it drafts from
        # (ModelInfo.features). None: a model that drafts or verifies by itself.
        self.head_features: FeatureAsk | None = None

    # -- loading ------------------------------------------------------------------------

    def load(self) -> None:
        """Load model and tokenizer (blocking; call on the model thread)."""
        cfg = self.config
        started = time.monotonic()
        loaded = self.load_weights()
        self.model = loaded.model
        self.vocab_size = loaded.vocab_size
        self.max_context = loaded.max_context
        self.adopt_facts(loaded)
        self.dtype_reason = loaded.dtype_reason
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        check_rollback(self._new_cache(), cfg.model)
        if cfg.kv_engine == "paged":
            check_batchable(self.model, cfg.model, "run it with --engine dense --max-batch-size 1")
        elif cfg.max_batch_size > 1:
            check_batchable(self.model, cfg.model)
        self.store = self.new_store(cfg.kv_engine)
        if cfg.compile:
            self.compile()
        if cfg.cost_probe:
            self.probe_cost()
            if cfg.max_batch_size > 1 and cfg.tensor_parallel == 1:
                self.probe_batches()
        log.info(
            "model loaded",
            extra={
                "model": cfg.model,
                "dtype": str(self.model.dtype),
                "dtype_reason": self.dtype_reason,
                "device": str(self.device),
                "engine": cfg.kv_engine,
                "tensor_parallel": cfg.tensor_parallel,
                "compiled": self.compiled is not None,
                "compile_seconds": round(self.compiled.seconds, 2) if self.compiled else None,
                "vocab_size": self.vocab_size,
                "max_context": self.max_context,
                "seconds": round(time.monotonic() - started, 2),
            },
        )

    def load_weights(self) -> LoadedModel:
        """The model and its facts (specdec.replica.loading.load_model: --model as
        configured); a runtime that builds its model otherwise (a head drafter) overrides
        it."""
        return load_model(self.config, self.device)

    def adopt_facts(self, facts: Any) -> None:
        """What Info reports of the tokenizer and the generation config, from a loaded
        model's facts (specdec.replica.loading: LoadedModel or ModelFacts)."""
        self.eos_token_ids = facts.eos_token_ids
        self.sampling_defaults = facts.sampling_defaults
        self.bos_token_id = facts.bos_token_id
        self.chat_template = facts.chat_template
        self.special_tokens = facts.special_tokens
        self.tokenizer_json = facts.tokenizer_json
        self.tokenizer_fingerprint = facts.tokenizer_fingerprint

    PROBE_CONTEXT = 32  # tokens cached before the probe's forwards
    PROBE_WIDTHS = (1, 2, 4, 8, 16)
    PROBE_SWEEPS = 3  # at most, each width's fastest forward kept
    PROBE_BUDGET_S = 1.0  # no sweep starts after the sweeps so far took this long

    @torch.inference_mode()
    def probe_cost(self) -> Line:
        """Time forwards of PROBE_WIDTHS tokens after a short context on a scratch cache
        (no session), a warm-up first; their line seeds the cost curve (model thread)."""
        widths = self.probe_widths()
        ids = self.probe_ids(self.PROBE_CONTEXT + sum(widths) + 2)
        kv = self._new_cache()
        feed = torch.tensor([ids[: self.PROBE_CONTEXT]], dtype=torch.long, device=self.device)
        self.model_logits(1, input_ids=feed, cache=kv)
        at = self.PROBE_CONTEXT
        self.model_logits(1, input_ids=feed[:, :1], cache=kv)  # warm-up
        # Sweeps of every width, the fastest of each width kept: a forward the OS delayed
        # (another process on the CPU) would tilt a one-sample line. Cheap forwards sweep
        # PROBE_SWEEPS times; once a sweep has taken PROBE_BUDGET_S, no more start.
        # Tensor-parallel ranks must run the same forwards, which a time budget cannot
        # promise: one sweep there.
        sweeps = self.PROBE_SWEEPS if self.config.tensor_parallel == 1 else 1
        best: dict[int, float] = {}
        spent = 0.0
        for _ in range(sweeps):
            for n in widths:
                feed = torch.tensor([ids[at : at + n]], dtype=torch.long, device=self.device)
                started = time.perf_counter()
                self.model_logits(1, input_ids=feed, cache=kv)
                self._synchronize()
                ms = (time.perf_counter() - started) * 1e3
                best[n] = min(ms, best.get(n, ms))
                spent += ms / 1e3
                at += n
            if spent >= self.PROBE_BUDGET_S:
                break
            kv.crop(self.PROBE_CONTEXT - kv.get_seq_length())  # the next sweep: same positions
            at = self.PROBE_CONTEXT
        return self.seed_cost(best)

    PROBE_ROWS = (2, 4, 8, 16)
    PROBE_BATCH_BUDGET_S = 8.0  # no batch size starts after the batched probe took this long

    def probe_batches(self) -> dict[tuple[int, int], float]:
        """Time batched forwards of R rows (PROBE_ROWS up to --max-batch-size and
        --max-batch-tokens) of 1 token, 2 and the widest probe width up to 8, through the
        engine's own batched forward on scratch sessions of PROBE_CONTEXT tokens: they enter
        the cost curve's buckets as served forwards do, so a gateway prices a batch from
        the start. Read off the one-row line instead (rows x tokens a row), 8 rows of 4
        tokens came out at a third to a half of what they took on the paged engine (about
        440 against 555 to 1,350 ms on a 2-vCPU Zen 4), and every session drafted long
        into a verifier that was already computing all it could. The scratch sessions' prefills and a warm-up
        per batch size are not fitted. One sweep, smallest batch first, none started after
        PROBE_BATCH_BUDGET_S; tensor-parallel ranks do not run it (their forwards must
        match, which a time budget cannot promise). Returns ms by (rows, tokens a row)
        (model thread)."""
        cfg = self.config
        store = self.ready_store
        widths = [1, 2, max([n for n in self.probe_widths() if n <= 8] or [2])]
        widths = sorted(set(widths))
        sizes = [r for r in self.PROBE_ROWS if r <= cfg.max_batch_size]
        context = self.PROBE_CONTEXT
        sizes = [
            r
            for r in sizes
            if r * widths[-1] <= cfg.max_batch_tokens
            and r * (context + widths[-1]) <= cfg.max_cached_tokens
        ]
        if not sizes:
            return {}
        ids = self.probe_ids(context + widths[-1])
        names = [f"\x00probe-{i}" for i in range(max(sizes))]  # no client sends these
        measured: dict[tuple[int, int], float] = {}
        spent = 0.0
        self._probing = True  # not in the forward metrics (they count what was served)
        try:
            sessions = [store.acquire(name, 0, 0, context + widths[-1]) for name in names]
            per = max(1, cfg.max_batch_tokens // context)  # prefills within the bound too
            with self._untimed():
                for i in range(0, len(sessions), per):
                    group = sessions[i : i + per]
                    self._run_batch([self.probe_request(s, ids[:context], True) for s in group])
            for rows in sizes:
                if spent >= self.PROBE_BATCH_BUDGET_S:
                    break
                batch = sessions[:rows]
                for n in (0, *widths):  # 0: a warm-up of this batch size, not fitted
                    feed = ids[context : context + max(1, n)]
                    started = time.perf_counter()
                    with self._untimed() if n == 0 else nullcontext():
                        self._run_batch([self.probe_request(s, feed, False) for s in batch])
                    ms = (time.perf_counter() - started) * 1e3
                    spent += ms / 1e3
                    if n:
                        measured[(rows, n)] = ms
                    for session in batch:
                        store.truncate(session, context)
        finally:
            self._probing = False
            for name in names:
                store.release(name)
        self.load_window = LoadWindow(since=time.perf_counter())  # the probe is no load
        log.info(
            "batched forward cost probed",
            extra={
                "engine": cfg.kv_engine,
                "ms": {f"{r}x{n}": round(ms, 3) for (r, n), ms in sorted(measured.items())},
                "seconds": round(spent, 2),
            },
        )
        return measured

    def probe_request(
        self, session: SessionCache, tokens: list[int], fresh: bool
    ) -> ForwardRequest:
        """A probe's forward of `tokens` on a scratch session, its last logits kept."""
        return ForwardRequest(session, tokens, 1, fresh)

    @contextmanager
    def _untimed(self) -> Iterator[None]:
        """Forwards in this block are not fitted into the cost curve nor counted as load
        (a probe's warm-ups and scratch prefills)."""
        self._timing = False
        try:
            yield
        finally:
            self._timing = True

    def probe_ids(self, n: int) -> list[int]:
        """n token ids for a probe's forwards, spread over the vocabulary."""
        vocab = max(1, self.vocab_size)
        return [(7 * i + 3) % vocab for i in range(n)]

    def probe_widths(self) -> list[int]:
        """The widths the start-up probe times: PROBE_WIDTHS up to a verify of the longest
        draft, at least two."""
        widths = [n for n in self.PROBE_WIDTHS if n <= self.config.max_draft_tokens + 1] or [1]
        if len(widths) == 1:
            widths.append(2)
        return widths

    def seed_cost(self, best: dict[int, float]) -> Line:
        """The probe's fastest forward per width (ms by tokens): their line seeds the cost
        curve, and the log says so (model thread)."""
        points = sorted(best.items())
        line = self.cost.seed(points)
        self.cost_lines = self.cost.buckets()
        self.cost_points = self.cost.points()
        log.info(
            "forward cost probed",
            extra={
                "engine": self.config.kv_engine,
                "base_ms": round(line.base_ms, 3),
                "per_token_ms": round(line.per_token_ms, 3),
                "points_ms": {n: round(ms, 3) for n, ms in points},
            },
        )
        return line

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, tokens: int, rows: int, started: float, computed: int | None = None) -> None:
        """A forward of `tokens` tokens a row (its widest) over `rows` rows began at
        `started`: fit it. `computed`: the tokens it computed in all, where that is not
        rows x widest (a RAGGED engine's forward)."""
        self._synchronize()
        if not self._timing:
            return
        ended = time.perf_counter()
        self.load_window.add(ended, ended - started, rows, tokens, computed)
        if self.RAGGED:
            self.cost.add(computed if computed is not None else rows * tokens, 1, ended - started)
        else:
            self.cost.add(tokens, rows, ended - started)
        self.cost_lines = self.cost.buckets()
        self.cost_points = self.cost.points()

    def new_store(self, engine: str) -> TransformersStore[SessionCache]:
        """An empty store of the engine (--engine) for the loaded model."""
        cfg = self.config
        if engine == "paged":
            # Blocks for the token bound, and one partial block for each of 64 sessions.
            blocks = cfg.max_cached_tokens // cfg.kv_block_size + 64
            pool = BlockPool(self.model.config.num_hidden_layers, cfg.kv_block_size, blocks)
            return PagedStore(cfg.max_cached_tokens, pool)
        return CacheStore(cfg.max_cached_tokens, self._new_cache)

    def _new_cache(self) -> DynamicCache:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @property
    def ready_store(self) -> TransformersStore[SessionCache]:
        """The sessions' caches (NotReady while the model loads)."""
        if self.store is None:
            raise NotReady("model is still loading")
        return self.store

    @property
    def dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.") if self.model is not None else ""

    # -- execution ----------------------------------------------------------------------

    @overload
    async def run(
        self,
        fn: Callable[..., Generator[Any, Any, T]],
        *args: Any,
        bounded: bool = True,
        session: str | None = None,
    ) -> T: ...

    @overload
    async def run(
        self, fn: Callable[..., T], *args: Any, bounded: bool = True, session: str | None = None
    ) -> T: ...

    async def run(
        self, fn: Callable[..., Any], *args: Any, bounded: bool = True, session: str | None = None
    ) -> Any:
        """Run fn(*args) on the model thread, in a copy of the caller's context (its trace),
        counted in the replica's queue metrics. fn may be a job (a generator yielding
        ForwardRequests, see `forward_steps`): its forwards are batched with other jobs'.
        session: the session the call works on; its calls run one at a time, in order.

        bounded: a request for the model (Draft, Verify, Speculate), see `submit`.
        Housekeeping calls (load, Info, Release) pass bounded=False: never refused, and not
        counted.
        """
        if not bounded:
            return await self.obs.run(self.scheduler, fn, *args, key=session)
        return await asyncio.wrap_future(self.submit(fn, *args, session=session))

    def submit(self, fn: Callable[..., T], *args: Any, session: str | None = None) -> Future[Any]:
        """A request for the model, without waiting for it (any thread; the data plane
        submits from the model thread itself): the job's future. When max_queue requests
        already wait behind the running one, raise ReplicaBusy (RESOURCE_EXHAUSTED) at once
        instead of queueing: the gateway tries a less loaded replica."""
        limit = self.config.max_queue
        with self._pending_lock:
            if self.pending > limit:
                raise ReplicaBusy(
                    f"{BUSY_PREFIX}: {self.pending - 1} requests queued for the model "
                    f"(at most {limit} wait, --max-queue)"
                )
            self.pending += 1
        # The count drops when the job ends on the model thread (or is cancelled before it
        # started), not when a cancelled caller stops waiting for a job that still runs.
        return self.obs.submit(self.scheduler, fn, *args, on_done=self._finished, key=session)

    def _finished(self, _future: Future[Any] | None) -> None:
        with self._pending_lock:
            self.pending -= 1

    def shutdown(self) -> None:
        self.scheduler.shutdown()

    # -- validation (event loop, cheap) -------------------------------------------------

    def validate_tokens(self, what: str, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"{what} holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
            )

    def validate_extent(self, prefix: Prefix, new_tokens: Sequence[int], extra: int) -> None:
        """new_tokens non-empty, ids in range, prefix + new + extra within the context."""
        if not new_tokens:
            raise InvalidRequest("new_tokens is empty: a request must carry at least one token")
        self.validate_tokens("new_tokens", new_tokens)
        total = prefix.length + len(new_tokens) + extra
        if total > self.max_context:
            raise InvalidRequest(
                f"sequence of {total} tokens (prefix {prefix.length} + new {len(new_tokens)} "
                f"+ draft {extra}) exceeds the model's context of {self.max_context}"
            )

    def feature_ask(self, msg: common_pb2.FeatureRequest) -> FeatureAsk:
        """A request's FeatureRequest (common_pb2) for this model, validated: its layers
        within the model's decoder layers, a known format (InvalidRequest otherwise);
        Unimplemented on a tensor-parallel model (its ranks' forwards are replayed, not
        read)."""
        if self.config.tensor_parallel > 1:
            raise Unimplemented(
                "features (the target's hidden states) are not built for --tensor-parallel "
                "> 1 yet; run the verifier on one device"
            )
        return ask_from_proto(msg, int(self.model.config.num_hidden_layers))

    # -- model calls (model thread only) ------------------------------------------------

    def extend(
        self,
        session_id: str,
        prefix: Prefix,
        new_tokens: Sequence[int],
        grow_by: int,
        keep: int | None = None,
    ) -> tuple[SessionCache, torch.Tensor]:
        """Crop the session to `prefix`, run new_tokens through the model.

        grow_by: tokens this request may add in total (new tokens + later feeds), reserved
        in the cache bound. Returns the session and the logits of the last `keep` tokens
        [keep, vocab] fp32 (all of them when None). Call inside `guarded(session_id)`.
        """
        assert self.store is not None
        session = self.store.acquire(session_id, prefix.length, prefix.hash, grow_by)
        return session, self.forward(session, new_tokens, keep)

    @contextmanager
    def guarded(self, session_id: str) -> Iterator[None]:
        """Drop the session if the block fails after touching its cache.

        A forward that fails half-way (out of memory, say) can leave some layers one
        token longer than the session's tokens; such a cache would pass the prefix check
        and silently hurt acceptance. The caller gets the error; the next request misses
        and resends the full context. Cache misses and capacity errors leave it alone.
        """
        assert self.store is not None
        try:
            with self.store.held(session_id):
                yield
        except (CacheMiss, CapacityExceeded, InvalidRequest):
            raise
        except BaseException:
            self.store.release(session_id)
            raise

    def forward(
        self, session: SessionCache, tokens: Sequence[int], keep: int | None = None
    ) -> torch.Tensor:
        """`forward_steps` run here and now, unbatched (model thread)."""
        return self.drive(self.forward_steps(session, tokens, keep))

    def drive(self, job: Generator[ModelRequest, torch.Tensor, T]) -> T:
        """Run a job here and now, each forward unbatched (the model thread, or a tool
        that owns the runtime)."""
        try:
            request = next(job)
            while True:
                try:
                    logits = self._run_batch([request])[0]
                except BaseException as e:  # the job sees its forward fail (guarded)
                    request = job.throw(e)
                    continue
                request = job.send(logits)
        except StopIteration as stop:
            result: T = stop.value  # the job's return value
            return result

    def forward_steps(
        self,
        session: SessionCache,
        tokens: Sequence[int] | torch.Tensor,
        keep: int | None = None,
        tree: Sequence[int] | None = None,
        features: FeatureSink | None = None,
        inputs: torch.Tensor | None = None,
    ) -> Generator[ForwardRequest, torch.Tensor, torch.Tensor]:
        """Append tokens (a list, or a device tensor [n] of tokens drawn there) to the
        session's cache; the logits of the last `keep` of them [keep, vocab] fp32 (all when
        None). A job's forwards: `yield from` it in a job
        run by `run` (batched with other sessions'), or call `forward`.

        Only the kept rows are computed (a full-vocabulary row per prompt token is about
        0.9 MB in bf16 for a 152k vocabulary, plus its fp32 copy). An input longer than
        --prefill-chunk is fed in chunks of that many tokens, so the activations of a long
        prompt never exceed one chunk's; the last chunk holds at least the kept rows.

        tree: the parents of the last len(tree) tokens, a token tree (`_forward_tree`); the
        last chunk holds all of it.

        features: every token's features go there, in order (specdec.replica.features:
        the asked decoder layers' outputs [len(tokens), width]). inputs [len(tokens),
        width]: a head drafter's input feature of each token (specdec.drafter.head).
        """
        if not isinstance(tokens, torch.Tensor):  # a device tensor [n] is fed as it is
            tokens = list(tokens)
        keep = len(tokens) if keep is None else max(1, min(keep, len(tokens)))
        fresh = not session.tokens  # a prefill (metrics and spans), in however many chunks
        chunk = self.config.prefill_chunk
        start = 0
        tail = len(tree) if tree else 0
        if chunk and len(tokens) > chunk:
            head = len(tokens) - max(chunk, keep, tail)  # fed before the last forward
            while start < head:
                end = min(start + chunk, head)
                part = inputs[start:end] if inputs is not None else None
                yield ForwardRequest(session, tokens[start:end], 1, fresh, None, features, part)
                start = end
        last = ForwardRequest(
            session,
            tokens[start:],
            keep,
            fresh,
            list(tree) if tree else None,
            features,
            inputs[start:] if inputs is not None else None,
        )
        return (yield last)

    def _run_batch(self, requests: list[ModelRequest]) -> list[torch.Tensor]:
        """One forward over the requests (the scheduler's run_batch), `_forward_requests`;
        where a request asks for features (ForwardRequest.features) the asked decoder
        layers' outputs are recorded during it (specdec.replica.features.recording) and
        each asking request's rows appended to its sink."""
        asked = [r.features for r in requests if r.features is not None]
        if not asked:
            return self._forward_requests(requests)
        layers = {i for sink in asked for i in sink.layers}
        with recording(self.model, sorted(layers)) as outputs:
            results = self._forward_requests(requests)
        row = 0
        for r in requests:  # a session's request is a row, a branch step one per branch
            if r.features is not None:
                # [n, hidden] each: a row's fed tokens, or each branch row's one token
                parts = (
                    [outputs[i][row, : len(r.tokens)] for i in r.features.layers]
                    if isinstance(r, ForwardRequest)
                    else [outputs[i][row : row + r.rows, 0] for i in r.features.layers]
                )
                r.features.add(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))
            row += r.rows
        return results

    def _forward_requests(self, requests: list[ModelRequest]) -> list[torch.Tensor]:
        """One forward over the requests. One session's request
        alone runs on its own cache where the store allows it (own_cache_forward: the
        dense engine), a token tree's too (`_forward_tree`); otherwise the rows are laid out
        on the store's batch cache (`_forward_batch`), a tree's row under its tree mask
        (Layout.inputs)."""
        if self.compiled is not None and self._compiles(requests):
            return self._forward_batch(requests, compiled=True)
        alone = requests[0]
        if (
            len(requests) == 1
            and isinstance(alone, ForwardRequest)
            and self.ready_store.own_cache_forward
        ):
            return [self._forward_tree(alone) if alone.tree else self._forward(alone)]
        return self._forward_batch(requests)

    @torch.inference_mode()
    def _forward_tree(self, request: ForwardRequest) -> torch.Tensor:
        """One session's forward over h plain tokens then a token tree of m nodes, on its
        own cache: each node attends to the cache, the plain tokens and its ancestors
        (a 4D additive mask), at position cached + h + its depth. The cache then holds
        every node's keys/values after the plain tokens, in node order; the caller keeps
        one path (SessionStore.keep_path)."""
        session, tokens, parents = request.session, list(request.tokens), request.tree
        assert parents is not None
        cached, n, m = len(session.tokens), len(tokens), len(parents)
        h = n - m
        sees, depth = tree_visibility(n, parents)  # query i may attend input j
        visible = torch.cat([torch.ones(n, cached, dtype=torch.bool), sees], dim=1)
        dtype = self.model.dtype
        mask = torch.zeros(1, 1, n, cached + n, dtype=dtype)
        mask.masked_fill_(~visible[None, None], torch.finfo(dtype).min)
        positions = torch.tensor(
            [[*range(cached, cached + h), *(cached + h + d for d in depth)]], dtype=torch.long
        )
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        started = time.perf_counter()
        with self.obs.forward(n, 1, fresh=request.fresh):
            logits = self.model_logits(
                request.keep,
                input_ids=input_ids,
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                cache=session.kv,
            )
        session.append(tokens)
        self._timed(n, 1, started)
        return logits[0].float()  # [keep, vocab]

    @torch.inference_mode()
    def _forward(self, request: ForwardRequest) -> torch.Tensor:
        """One session's forward on its own cache (no padding, no copy)."""
        session, tokens, keep = request.session, request.tokens, request.keep
        if isinstance(tokens, torch.Tensor):  # tokens drawn on the device: no copy
            input_ids = tokens.view(1, -1)  # [1, n]
        else:
            input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        started = time.perf_counter()
        with self.obs.forward(len(tokens), 1, fresh=request.fresh):
            logits = self.model_logits(keep, input_ids=input_ids, cache=session.kv)
        session.append(tokens)
        logits = logits[0].float()  # [keep, vocab]
        self._timed(len(tokens), 1, started)
        return logits

    def model_logits(self, keep: int, **inputs: Any) -> torch.Tensor:
        """One forward of the model over `inputs` (input_ids [batch, n], cache,
        optionally attention_mask and position_ids), updating the cache it is given; the
        logits of the last `keep` positions [batch, keep, vocab].

        Only those rows are computed: the model's own output layer with logits_to_keep, or,
        with the drafter's reduced head, the base model's last hidden states [batch, keep,
        hidden] times the head's rows (fp32, -inf outside its subset).
        """
        if self.head is None:
            kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
            logits: torch.Tensor = self.model(**inputs, use_cache=True, **kwargs).logits
            return logits[:, -keep:]
        base = self.model.get_decoder()
        hidden = base(**inputs, use_cache=True).last_hidden_state[:, -keep:]  # [b, keep, hidden]
        return self.head(hidden)  # [b, keep, vocab]

    @torch.inference_mode()
    def _forward_batch(
        self, requests: list[ModelRequest], compiled: bool = False
    ) -> list[torch.Tensor]:
        """One forward over several sessions' caches and branch groups, padded
        (specdec.replica.batching), or read in place from their blocks (the paged engine,
        specdec.replica.paged); each request's logits. compiled: the padded layout with its
        inputs padded to a bucket, through the compiled decoder (specdec.replica.compiled)."""
        if compiled:
            assert self.compiled is not None
            layout = Layout(
                requests,
                columns=self.compiled.bucket(max(r.width for r in requests)),
                width_multiple=self.compiled.width_multiple,
            )
        else:
            layout = Layout(requests)
        # [R, N], [R, L + N] (with a tree: [R, 1, N, L + N]), [R, N]
        input_ids, mask, positions = layout.inputs(self.device, self.model.dtype)
        store = self.ready_store
        cache = store.batch_cache(layout, self.model.config)
        inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache)
        if (
            not compiled
            and len(requests) == 1
            and isinstance(requests[0], ForwardRequest)
            and not layout.trees
        ):
            del inputs["attention_mask"]  # one row, no pads (the paged engine): plain causal
        fresh = all(r.fresh for r in requests)
        started = time.perf_counter()
        observed = (
            nullcontext()
            if self._probing
            else self.obs.forward(layout.tokens, layout.rows, fresh, sessions=len(requests))
        )
        with observed:
            if not compiled and len(requests) == 1 and isinstance(requests[0], BranchStep):
                # One branch group alone (always so under --max-batch-size 1): the model's
                # own forward and output layer, as before batching.
                logits = self.model_logits(1, **inputs)[:, -1].float()  # [rows, vocab]
            else:
                if compiled:
                    assert self.compiled is not None
                    hidden = self.compiled(**inputs)  # [R, bucket, hidden]
                else:
                    hidden = self.model.get_decoder()(
                        **inputs, use_cache=True
                    ).last_hidden_state  # [R, N, hidden]
                # the drafter's reduced head, if any, else the model's own output layer
                head = self.head or self.model.get_output_embeddings()
                logits = head(layout.kept(hidden)).float()  # [sum keeps, vocab]
        store.after_batch(cache, layout)
        self._timed(layout.longest, layout.rows, started)
        return layout.split(logits)

    def _compiles(self, requests: list[ModelRequest]) -> bool:
        """Whether the forward over these requests runs compiled: no token tree and no
        features asked (their hooks are eager), every row short, after a cache of at least
        2 slots (Compiled.takes)."""
        assert self.compiled is not None
        if any(isinstance(r, ForwardRequest) and (r.tree or r.features) for r in requests):
            return False
        layout = Layout(requests)
        return self.compiled.takes(layout.longest, layout.width)

    def compile(self) -> None:
        """--compile: compile the decoder (specdec.replica.compiled) and every shape it will
        run now, on scratch sessions: each bucket for one row, and for several (a drafter's
        branch rows, or batches under --max-batch-size > 1). A machine that cannot compile
        fails at start-up, and no request waits for a compile later (model thread)."""
        cfg = self.config
        if cfg.kv_engine != "dense":
            raise ValueError(
                f"--compile runs on --engine dense; the paged engine's forward is not compiled "
                f"(got --engine {cfg.engine})"
            )
        assert self.store is not None
        compiled = self.compiled = Compiled(self.model, self.device, cfg.max_draft_tokens + 1)
        several = cfg.max_batch_size > 1 or cfg.role == "drafter"
        names = ["\x00compile-0", "\x00compile-1"]  # not ids a client can send (printable)
        ids = [i % max(1, self.vocab_size) for i in range(2 + compiled.top)]
        try:
            sessions = []
            for name in names[: 2 if several else 1]:
                sessions.append(self.store.acquire(name, 0, 0, len(ids)))
                self.forward(sessions[-1], ids[:2])  # eager: a fresh session
            for bucket in compiled.buckets:
                for rows in (1, 2)[: len(sessions)]:
                    feed = ids[2 : 2 + bucket]
                    self._run_batch([ForwardRequest(s, feed, 1, False) for s in sessions[:rows]])
                    for session in sessions[:rows]:
                        self.store.truncate(session, 2)
        finally:
            for name in names:
                self.store.release(name)
        log.info(
            "forwards compiled",
            extra={
                "buckets": list(compiled.buckets),
                "rows": "1 and 2+" if several else "1",
                "mode": compiled.mode or "default",
                "seconds": round(compiled.seconds, 2),
            },
        )

    def _note_member(self, request: ModelRequest, batch: int) -> None:
        """A job's share of a batched forward observed in another job's context."""
        self.obs.member(len(request.tokens), batch)

    def release(self, session_id: str) -> bool:
        assert self.store is not None
        return self.store.release(session_id)
