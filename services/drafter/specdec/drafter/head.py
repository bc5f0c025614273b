"""A head drafter (`specdec serve drafter --head PATH`): EAGLE-1-style drafting from the
target's own features (docs/concepts/heads.md).

The head is one decoder layer of the target's architecture (transformers' own class for
the model type, with its own rotary embedding and KV cache), an input projection `fc` of
[feature, token embedding] (2 x hidden -> hidden), and the target's embedding, final norm
and output matrix. It is built as a one-layer causal LM of the target's architecture
whose input embedding is replaced by `FeatureEmbedding`, so the replica engine's stores
(dense or paged), batching and prefill chunks run it as any model.

The convention (what a trained head must follow). The head's entry at sequence position j
is fc([f(j - 1), e(t_j)]): f(j - 1) the target's feature at the position before (the last
decoder layer's output, before the final norm: specdec.replica.features), e(t_j) the
target's embedding of token j; position 0 has no position before it and reads a zero
feature. Its decoder layer's output at j (before the final norm) is its prediction of
f(j); the target's final norm and output matrix turn it into the distribution of token
j + 1. A draft step feeds the drawn token with the head's own prediction as its feature.

A head folder: config.json (the target's transformers config, num_hidden_layers 1, and a
"specdec_head" object: "feature_layers" [the target's layer], "feature_format", optionally
"target", the folder to read the shared matrices from), and model.safetensors (the layer
under the one-layer model's names, `fc.weight` [hidden, 2 x hidden] and optionally
`fc.bias`, and the embedding, final norm and output matrix unless they are read from the
target: "target" if set, else --model). `write_head` writes one.

Per session the runtime keeps, beside the session's KV (`HeadState`): the target features
received and not yet consumed, and which positions were fed with something else (the
head's own prediction, or zeros where the target's never arrived). A Draft first rolls the
session back to the first such position whose target feature has now arrived and feeds
from there again with the target's features (EAGLE's refresh of the accepted tokens),
then drafts k tokens. `propose_head` is that job: the head engine's own, so it names the
engine (the model drafter's jobs use the seam only).

A Draft may ask for a token tree (tree_nodes): the head's likeliest alternatives to its
draft tokens as leaves, read from the rows the chain was drawn from, the best continued
by tree_depth tokens as branch rows (the model drafter's `grow_tree`): a leaf at position
p is fed the feature the draft token there was fed, and each token after it the head's
own output at the token before. SSD (`HeadSpeculateCall`): the Draft keeps its rows and
the features it fed (DraftRows.feeds); the Speculate feeds the draft's last token with the
head's own output, and each outcome's branch row is fed the feature its position would
get; a Draft an outcome prepared is served without a forward (its features are kept for
the next feed).
"""

from __future__ import annotations

import bisect
import json
import logging
import time
import weakref
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.common.settings import ConfigError, env_name
from specdec.drafter.config import DrafterConfig
from specdec.drafter.proposer import DraftCall, DraftResult, grow_tree, tree_tops
from specdec.drafter.runtime import DrafterRuntime
from specdec.drafter.sampler import sampler_for
from specdec.drafter.speculate import DraftRows, SpeculateCall, take_prepared
from specdec.replica.batching import ForwardRequest, ModelRequest
from specdec.replica.features import FORMAT_NAMES, FeatureAsk, FeatureSink, decoder_layers
from specdec.replica.host import to_host
from specdec.replica.loading import (
    DTYPES,
    LoadedModel,
    check_batchable,
    load_facts,
    loaded_model,
    set_threads,
)
from specdec.replica.processors import TokenCounts
from specdec.replica.sampling import encoded_rows

log = logging.getLogger(__name__)

HEAD_KEY = "specdec_head"  # the head's own section of its config.json
WEIGHTS = "model.safetensors"
FC = ("fc.weight", "fc.bias")
WHERE = f"--head / {env_name('--head')}"


# -- the folder ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSpec:
    """A head folder as read: its transformers config (one decoder layer), the target's
    layers it reads and their wire format, and where the shared matrices come from."""

    folder: Path
    config: Any  # transformers PretrainedConfig
    feature_layers: tuple[int, ...]
    format: int  # common_pb2.FeatureFormat
    target: Path | None  # the folder named in the config ("target"), else None


def read_head(path: str) -> HeadSpec:
    """The head folder at `path` (ConfigError naming --head when it is not one)."""
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file() or not (folder / WEIGHTS).is_file():
        raise ConfigError(f"{WHERE}: {path!r} is not a head folder (config.json and {WEIGHTS})")
    raw = json.loads((folder / "config.json").read_text())
    own = raw.get(HEAD_KEY)
    if not isinstance(own, dict):
        raise ConfigError(f"{WHERE}: {path}/config.json has no {HEAD_KEY!r} object")
    layers = own.get("feature_layers")
    if not (isinstance(layers, list) and all(isinstance(i, int) and i >= 0 for i in layers)):
        raise ConfigError(f"{WHERE}: {HEAD_KEY}.feature_layers must be a list of layer indices")
    if len(layers) != 1:
        raise ConfigError(
            f"{WHERE}: {HEAD_KEY}.feature_layers names {len(layers)} layers; heads over one "
            "layer of the target (EAGLE-1) are built, several (EAGLE-3) not yet"
        )
    format_ = own.get("feature_format", "float32")
    if format_ not in FORMAT_NAMES:
        raise ConfigError(
            f"{WHERE}: {HEAD_KEY}.feature_format {format_!r} is not one of "
            f"{', '.join(FORMAT_NAMES)}"
        )
    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "num_hidden_layers", None) != 1:
        raise ConfigError(f"{WHERE}: a head has one decoder layer (config.json num_hidden_layers)")
    target = own.get("target")
    return HeadSpec(
        folder=folder,
        config=config,
        feature_layers=tuple(layers),
        format=FORMAT_NAMES[format_],
        target=(folder / target).resolve() if target else None,
    )


def _layer_prefix(model: Any) -> str:
    """The state-dict prefix of the model's one decoder layer ("model.layers.0.")."""
    layer = decoder_layers(model)[0]
    name = next(n for n, m in model.named_modules() if m is layer)
    return f"{name}."


def _target_tensors(folder: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a model folder's safetensors (one file, or an index)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: folder / weight_map[name] for name in names if name in weight_map}
    else:
        files = {name: folder / WEIGHTS for name in names}
    out: dict[str, torch.Tensor] = {}
    for name, file in files.items():
        if not file.is_file():
            continue
        with safe_open(str(file), "pt") as f:
            if name in f.keys():  # noqa: SIM118  (safe_open has no __contains__)
                out[name] = f.get_tensor(name)
    return out


class FeatureEmbedding(torch.nn.Module):
    """The head's input layer: fc([feature, embedding(token)]) at every position. The
    runtime sets `features` [rows, tokens, width] (laid out as the forward's input_ids)
    before each forward; a forward without them (the start-up probe) reads zeros."""

    def __init__(self, embed: torch.nn.Embedding, fc: torch.nn.Linear):
        super().__init__()
        self.embed = embed
        self.fc = fc
        self.width = fc.in_features - embed.embedding_dim
        self.features: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:  # what transformers reads of an input embedding
        return self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(input_ids)  # [rows, tokens, hidden]
        features = self.features
        if features is None:
            features = embedded.new_zeros(*input_ids.shape, self.width)
        elif features.shape[:2] != input_ids.shape:
            raise AssertionError(
                f"head features {tuple(features.shape)} do not match inputs {tuple(input_ids.shape)}"
            )
        out: torch.Tensor = self.fc(torch.cat([features.to(embedded.dtype), embedded], dim=-1))
        return out


def build_head(spec: HeadSpec, target: Path, dtype: torch.dtype) -> tuple[Any, FeatureEmbedding]:
    """The head as a one-layer causal LM of the target's architecture whose input
    embedding is a FeatureEmbedding, in `dtype` on the CPU: its layer and fc from the head
    folder, the embedding, final norm and output matrix from there or else from `target`."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # the init is overwritten; leave the RNG alone
        model = AutoModelForCausalLM.from_config(spec.config, dtype=dtype)
    state = load_file(str(spec.folder / WEIGHTS))
    fc_state = {name: state.pop(name) for name in FC if name in state}
    if "fc.weight" not in fc_state:
        raise ConfigError(f"{WHERE}: {spec.folder}/{WEIGHTS} has no fc.weight")
    wanted = set(model.state_dict())
    tied = getattr(spec.config, "tie_word_embeddings", False)
    optional = {"lm_head.weight"} if tied else set()
    unexpected = sorted(set(state) - wanted)
    if unexpected:
        raise ConfigError(
            f"{WHERE}: {WEIGHTS} holds tensors a one-layer model has not: {unexpected[:3]}"
        )
    prefix = _layer_prefix(model)
    missing = wanted - set(state) - optional
    layer_missing = sorted(n for n in missing if n.startswith(prefix))
    if layer_missing:
        raise ConfigError(f"{WHERE}: {WEIGHTS} lacks the decoder layer's {layer_missing[:3]}")
    if missing:  # the shared matrices: read from the target
        found = _target_tensors(target, missing)
        absent = sorted(missing - set(found))
        if absent:
            raise ConfigError(
                f"{WHERE}: neither the head nor the target {target} holds {absent[:3]}"
            )
        state.update(found)
    model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()
    hidden = int(spec.config.hidden_size)
    weight = fc_state["fc.weight"]
    width = hidden * len(spec.feature_layers)
    if tuple(weight.shape) != (hidden, width + hidden):
        raise ConfigError(
            f"{WHERE}: fc.weight is {list(weight.shape)}, a head of hidden size {hidden} over "
            f"{len(spec.feature_layers)} layer needs [{hidden}, {width + hidden}]"
        )
    fc = torch.nn.Linear(width + hidden, hidden, bias="fc.bias" in fc_state, dtype=dtype)
    fc.load_state_dict({name.removeprefix("fc."): t for name, t in fc_state.items()})
    embedding = FeatureEmbedding(model.get_input_embeddings(), fc)
    model.set_input_embeddings(embedding)
    assert model.get_input_embeddings() is embedding
    return model.eval(), embedding


def write_head(
    folder: str | Path,
    target: str | Path,
    layer: dict[str, torch.Tensor],
    fc_weight: torch.Tensor,
    fc_bias: torch.Tensor | None = None,
    feature_layer: int | None = None,
    feature_format: str = "float32",
    copy_shared: bool = True,
) -> Path:
    """A head folder for the target model folder `target`: its decoder layer `layer` (the
    layer's own state dict, names relative to it), fc_weight [hidden, 2 x hidden] (and
    fc_bias [hidden]), reading the target's feature_layer (None: its last). copy_shared:
    copy the target's embedding, final norm and output matrix into the folder; else the
    config names the target folder to read them from."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, target = Path(folder), Path(target).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.loads((target / "config.json").read_text())
    layers = int(raw["num_hidden_layers"])
    raw["num_hidden_layers"] = 1
    for key in ("layer_types", "max_window_layers"):  # per-layer lists of the target's
        raw.pop(key, None)
    raw[HEAD_KEY] = {
        "feature_layers": [layers - 1 if feature_layer is None else feature_layer],
        "feature_format": feature_format,
        "target_num_hidden_layers": layers,
    }
    if not copy_shared:
        raw[HEAD_KEY]["target"] = str(target)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # its names only
        meta = AutoModelForCausalLM.from_config(config)
    names, prefix = set(meta.state_dict()), _layer_prefix(meta)
    state = {prefix + name: t.detach().contiguous() for name, t in layer.items()}
    state["fc.weight"] = fc_weight.detach().contiguous()
    if fc_bias is not None:
        state["fc.bias"] = fc_bias.detach().contiguous()
    if copy_shared:
        shared = {n for n in names if not n.startswith(prefix)}
        state.update({n: t.contiguous() for n, t in _target_tensors(target, shared).items()})
    save_file(state, str(folder / WEIGHTS))
    return folder


# -- a session's features ------------------------------------------------------------------


@dataclass
class HeadState:
    """What the head keeps of one session beside its KV: the target features received and
    not consumed yet (by position), and the positions whose entry was fed with another
    feature (`stale`, sorted: the head's own prediction, or zeros where the target's never
    arrived), which a later Draft feeds again once the target's arrives. Model thread."""

    session: weakref.ref[Any]  # the store's session object this state belongs to
    known: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [width]
    stale: list[int] = field(default_factory=list)

    def receive(self, start: int, rows: torch.Tensor) -> None:
        for i in range(rows.shape[0]):
            self.known[start + i] = rows[i]

    def rollback_point(self, length: int) -> int:
        """Where to feed again from: the first stale position within `length` whose
        target feature (of the position before it) has arrived, else `length`."""
        return next((p for p in self.stale if p < length and p - 1 in self.known), length)

    def inputs(
        self, start: int, n: int, width: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, int]:
        """The features [n, width] positions start..start+n-1 are fed with, and how many
        are zeros because the target's never arrived (marked stale): the target's feature
        of the position before where it has arrived, else zeros (position 0 reads zeros
        by convention: nothing precedes it)."""
        rows = torch.zeros(n, width, dtype=dtype)
        del self.stale[bisect.bisect_left(self.stale, start) :]
        missing = 0
        for i in range(n):
            position = start + i
            found = self.known.get(position - 1)
            if found is not None:
                rows[i] = found
            elif position:
                missing += 1
                self.stale.append(position)
        return rows, missing

    def fed_own(self, position: int) -> None:
        """A draft step fed `position` with the head's own prediction (stale)."""
        del self.stale[bisect.bisect_left(self.stale, position) :]
        self.stale.append(position)

    def forget_after(self, length: int) -> None:
        """The session holds `length` tokens: a feature received for a later position
        belonged to a sequence it no longer holds (the call's own arrive after this)."""
        for position in [p for p in self.known if p >= length]:
            del self.known[position]

    def prune(self, length: int) -> None:
        """Forget the features no later feed reads: only the position before a stale one,
        or before one not fed yet, may be fed again."""
        stale = set(self.stale)
        for position in [p for p in self.known if p + 1 < length and p + 1 not in stale]:
            del self.known[position]


# -- the engine ----------------------------------------------------------------------------


class HeadRuntime(DrafterRuntime):
    """The head drafter's engine: a DrafterRuntime over the head (`build_head`; its output
    layer reduced with --draft-vocab), whose forwards feed each token with its input
    feature (ForwardRequest.inputs), and the sessions' HeadState."""

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self.embedding: FeatureEmbedding | None = None
        self.width = 0  # values of a feature (the target's hidden size)
        self.states: dict[str, HeadState] = {}

    def load_weights(self) -> LoadedModel:
        cfg = self.config
        assert isinstance(cfg, DrafterConfig) and cfg.head  # run with --head
        set_threads(cfg.threads)
        spec = read_head(cfg.head)
        facts = load_facts(cfg)  # the target's tokenizer and generation config (--model)
        if facts.vocab_size and facts.vocab_size != spec.config.vocab_size:
            raise ConfigError(
                f"{WHERE}: the head's vocabulary ({spec.config.vocab_size}) is not the "
                f"target's ({facts.vocab_size}, --model {cfg.model})"
            )
        dtype = DTYPES["float32" if cfg.dtype == "auto" else cfg.dtype]
        model, self.embedding = build_head(spec, spec.target or Path(cfg.model), dtype)
        model.to(self.device)
        check_batchable(model, cfg.head)
        self.width = self.embedding.width
        self.head_features = FeatureAsk(spec.feature_layers, spec.format)
        reason = f"{str(dtype).removeprefix('torch.')}: as asked (--dtype); head {cfg.head}"
        return loaded_model(model, facts, reason)

    def probe_request(self, session: Any, tokens: list[int], fresh: bool) -> ForwardRequest:
        """A probe's forward carries input features too: zeros (as the one-row probe's)."""
        inputs = torch.zeros(len(tokens), self.width, dtype=self.model.dtype, device=self.device)
        return ForwardRequest(session, tokens, 1, fresh, inputs=inputs)

    def _forward_requests(self, requests: list[ModelRequest]) -> list[torch.Tensor]:
        """The forward with every row's input features laid out as its input_ids (a
        session's request one row, its tokens from column 0; a branch step one row per
        branch, its token in column 0; right pads reading zeros)."""
        assert self.embedding is not None
        rows = torch.zeros(  # on the device: a draft step's input is already there
            sum(r.rows for r in requests),
            max(r.width for r in requests),
            self.width,
            dtype=self.model.dtype,
            device=self.device,
        )
        row = 0
        for r in requests:
            if r.inputs is None:
                raise AssertionError("a head's forwards carry their input features")
            if isinstance(r, ForwardRequest):
                rows[row, : r.inputs.shape[0]] = r.inputs
            else:
                rows[row : row + r.rows, 0] = r.inputs
            row += r.rows
        self.embedding.features = rows
        try:
            return super()._forward_requests(requests)
        finally:
            self.embedding.features = None

    def _check_head(self) -> None:
        """DrafterRuntime's check of a reduced output layer, its forwards fed zero features."""
        assert self.embedding is not None
        self.embedding.features = torch.zeros(
            1, 2, self.width, dtype=self.model.dtype, device=self.device
        )
        try:
            super()._check_head()
        finally:
            self.embedding.features = None

    def state(self, session_id: str, session: Any, fresh: bool) -> HeadState:
        """The session's HeadState: a new one for a new sequence (fresh: prefix 0) or a new
        session object (a fork, an evicted and remade session)."""
        state = self.states.get(session_id)
        if fresh or state is None or state.session() is not session:
            state = self.states[session_id] = HeadState(weakref.ref(session))
        if len(self.states) > 2 * len(self.ready_store) + 16:  # evicted sessions' states
            for name in [n for n, s in self.states.items() if s.session() is None]:
                del self.states[name]
        return state

    def release(self, session_id: str) -> bool:
        self.states.pop(session_id, None)
        return super().release(session_id)


# -- the Draft -----------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadDraftCall(DraftCall):
    """A validated Draft for a head drafter (a chain or a tree): DraftCall's fields, and
    the target's features it carries, (start position, rows [n, width] on the host) each."""

    features: tuple[tuple[int, torch.Tensor], ...] = ()

    def job(self) -> Generator[ModelRequest, torch.Tensor, DraftResult]:
        return propose_head(self)


def propose_head(call: HeadDraftCall) -> Generator[ModelRequest, torch.Tensor, DraftResult]:
    """Draft the call's k tokens with the head: a job for the model thread. The session
    takes the call's features, rolls back to the first position they let it feed with the
    target's feature (HeadState.rollback_point), feeds from there and the new tokens, then
    draws k tokens, each fed with the head's own prediction. The cache ends holding
    prefix + new_tokens + d_1..d_{k-1}, as a model drafter's."""
    runtime = call.runtime
    assert isinstance(runtime, HeadRuntime)
    store, session_id, prefix = runtime.ready_store, call.session_id, call.prefix
    k, params, controls = call.k, call.params, call.controls
    with runtime.guarded(session_id):
        started = time.perf_counter()
        call.branches.pop_rows(session_id)
        session = store.acquire(
            session_id, prefix.length, prefix.hash, len(call.new_tokens) + k - 1, call.fork_from
        )
        state = runtime.state(session_id, session, fresh=prefix.length == 0)
        state.forget_after(len(session.tokens))
        for start, received in call.features:
            state.receive(start, received.to(runtime.model.dtype))
        hit = take_prepared(
            call.branches, session_id, session, call.new_tokens, k, params, controls
        )
        if hit is not None:  # SSD prepared it: no forward, the cache stays at the prefix
            ms = (time.perf_counter() - started) * 1e3
            return DraftResult(*hit, len(session.tokens), ms, prepared=True)
        back = state.rollback_point(len(session.tokens))
        feed = [*session.tokens[back:], *call.new_tokens]
        if back < len(session.tokens):
            store.truncate(session, back)
        inputs, missing = state.inputs(back, len(feed), runtime.width, runtime.model.dtype)
        runtime.obs.head_fed(len(feed) - missing, 0, missing)
        sink = FeatureSink((0,))
        last = (yield from _steps(runtime, session, feed, inputs, sink, keep=1))[-1:]
        position = len(session.tokens)  # index of d_1 in the sequence
        counts = None
        if controls is not None:  # the sequence's statistics, then each drawn token's
            counts = TokenCounts(controls, session.tokens, [()], last.shape[-1], last.device)
        sampler = sampler_for(params, runtime, counts)
        drawn: list[torch.Tensor] = []  # [1] each, on the device
        proposals: list[torch.Tensor] = []  # [1, vocab] each, under sampling
        rows: list[torch.Tensor] = []  # [1, vocab] logits each token was drawn from
        # [1, width] each, on the device: what the token at position + i is fed with, the
        # head's own prediction at the token before (a tree's continued leaf there too)
        feeds = [sink.tensor()[-1:]]
        for i in range(k):
            rows.append(last)
            token, proposal = sampler.draw(last, [position + i])
            drawn.append(token)
            if proposal is not None:
                proposals.append(proposal)
            if i < k - 1:  # fed with the head's own prediction of its feature
                state.fed_own(position + i)
                sink = FeatureSink((0,))
                last = (yield from _steps(runtime, session, token, feeds[i], sink))[-1:]
                feeds.append(sink.tensor()[-1:])
        runtime.obs.head_fed(0, k - 1, 0)
        payload = sampler.payload(proposals)
        chain = torch.cat(drawn)
        top = tree_tops(rows, proposals, chain, call.tree_width) if call.tree_nodes > 0 else ()
        host = to_host(chain, *payload, *top)  # the Draft's one copy
        tokens = host[0].tolist()
        store.fill(session, tokens[: k - 1])  # the device tokens it fed
        state.prune(len(session.tokens))
        # for the Speculate that follows (specdec.drafter.speculate)
        call.branches.put_rows(session_id, DraftRows.after(session, position, rows, feeds))
        encoded = encoded_rows(host[1 : 1 + len(payload)]) if proposals else []
        parents: list[int] = []
        if top:  # the head's alternatives as leaves, the best continued as branch rows
            top_host = [t.tolist() for t in host[len(host) - 3 :]]
            tokens, parents, encoded = yield from grow_tree(
                call, session, position, tokens, top_host, encoded, bool(proposals), feeds
            )
        return DraftResult(
            tokens,
            encoded,
            len(session.tokens),
            (time.perf_counter() - started) * 1e3,
            parents=parents,
        )


@dataclass(frozen=True)
class HeadSpeculateCall(SpeculateCall):
    """A validated Speculate for a head drafter: SSD's (specdec.drafter.speculate), its draft
    fed with the head's own features, and each branch's first token fed the one its
    position would get (`rows`)."""

    def rows(
        self, session: Any, memo: DraftRows | None
    ) -> Generator[ForwardRequest, torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
        """The drafter's logits at every draft position and after it [k+1, vocab], and the
        feature outcome a's next token is fed with [k+1, width]: the head's output at the
        token before its position. After this replica's Draft (memo) its rows and feeds
        cover the draft up to the cache, and the tokens after are fed one at a time, each
        with the head's output at the one before; otherwise the draft is fed again (with
        the target's features where they arrived, zeros elsewhere, marked stale)."""
        runtime, k, new_tokens = self.runtime, self.k, self.new_tokens
        assert isinstance(runtime, HeadRuntime)
        state = runtime.state(self.session_id, session, fresh=self.prefix.length == 0)
        cached = len(session.tokens)
        state.forget_after(cached)
        base = cached + len(new_tokens) - k  # the position of d_1
        if (
            memo is not None
            and memo.feeds is not None
            and memo.covers(cached, self.prefix.hash, base)
        ):
            fed = [row[None] for row in memo.feeds[base - memo.start :]]  # base..cached
            rows = [memo.rows[base - memo.start :]]
            for j, token in enumerate(new_tokens):
                state.fed_own(cached + j)
                sink = FeatureSink((0,))
                rows.append((yield from _steps(runtime, session, [token], fed[-1], sink))[-1:])
                fed.append(sink.tensor()[-1:])
            runtime.obs.head_fed(0, len(new_tokens), 0)
            return torch.cat(rows), torch.cat(fed)
        back = min(state.rollback_point(cached), cached if cached < base else base - 1)
        feed = [*session.tokens[back:], *new_tokens]
        if back < cached:
            runtime.ready_store.truncate(session, back)
        inputs, missing = state.inputs(back, len(feed), runtime.width, runtime.model.dtype)
        runtime.obs.head_fed(len(feed) - missing, 0, missing)
        sink = FeatureSink((0,))
        logits = yield from _steps(runtime, session, feed, inputs, sink, keep=k + 1)
        return logits, sink.tensor()[base - 1 - back :]


def _steps(
    runtime: HeadRuntime,
    session: Any,
    tokens: Sequence[int] | torch.Tensor,
    inputs: torch.Tensor,
    sink: FeatureSink,
    keep: int | None = None,
) -> Generator[ForwardRequest, torch.Tensor, torch.Tensor]:
    """`forward_steps` with each token's input feature (inputs [n, width])."""
    return runtime.forward_steps(session, tokens, keep, features=sink, inputs=inputs)
