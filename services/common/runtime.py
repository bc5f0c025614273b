"""Model runtime shared by the drafter and the verifier.

Loads a causal LM through ``AutoModelForCausalLM.from_pretrained`` (directory, hub id, or a
GGUF file), keeps one KV cache per session with the tokens it covers, rolls rejected
positions back, bounds the total cached tokens with least-recently-used eviction, and runs
every forward in one dedicated thread so the event loop never blocks.

Threading rule: everything that touches the model or a ``SessionCache`` runs on the model
thread (``ModelRuntime.scheduler``, specdec.common.batching), so sessions need no locks;
the event loop only validates requests and awaits ``ModelRuntime.run``. A model call is a
job that yields its forwards (`forward_steps`); the scheduler batches the forwards of
concurrent jobs of different sessions into one (see specdec.common.batching).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from specdec.common.batching import BranchStep, ForwardRequest, Layout, Request, Scheduler
from specdec.common.config import ReplicaConfig
from specdec.common.cpus import thread_budget
from specdec.common.errors import (
    BUSY_PREFIX,
    CACHE_MISS_PREFIX,
    CacheMiss,
    CapacityExceeded,
    InvalidRequest,
    ReplicaBusy,
)
from specdec.common.metrics import ReplicaObserver, note_cache, note_eviction, note_rollback
from specdec.common.prefix import PrefixChain
from specdec.common.quantize import quantize_model

log = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SessionCache:
    """KV cache of one session and the tokens it covers (len(tokens) == cache length)."""

    tokens: list[int]
    kv: object  # transformers DynamicCache
    last_used: float = field(default_factory=time.monotonic)
    # Block hashes of tokens' prefixes (cropped with tokens): prefix checks cost O(new).
    chain: PrefixChain = field(default_factory=PrefixChain)


class CacheStore:
    """Per-session KV caches with a bound on total cached tokens and LRU eviction.

    Only ever used from the runtime's executor thread.
    """

    def __init__(self, max_cached_tokens: int, new_cache: Callable[[], object]):
        self.max_cached_tokens = max_cached_tokens
        self._new_cache = new_cache
        self._sessions: OrderedDict[str, SessionCache] = OrderedDict()

    @property
    def cached_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def tokens(self, session_id: str) -> list[int] | None:
        s = self._sessions.get(session_id)
        return None if s is None else list(s.tokens)

    def acquire(
        self, session_id: str, prefix_len: int, prefix_hash_: int, grow_by: int
    ) -> SessionCache:
        """The session's cache cropped to the named prefix, with room for grow_by more tokens.

        Raises CacheMiss when the cache does not start with that prefix (a fresh cache is
        made for prefix_len 0), CapacityExceeded when prefix_len + grow_by exceeds the bound.
        """
        need = prefix_len + grow_by
        if need > self.max_cached_tokens:
            raise CapacityExceeded(
                f"session needs {need} cached tokens, this replica holds at most "
                f"{self.max_cached_tokens} (--max-cached-tokens)"
            )
        session = self._sessions.get(session_id)
        if prefix_len == 0:
            if session is None or session.tokens:
                session = SessionCache(tokens=[], kv=self._new_cache())
                self._sessions[session_id] = session
        else:
            if session is None:
                raise CacheMiss(f"{CACHE_MISS_PREFIX}: session {session_id!r} is not cached here")
            if len(session.tokens) < prefix_len:
                raise CacheMiss(
                    f"{CACHE_MISS_PREFIX}: session {session_id!r} holds {len(session.tokens)} "
                    f"tokens, request builds on {prefix_len}"
                )
            if session.chain.hash(session.tokens, prefix_len) != prefix_hash_:
                raise CacheMiss(
                    f"{CACHE_MISS_PREFIX}: session {session_id!r} holds different tokens in its "
                    f"first {prefix_len}"
                )
            self.truncate(session, prefix_len)
        note_cache(prefix_len)
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        self._make_room(session_id, need)
        return session

    @staticmethod
    def truncate(session: SessionCache, length: int) -> None:
        """Roll the session back to its first `length` tokens."""
        drop = len(session.tokens) - length
        if drop > 0:
            session.kv.crop(-drop)
            del session.tokens[length:]
            session.chain.crop(length)
            note_rollback(drop)

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def _make_room(self, keep: str, need: int) -> None:
        """Evict least recently used sessions (never `keep`) until `need` more tokens fit."""
        total = self.cached_tokens - len(self._sessions[keep].tokens) + need
        while total > self.max_cached_tokens:
            victim_id = next(iter(self._sessions))
            if victim_id == keep:  # only `keep` is left; the bound check above makes this rare
                break
            victim = self._sessions.pop(victim_id)
            total -= len(victim.tokens)
            note_eviction(len(victim.tokens))
            log.info(
                "evicted session cache",
                extra={"session_id": victim_id, "tokens": len(victim.tokens)},
            )


@dataclass(frozen=True)
class Prefix:
    length: int
    hash: int


class ModelRuntime:
    """A causal LM with per-session KV caches, driven from one model thread."""

    def __init__(self, config: ReplicaConfig):
        self.config = config
        self.scheduler = Scheduler(
            f"{config.role}-model",
            config.max_batch_size,
            config.max_batch_tokens,
            run_batch=self._run_batch,
            note_member=self._note_member,
        )
        # Model requests submitted and not finished (the running one included), and the
        # lock that guards the count: bounded by config.max_queue (backpressure, `run`).
        self.pending = 0
        self._pending_lock = threading.Lock()
        self.model = None
        self.device = torch.device(config.device)
        self.vocab_size = 0
        self.max_context = 0
        self.eos_token_ids: list[int] = []
        self.bos_token_id: int = -1
        self.tokenizer_json = b""
        self.tokenizer_fingerprint = ""
        self.chat_template = ""
        self.special_tokens: dict[str, str] = {}  # bos_token, eos_token, ... (chat templates)
        self.quantize = "none"  # the drafter's --quantize, as applied to the loaded model
        self.store: CacheStore | None = None
        self.obs = ReplicaObserver(self)  # metrics and spans (specdec.common.metrics)
        self._keeps_logits = False  # the model's forward takes logits_to_keep
        # The drafter's reduced output layer (specdec.drafter.vocab.ReducedHead): hidden
        # states [..., hidden] -> fp32 logits [..., vocab], -inf outside its subset. None:
        # the model's own output layer (the verifier always).
        self.head: Callable[[torch.Tensor], torch.Tensor] | None = None

    # -- loading ------------------------------------------------------------------------

    def load(self) -> None:
        """Load model and tokenizer (blocking; call on the model thread)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.config
        _set_threads(cfg.threads)
        started = time.monotonic()
        kwargs: dict = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        if cfg.trust_remote_code:
            kwargs["trust_remote_code"] = True
        dtype = "auto" if cfg.dtype == "auto" else _DTYPES[cfg.dtype]
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, **kwargs)
        model.to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, **kwargs)
        # The output head's rows, read before quantization turns its weight into packed int8.
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # Only a DrafterConfig has `quantize` (--quantize): the verifier's model stays as
        # loaded, so the target's distributions are the model's own.
        self.quantize = getattr(cfg, "quantize", "none")
        model = quantize_model(model, self.quantize)
        self.model = model
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.max_context = int(
            getattr(model.config, "max_position_embeddings", 0) or cfg.max_context or 0
        )
        if cfg.max_context:
            self.max_context = min(self.max_context or cfg.max_context, cfg.max_context)
        if self.max_context <= 0:
            raise ValueError(
                f"cannot tell the model's context length; set --max-context for {cfg.model}"
            )
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.bos_token_id = -1 if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        self.chat_template = tokenizer.chat_template or ""
        self.special_tokens = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
        canonical = _canonical_tokenizer_json(tokenizer)
        self.tokenizer_json = zlib.compress(canonical, 6)
        self.tokenizer_fingerprint = hashlib.sha256(canonical).hexdigest()
        _check_rollback(self._new_cache(), cfg.model)
        if cfg.max_batch_size > 1:
            _check_batchable(model, cfg.model)
        self.store = CacheStore(cfg.max_cached_tokens, self._new_cache)
        log.info(
            "model loaded",
            extra={
                "model": cfg.model,
                "dtype": str(model.dtype),
                "quantize": self.quantize,
                "device": str(self.device),
                "vocab_size": self.vocab_size,
                "max_context": self.max_context,
                "seconds": round(time.monotonic() - started, 2),
            },
        )

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @property
    def dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.") if self.model is not None else ""

    # -- execution ----------------------------------------------------------------------

    async def run(
        self, fn: Callable[..., T], *args, bounded: bool = True, session: str | None = None
    ) -> T:
        """Run fn(*args) on the model thread, in a copy of the caller's context (its trace),
        counted in the replica's queue metrics. fn may be a job (a generator yielding
        ForwardRequests, see `forward_steps`): its forwards are batched with other jobs'.
        session: the session the call works on; its calls run one at a time, in order.

        bounded: a request for the model (Draft, Verify, Speculate). When max_queue of them
        already wait behind the running one, raise ReplicaBusy (RESOURCE_EXHAUSTED) at once
        instead of queueing: the gateway tries a less loaded replica. Housekeeping calls
        (load, Info, Release) pass bounded=False: never refused, and not counted.
        """
        if not bounded:
            return await self.obs.run(self.scheduler, fn, *args, key=session)
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
        return await self.obs.run(self.scheduler, fn, *args, on_done=self._finished, key=session)

    def _finished(self, _future) -> None:
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
    def guarded(self, session_id: str):
        """Drop the session if the block fails after touching its cache.

        A forward that fails half-way (out of memory, say) can leave some layers one
        token longer than the session's tokens; such a cache would pass the prefix check
        and silently hurt acceptance. The caller gets the error; the next request misses
        and resends the full context. Cache misses and capacity errors leave it alone.
        """
        try:
            yield
        except (CacheMiss, CapacityExceeded, InvalidRequest):
            raise
        except BaseException:
            assert self.store is not None
            self.store.release(session_id)
            raise

    def forward(
        self, session: SessionCache, tokens: Sequence[int], keep: int | None = None
    ) -> torch.Tensor:
        """`forward_steps` run here and now, unbatched (model thread)."""
        return self.drive(self.forward_steps(session, tokens, keep))

    def drive(self, job: Generator[Request, torch.Tensor, T]) -> T:
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
            return stop.value

    def forward_steps(
        self, session: SessionCache, tokens: Sequence[int], keep: int | None = None
    ) -> Generator[ForwardRequest, torch.Tensor, torch.Tensor]:
        """Append tokens to the session's cache; the logits of the last `keep` of them
        [keep, vocab] fp32 (all when None). A job's forwards: `yield from` it in a job
        run by `run` (batched with other sessions'), or call `forward`.

        Only the kept rows are computed (a full-vocabulary row per prompt token is about
        0.9 MB in bf16 for a 152k vocabulary, plus its fp32 copy). An input longer than
        --prefill-chunk is fed in chunks of that many tokens, so the activations of a long
        prompt never exceed one chunk's; the last chunk holds at least the kept rows.
        """
        tokens = list(tokens)
        keep = len(tokens) if keep is None else max(1, min(keep, len(tokens)))
        fresh = not session.tokens  # a prefill (metrics and spans), in however many chunks
        chunk = self.config.prefill_chunk
        start = 0
        if chunk and len(tokens) > chunk:
            head = len(tokens) - max(chunk, keep)  # fed before the last forward
            while start < head:
                end = min(start + chunk, head)
                yield ForwardRequest(session, tokens[start:end], 1, fresh)
                start = end
        return (yield ForwardRequest(session, tokens[start:], keep, fresh))

    def _run_batch(self, requests: list[Request]) -> list[torch.Tensor]:
        """One forward over the requests (the scheduler's run_batch)."""
        if len(requests) == 1 and isinstance(requests[0], ForwardRequest):
            return [self._forward(requests[0])]
        return self._forward_batch(requests)

    @torch.inference_mode()
    def _forward(self, request: ForwardRequest) -> torch.Tensor:
        """One session's forward on its own cache (no padding, no copy)."""
        session, tokens, keep = request.session, request.tokens, request.keep
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        with self.obs.forward(len(tokens), 1, fresh=request.fresh):
            logits = self.model_logits(keep, input_ids=input_ids, past_key_values=session.kv)
        session.tokens.extend(tokens)
        return logits[0].float()  # [keep, vocab]

    def model_logits(self, keep: int, **inputs) -> torch.Tensor:
        """One forward of the model over `inputs` (input_ids [batch, n], past_key_values,
        optionally attention_mask and position_ids), updating the cache it is given; the
        logits of the last `keep` positions [batch, keep, vocab].

        Only those rows are computed: the model's own output layer with logits_to_keep, or,
        with the drafter's reduced head, the base model's last hidden states [batch, keep,
        hidden] times the head's rows (fp32, -inf outside its subset).
        """
        if self.head is None:
            kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
            return self.model(**inputs, use_cache=True, **kwargs).logits[:, -keep:]
        base = self.model.get_decoder()
        hidden = base(**inputs, use_cache=True).last_hidden_state[:, -keep:]  # [b, keep, hidden]
        return self.head(hidden)  # [b, keep, vocab]

    @torch.inference_mode()
    def _forward_batch(self, requests: list[Request]) -> list[torch.Tensor]:
        """One forward over several sessions' caches and branch groups, padded
        (specdec.common.batching); each request's logits."""
        layout = Layout(requests)
        input_ids, mask, positions = layout.inputs(self.device)  # [R, N], [R, L + N], [R, N]
        cache = layout.cache(self.model.config)
        inputs = dict(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache
        )
        fresh = all(r.fresh for r in requests)
        with self.obs.forward(layout.tokens, layout.rows, fresh, sessions=len(requests)):
            if len(requests) == 1 and isinstance(requests[0], BranchStep):
                # One branch group alone (always so under --max-batch-size 1): the model's
                # own forward and output layer, as before batching.
                logits = self.model_logits(1, **inputs)[:, -1].float()  # [rows, vocab]
            else:
                hidden = self.model.get_decoder()(
                    **inputs, use_cache=True
                ).last_hidden_state  # [R, N, hidden]
                # the drafter's reduced head, if any, else the model's own output layer
                head = self.head or self.model.get_output_embeddings()
                logits = head(layout.kept(hidden)).float()  # [sum keeps, vocab]
        layout.write_back(cache)
        return layout.split(logits)

    def _note_member(self, request: Request, batch: int) -> None:
        """A job's share of a batched forward observed in another job's context."""
        self.obs.member(len(request.tokens), batch)

    def release(self, session_id: str) -> bool:
        assert self.store is not None
        return self.store.release(session_id)


def _set_threads(requested: int) -> None:
    """Size torch's intra-op pool to the CPUs this replica may use (--threads wins), and keep
    the inter-op pool small: forwards run one at a time on the model thread."""
    budget = thread_budget(requested)
    torch.set_num_threads(budget.threads)
    interop = min(2, budget.threads)
    try:
        torch.set_num_interop_threads(interop)
    except RuntimeError as e:  # only possible once per process, before parallel work
        log.warning("inter-op threads not set", extra={"why": str(e)})
        interop = torch.get_num_interop_threads()
    log.info(
        "torch threads",
        extra={"threads": budget.threads, "interop_threads": interop, "source": budget.source},
    )


def _eos_ids(model, tokenizer) -> list[int]:
    """The tokens at which `generate()` stops: the generation config's EOS, else the model
    config's, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            return [eos]
        if eos:
            return sorted({int(e) for e in eos})
    return []


def _check_rollback(cache, model: str) -> None:
    """Refuse models whose KV cache cannot be rolled back exactly."""
    if any(getattr(cache, "is_sliding", [])):
        raise ValueError(
            f"{model} uses sliding-window attention; rolling back rejected draft tokens in "
            "its cache is not exact with this transformers version, so specdec refuses it"
        )
    if not getattr(cache, "is_croppable", True):
        raise ValueError(
            f"{model} has cache layers that cannot be cropped (recurrent or linear "
            "attention); speculative decoding needs to roll back rejected tokens"
        )


def _check_batchable(model, name: str) -> None:
    """Batched forwards run the model's decoder, then its output head on the kept rows:
    refuse models whose causal-LM head does more than that."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(
            f"{name} caps its logits (final_logit_softcapping); batching across sessions "
            "does not apply that; run it with --max-batch-size 1"
        )
    try:
        model.get_decoder()
    except (AttributeError, ValueError) as e:
        raise ValueError(
            f"{name}: cannot find the decoder of {type(model).__name__} ({e}); batching "
            "across sessions needs it; run it with --max-batch-size 1"
        ) from None


def _canonical_tokenizer_json(tokenizer) -> bytes:
    """The tokenizer as canonical JSON (sorted keys), from its fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no fast (tokenizers) backend; "
            "specdec needs a fast tokenizer so the torch-free gateway can use it"
        )
    return json.dumps(json.loads(backend.to_str()), sort_keys=True, separators=(",", ":")).encode()
