"""`specdec distill --head`: train a draft head on the target's features (EAGLE).

A head (specdec.drafter.head, docs/concepts/heads.md) is one decoder layer of the target's
architecture over the target's own hidden states: its entry at sequence position j is
fc([f(j - 1), e(t_j)]), f the target's feature (its last decoder layer's output, before
the final norm, as the verifier sends it), e the target's embedding; position 0 reads a
zero feature. Its layer's output h(j) is its prediction of f(j), and the target's final
norm and output matrix turn it into the distribution of token j + 1.

Two phases:

- **collect**: one forward of the target per sequence (cut to --max-length, its end kept)
  with hooks on the feature layer (specdec.replica.features.recording, the verifier's own
  code), in the dtype the verifier would load it in (--teacher-dtype, else --dtype),
  rounded to the head's wire format (--feature-format): the features the head will read;
- **train**: the head's decoder layer and fc (the embedding, final norm and output matrix
  stay the target's, frozen) with EAGLE's objective at the sequence's output positions:
  smooth-L1 of h(j) against f(j) (--feature-weight) plus the cross-entropy of the head's
  next-token distribution against the target's, softmax(lm_head(norm(f(j)))), through the
  frozen matrices (--token-weight). With --ttt (training-time test) a second step feeds
  every position its own first-step prediction h(j - 1) in place of f(j - 1), attending to
  the first step's earlier positions (one forward over both steps with a block mask): what
  a draft's second token reads at serving time.

The head starts as the target's last decoder layer with fc = [0 | I] (the embedding
passed through), so it is deterministic under --seed. Measured before and after on the
held-out split: teacher-forced agreement of the head's top token with the target's, at the
first step (fed the target's features) and at the second (fed its own prediction). The
output is a head folder (specdec.drafter.head.write_head: config.json, model.safetensors
with the target's embedding, norm and output matrix copied in) with specdec_version.json
(the version id, default head-<sha256 of the weights>, and the report), which
`specdec serve drafter --model TARGET --head OUT` loads and reports in Info.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.common.version import VERSION_FILE, check_version
from specdec.sdk.progress import Progress
from specdec.tools.distill.data import Sequence
from specdec.tools.distill.train import (
    DTYPES,
    STATE_DIR,
    batches,
    peak_memory_mb,
    weights_digest,
)

FORMATS = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class HeadSettings:
    """Everything that shapes a head's weights."""

    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-4
    feature_weight: float = 1.0  # EAGLE's v_w: the smooth-L1 feature regression
    token_weight: float = 0.1  # EAGLE's p_w: the cross-entropy of the target's next token
    ttt: bool = False  # training-time test: a second step fed its own prediction
    seed: int = 0
    max_length: int = 1024
    draft_vocab: int = 0  # the token loss over these first ids only (0: the whole vocabulary)

    def check(self) -> None:
        """ValueError naming the first setting out of range."""
        if self.steps < 0:
            raise ValueError("--steps must be >= 0 (0: write the initial head)")
        for name in ("batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_length < 2:
            raise ValueError("--max-length must be >= 2")
        if not self.lr > 0:
            raise ValueError("--lr must be > 0")
        if self.draft_vocab < 0:
            raise ValueError("--draft-vocab must be >= 0 (0: the whole vocabulary)")
        w = (self.feature_weight, self.token_weight)
        if min(w) < 0 or sum(w) == 0:
            raise ValueError("--feature-weight and --token-weight must be >= 0, not both 0")


@dataclass(frozen=True)
class Example:
    """One sequence as the head trains on it."""

    ids: torch.Tensor  # [n] token ids
    features: torch.Tensor  # [n, width] the target's, in the wire format's dtype
    first: int  # the first position whose prediction is trained (the output's)


@dataclass
class Batch:
    ids: torch.Tensor  # [b, t], right-padded
    features: torch.Tensor  # [b, t, width] the target's (training dtype), zeros past the end
    mask: torch.Tensor  # [b, t] bool: trained positions


@dataclass
class Agreement:
    step1: float  # the head's top token == the target's, fed the target's features
    step2: float  # the same, fed its own prediction at the position before
    positions: int

    def figures(self) -> dict[str, float]:
        return {"greedy_agreement": self.step1, "greedy_agreement_own_feature": self.step2}


def check_target(target_path: str) -> Path:
    """The target's folder (ValueError when it is not a model folder)."""
    folder = Path(target_path).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"--target-model {target_path}: not a model folder (no config.json); a head is "
            "trained for a target on disk"
        )
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"--target-model {target_path}: no *.safetensors weights in it")
    return folder


def feature_layer_of(target: Any, layer: int | None) -> int:
    """The decoder layer the head reads (None: the last), checked against the target."""
    from specdec.replica.features import decoder_layers

    try:
        n = len(decoder_layers(target))
    except (AttributeError, ValueError) as e:
        raise ValueError(
            f"the target has no decoder layers to read features from ({e}): a head needs a "
            "decoder-only transformers model such as Llama or Qwen2"
        ) from None
    chosen = n - 1 if layer is None else layer
    if not 0 <= chosen < n:
        raise ValueError(f"--feature-layer {layer}: the target's decoder layers are 0..{n - 1}")
    return chosen


def cut(seq: Sequence, max_length: int) -> tuple[list[int], int]:
    """The sequence's ids cut to max_length (its end kept), and the first trained position
    in them: the last prompt position (it predicts the first output token), 0 for text."""
    ids = seq.ids
    start = max(0, len(ids) - max_length)
    return ids[start:], max(0, len(seq.prompt_ids) - start - 1)


@torch.no_grad()
def collect(
    target: Any,
    seqs: list[Sequence],
    layer: int,
    wire: torch.dtype,
    max_length: int,
    device: str,
    progress: Progress,
) -> list[Example]:
    """The target's features over every sequence: one forward each, rounded to `wire`."""
    from specdec.replica.features import recording

    out = []
    for seq in seqs:
        ids, first = cut(seq, max_length)
        if len(ids) < 2:
            progress.step()
            continue
        x = torch.tensor([ids], device=device)
        with recording(target, [layer]) as outputs:
            target.model(input_ids=x)  # the decoder only: no logits needed
        rows = outputs[layer][0].to("cpu", dtype=wire)
        out.append(Example(torch.tensor(ids), rows, first))
        progress.step()
    return out


def collate_examples(examples: list[Example], dtype: torch.dtype, device: str) -> Batch:
    width = max(len(e.ids) for e in examples)
    hidden = examples[0].features.shape[1]
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    features = torch.zeros(len(examples), width, hidden, dtype=dtype)
    mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e.ids)
        ids[b, :n] = e.ids
        features[b, :n] = e.features.to(dtype)
        mask[b, e.first : n] = True
    return Batch(ids.to(device), features.to(device), mask.to(device))


def shifted(features: torch.Tensor) -> torch.Tensor:
    """What each position reads: the feature of the position before ([b, t, w]; zeros at 0)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def two_step_mask(t: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """The attention mask [1, 1, 2t, 2t] of a forward over both steps: the first t entries
    causal among themselves; the second step's entry j attends to the first step's entries
    before j and to itself (its own earlier positions hold the target's features, as the
    head's cache does when it drafts)."""
    allowed = torch.zeros(2 * t, 2 * t, dtype=torch.bool, device=device)
    allowed[:t, :t] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    allowed[t:, :t] = torch.ones(t, t, dtype=torch.bool, device=device).tril(-1)
    allowed[t:, t:] = torch.eye(t, dtype=torch.bool, device=device)
    mask = torch.zeros(2 * t, 2 * t, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


class HeadModel:
    """The head as the drafter builds it (specdec.drafter.head.build_head), with its
    decoder layer and fc trainable, and its forwards for training."""

    def __init__(self, model: Any, embedding: Any):
        from specdec.replica.features import decoder_layers

        self.model = model
        self.embedding = embedding
        self.layer = decoder_layers(model)[0]
        for p in model.parameters():
            p.requires_grad_(False)
        for p in [*self.layer.parameters(), *embedding.fc.parameters()]:
            p.requires_grad_(True)
        self.norm = model.get_decoder().norm
        self.lm_head = model.get_output_embeddings()
        self.autocast = False  # run the forwards in `compute` (torch.autocast)
        self.compute = torch.float32
        self.kept: torch.Tensor | None = None  # --draft-vocab: the ids the output layer keeps

    def keep(self, ids: list[int]) -> None:
        """Train over these token ids only (the drafter's --draft-vocab subset): the token
        loss and the agreement read the output matrix's rows of them."""
        self.kept = torch.tensor(ids, device=self.lm_head.weight.device)

    def autocasting(self) -> torch.autocast:
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=self.compute, enabled=self.autocast)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def hidden(
        self,
        ids: torch.Tensor,
        inputs: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output (before the final norm) [b, t, w] for ids [b, t] fed with
        the input features [b, t, w]."""
        from specdec.replica.features import recording

        self.embedding.features = inputs
        try:
            with recording(self.model, [0]) as outputs:
                self.model.get_decoder()(
                    input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
                )
        finally:
            self.embedding.features = None
        return outputs[0]

    def steps(self, batch: Batch, second: bool) -> list[torch.Tensor]:
        """The head's predictions h [b, t, w]: the first step's (fed the target's features),
        and with `second` the second's (each position fed the first's h at the one before)."""
        inputs = shifted(batch.features)
        if not second:
            return [self.hidden(batch.ids, inputs)]
        b, t = batch.ids.shape
        first = self.hidden(batch.ids, inputs)
        # Both steps in one forward, so the second attends to the first's keys; the first
        # step's half of it equals `first` (causal), the second's reads first's outputs.
        ids = torch.cat([batch.ids, batch.ids], dim=1)
        both = torch.cat([inputs, shifted(first)], dim=1)
        positions = torch.arange(t, device=ids.device).repeat(2).expand(b, -1)
        mask = two_step_mask(t, first.dtype, ids.device).expand(b, 1, -1, -1)
        return [first, self.hidden(ids, both, mask, positions)[:, t:]]

    def log_probs(self, hidden: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """log softmax of the target's output over norm(hidden), float32: [n, vocab], or
        over the kept ids [n, len(kept)] (renormalized there) unless `whole`."""
        if self.kept is None or whole:
            return self.lm_head(self.norm(hidden)).float().log_softmax(-1)
        weight = self.lm_head.weight[self.kept]
        return F.linear(self.norm(hidden), weight).float().log_softmax(-1)


def losses(
    head: HeadModel, batch: Batch, predictions: list[torch.Tensor], settings: HeadSettings
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss over the trained positions, summed over the steps (a second step skips
    position 0, whose entry reads zeros either way): the weighted smooth-L1 of each
    prediction against the target's feature there and the cross-entropy of its next-token
    distribution against the target's."""
    total = torch.zeros((), device=batch.ids.device)
    parts: dict[str, float] = {}
    for step, h in enumerate(predictions, 1):
        mask = batch.mask.clone()
        if step > 1:
            mask[:, 0] = False
        want = batch.features[mask].float()  # [n, w]
        got = h[mask].float()
        feature = F.smooth_l1_loss(got, want)
        with torch.no_grad():
            target = head.log_probs(batch.features[mask]).exp()  # [n, vocab]
        token = -(target * head.log_probs(h[mask])).sum(-1).mean()
        total = total + settings.feature_weight * feature + settings.token_weight * token
        parts[f"feature{step}"] = feature.item()
        parts[f"token{step}"] = token.item()
    return total, parts


@torch.no_grad()
def agreement(
    head: HeadModel,
    examples: list[Example],
    settings: HeadSettings,
    dtype: torch.dtype,
    device: str,
) -> Agreement:
    """Teacher-forced agreement of the head's top token with the target's at the trained
    positions: fed the target's features, and fed its own prediction (second step)."""
    hits = [0, 0]
    counts = [0, 0]
    for i in range(0, len(examples), settings.batch_size):
        batch = collate_examples(examples[i : i + settings.batch_size], dtype, device)
        with head.autocasting():
            predictions = head.steps(batch, second=True)
            for step, h in enumerate(predictions):
                mask = batch.mask.clone()
                if step:
                    mask[:, 0] = False
                want = head.log_probs(batch.features[mask], whole=True).argmax(-1)
                got = head.log_probs(h[mask]).argmax(-1)
                if head.kept is not None:
                    got = head.kept[got]  # a kept id, against the target's over all of them
                hits[step] += int((want == got).sum())
                counts[step] += int(mask.sum())
    return Agreement(hits[0] / max(1, counts[0]), hits[1] / max(1, counts[1]), counts[0])


def kept_ids(target: Any, n: int) -> list[int] | None:
    """--draft-vocab n: the ids the drafter keeps with the same flag (its own choice,
    specdec.drafter.vocab.subset_ids: the n smallest and the end-of-sequence tokens); None
    for 0 (the whole vocabulary)."""
    if not n:
        return None
    from specdec.drafter.vocab import subset_ids
    from specdec.replica.loading import eos_ids

    vocab = int(target.config.vocab_size)
    if n > vocab:
        raise ValueError(f"--draft-vocab must be <= {vocab} (the target's vocabulary), got {n}")
    eos = eos_ids([getattr(target, "generation_config", None), target.config], None)
    return subset_ids(n, None, vocab, eos)


def initial_head(target: Any, folder: Path, target_path: Path, layer: int, format_: str) -> Path:
    """The untrained head: the target's last decoder layer, fc = [0 | I] (the token
    embedding passed through), reading the shared matrices from the target."""
    from specdec.drafter.head import write_head
    from specdec.replica.features import decoder_layers

    hidden = int(target.config.hidden_size)
    last = decoder_layers(target)[-1].state_dict()
    fc = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    return write_head(
        folder,
        target_path,
        {n: t.float() for n, t in last.items()},
        fc,
        feature_layer=layer,
        feature_format=format_,
        copy_shared=False,
    )


def load_head(folder: Path, target_path: Path, dtype: torch.dtype, device: str) -> HeadModel:
    from specdec.drafter.head import build_head, read_head

    model, embedding = build_head(read_head(str(folder)), target_path, dtype)
    return HeadModel(model.to(device), embedding)


def train_head(
    *,
    target_path: str,
    train: list[Sequence],
    held: list[Sequence],
    out: Path,
    settings: HeadSettings,
    feature_layer: int | None = None,
    feature_format: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    teacher_dtype: str | None = None,
    version: str | None = None,
    progress: bool = True,
    data_note: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collect the target's features, train a head, write it to `out`; the report."""
    from transformers import AutoModelForCausalLM

    from specdec.drafter.head import write_head

    started = time.perf_counter()
    settings.check()
    target_folder = check_target(target_path)
    teacher = teacher_dtype or dtype
    format_ = feature_format or teacher
    if format_ not in FORMATS:
        raise ValueError(f"--feature-format must be one of {', '.join(FORMATS)}")
    if out.exists() and (out / VERSION_FILE).exists():
        raise ValueError(f"--out {out} already holds a model ({VERSION_FILE}): pick a new folder")
    state_dir = out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.seed)
    target: Any = AutoModelForCausalLM.from_pretrained(target_folder, dtype=DTYPES[teacher])
    target = target.to(device).eval()
    layer = feature_layer_of(target, feature_layer)
    vocab = int(target.config.vocab_size)
    kept = kept_ids(target, settings.draft_vocab)
    bad = next((t for s in [*train, *held] for t in s.ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(
            f"token id {bad} is outside the target's vocabulary of {vocab}: data of another model?"
        )

    stream = sys.stderr
    bar = Progress(stream, len(train) + len(held), enabled=progress)
    bar.begin("collecting the target's features (one forward per sequence)")
    wire = DTYPES[format_]
    train_ex = collect(target, train, layer, wire, settings.max_length, device, bar)
    held_ex = collect(target, held, layer, wire, settings.max_length, device, bar)
    bar.close()
    collect_s = time.perf_counter() - started
    if not train_ex or not held_ex:
        raise ValueError("no sequence of 2 tokens or more to train on or to hold out")
    init = initial_head(target, state_dir / "initial", target_folder, layer, format_)
    del target  # the head reads the shared matrices from the folder
    # The weights train in float32; --dtype bfloat16 or float16 runs the forwards and
    # backwards in it (autocast: the matrix units of the CPU or GPU), the optimizer not.
    train_dtype = torch.float32
    head = load_head(init, target_folder, train_dtype, device)
    head.autocast = dtype != "float32"
    head.compute = DTYPES[dtype]
    if kept is not None:
        head.keep(kept)
    before = agreement(head, held_ex, settings, train_dtype, device)

    params = head.parameters()
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    bar = Progress(stream, settings.steps, enabled=progress)
    bar.begin("training the head")
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens = 0
    head.model.train()
    for step in range(settings.steps):
        picked = batches(len(train_ex), settings.batch_size, settings.seed, step)
        batch = collate_examples([train_ex[i] for i in picked], train_dtype, device)
        with head.autocasting():
            loss, parts = losses(head, batch, head.steps(batch, settings.ttt), settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        tokens += int(batch.mask.sum())
        last = {"loss": loss.item(), **parts}
        first = first or last
        bar.step(label=" ".join(f"{k} {v:.3f}" for k, v in last.items()))
    bar.close()
    head.model.eval()
    after = agreement(head, held_ex, settings, train_dtype, device)

    layer_state = {n: p.detach().to("cpu") for n, p in head.layer.state_dict().items()}
    fc = head.embedding.fc
    write_head(
        out,
        target_folder,
        layer_state,
        fc.weight.detach().to("cpu"),
        fc.bias.detach().to("cpu") if fc.bias is not None else None,
        feature_layer=layer,
        feature_format=format_,
    )
    version = check_version(version) if version else f"head-{weights_digest(out)[:12]}"
    report = {
        "version": version,
        "kind": "head",
        "target_model": str(target_folder),
        "feature_layer": layer,
        "feature_format": format_,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": asdict(settings),
        "data": {
            **(data_note or {}),
            "train_sequences": len(train_ex),
            "held_out_sequences": len(held_ex),
        },
        "held_out": {
            "positions": after.positions,
            "before": before.figures(),
            "after": after.figures(),
        },
        "cost": {
            "minutes": (time.perf_counter() - started) / 60,
            "collect_minutes": collect_s / 60,
            "trained_positions": tokens,
            "peak_rss_mib": peak_memory_mb(),
            "device": device,
            "dtype": dtype,
            "teacher_dtype": teacher,
        },
        "first_losses": first,
        "final_losses": last,
    }
    text = json.dumps(report, indent=2) + "\n"
    (out / VERSION_FILE).write_text(text)
    (state_dir / "report.json").write_text(text)
    return report
