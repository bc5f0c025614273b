"""The distillation itself: losses, the agreement measures, the training loop, the output.

Losses, averaged over the target's output positions of a batch (the positions whose next
token the target produced):

- sequence-level KD: cross-entropy of the drafter on the target's output tokens; on a
  sequence the drafter wrote itself (`--on-policy`, DistillSpec's on-policy data), on the
  target's greedy token at each position instead (from the teacher forward): the positions
  where the drafter goes are the ones it is trained on;
- token-level KL: KL(target || drafter) over the target's top-m tokens at each position,
  the target's probabilities renormalised over those m. Where every sequence of a batch
  was recorded with the target's top-m (a gateway's --record-top-logprobs), they are the
  KL's target and the batch needs no forward of the target; otherwise a teacher forward
  of the target on the same batch (no gradient) gives them.

Agreement (held-out split, before and after): teacher-forced greedy agreement, the share
of positions where the drafter's argmax equals the target's (what greedy speculation
accepts position by position), and the mean of sum_v min(p_v, q_v) at --eval-temperature,
the probability that a sampled draft token is accepted at that position.

What trains: the decoder layers named by --train-layers (and the final norm), the output
head with --train-head; or, with --lora-rank R, LoRA adapters (peft) on the linear layers
of those decoder layers, merged into the weights at the end so that the drafter serves a
plain checkpoint. Every --save-every steps the trainable weights, the optimizer and the
step go to OUT/distill/checkpoint.pt; --resume continues from there with the same data
order (a seeded shuffle per epoch).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.common.version import VERSION_FILE, check_version, read_model_version
from specdec.tools.distill.data import Sequence
from specdec.tools.distill.quant_aware import QUANT_AWARE, make_quant_aware, undo_quant_aware

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STATE_DIR = "distill"  # under --out: checkpoint, generated data, report


@dataclass(frozen=True)
class TrainSettings:
    """Everything that shapes the weights; a resumed run must match it."""

    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-4
    ce_weight: float = 1.0
    kl_weight: float = 1.0
    top_m: int = 20
    train_layers: str = "all"
    train_head: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    seed: int = 0
    max_length: int = 1024
    quant_aware: str = "none"

    def check(self) -> None:
        """ValueError naming the first setting out of range."""
        for name in ("steps", "batch_size", "top_m", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not self.lr > 0:
            raise ValueError("--lr must be > 0")
        if self.lora_rank < 0:
            raise ValueError("--lora-rank must be >= 0 (0: full fine-tuning)")
        if self.ce_weight < 0 or self.kl_weight < 0 or self.ce_weight + self.kl_weight == 0:
            raise ValueError("--ce-weight and --kl-weight must be >= 0, not both 0")
        if self.quant_aware not in QUANT_AWARE:
            raise ValueError(f"--quant-aware must be one of {QUANT_AWARE}")


_DEFAULTS = asdict(TrainSettings())


@dataclass
class Agreement:
    greedy: float  # teacher-forced greedy agreement
    min_pq: float  # mean sum(min(p, q)) at the evaluation temperature
    positions: int

    def figures(self) -> dict:
        """The report's form: {"greedy_agreement", "sum_min_pq"}."""
        return {"greedy_agreement": self.greedy, "sum_min_pq": self.min_pq}


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'all', 'last:N', 'A-B' or 'A,B,C' -> decoder layer indices (ValueError otherwise)."""
    spec = spec.strip()
    if spec == "all":
        return list(range(num_layers))
    if spec.startswith("last:"):
        n = int(spec[5:])
        if not 1 <= n <= num_layers:
            raise ValueError(f"--train-layers {spec}: N must be in [1, {num_layers}]")
        return list(range(num_layers - n, num_layers))
    layers: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if not 0 <= lo <= hi < num_layers:
            raise ValueError(f"--train-layers {spec}: layers are 0..{num_layers - 1}")
        layers.update(range(lo, hi + 1))
    return sorted(layers)


def batches(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The indices of batch `step`: epoch after epoch, each a seeded shuffle of range(n)."""
    per_epoch = max(1, math.ceil(n / batch_size))
    epoch, i = divmod(step, per_epoch)
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[i * batch_size : (i + 1) * batch_size]


def collate(seqs: list[Sequence], max_length: int, pad_id: int, device) -> tuple:
    """Right-padded ids [b, t], attention mask [b, t], and the mask [b, t] of the positions
    that predict an output token (position i predicts token i + 1)."""
    rows = []
    for s in seqs:
        ids = s.ids
        start = max(0, len(ids) - max_length)  # keep the end: the output
        rows.append((ids[start:], max(0, len(s.prompt_ids) - start)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    predicts = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (ids, n_prompt) in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
        predicts[b, max(0, n_prompt - 1) : len(ids) - 1] = True
    return input_ids.to(device), attention.to(device), predicts.to(device)


def recorded_top(
    seqs: list[Sequence], max_length: int, top_m: int, device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The recorded top-m of the positions `collate` marks, in its order: (ids [n, m],
    log-probabilities [n, m]), m the smaller of top_m and what was recorded; None unless
    every sequence was recorded with them."""
    if not seqs or any(s.top_ids is None for s in seqs):
        return None
    m = min(top_m, *(len(s.top_ids[0]) for s in seqs))
    ids: list = []
    logprobs: list = []
    for s in seqs:
        start = max(0, len(s.prompt_ids) + len(s.output_ids) - max_length)  # as collate cuts
        for j in range(max(0, start + 1 - len(s.prompt_ids)), len(s.output_ids)):
            ids.append(s.top_ids[j][:m])
            logprobs.append(s.top_logprobs[j][:m])
    return torch.tensor(ids, device=device), torch.tensor(logprobs, device=device)


def teacher_top(
    target_logits: torch.Tensor, predicts: torch.Tensor, top_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-m at the marked positions from a teacher forward: (ids [n, m],
    logits [n, m]; renormalised over the m, the same as log-probabilities)."""
    values, ids = target_logits[predicts].float().topk(top_m, dim=-1)
    return ids, values


def next_tokens(input_ids: torch.Tensor, predicts: torch.Tensor) -> torch.Tensor:
    """The token after each marked position [n], in collate's order."""
    return input_ids[:, 1:][predicts[:, :-1]]


def labels_of(
    seqs: list[Sequence], input_ids: torch.Tensor, predicts: torch.Tensor, top_ids: torch.Tensor
) -> torch.Tensor:
    """The CE's label at each marked position [n]: the next token of the sequence, or on a
    sequence the drafter wrote (on_policy) the target's greedy token there (top_ids[:, 0],
    from a teacher forward)."""
    following = next_tokens(input_ids, predicts)
    own = torch.tensor([s.on_policy for s in seqs], device=input_ids.device)
    rows = predicts.nonzero()[:, 0]  # the sequence of each marked position
    return torch.where(own[rows], top_ids[:, 0], following)


def losses(
    draft_logits: torch.Tensor,  # [b, t, vocab]
    top: tuple[torch.Tensor, torch.Tensor],  # the target's top-m ids, scores [n, m]
    input_ids: torch.Tensor,  # [b, t]
    predicts: torch.Tensor,  # [b, t] bool
    labels: torch.Tensor | None = None,  # [n]; None: the sequences' own next tokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy on the labels, top-m KL(target || draft))."""
    if labels is None:
        labels = next_tokens(input_ids, predicts)
    draft = draft_logits[predicts].float().log_softmax(-1)  # [n, vocab]
    ce = F.nll_loss(draft, labels)
    top_ids, scores = top
    if top_ids.shape[0] != draft.shape[0]:
        raise ValueError(f"{top_ids.shape[0]} rows of the target's top-m for {draft.shape[0]}")
    target_top = scores.float().log_softmax(-1)  # renormalised over the top m
    kl = (target_top.exp() * (target_top - draft.gather(-1, top_ids))).sum(-1).mean()
    return ce, kl


@torch.no_grad()
def agreement(
    draft,
    target,
    seqs: list[Sequence],
    settings: TrainSettings,
    device,
    temperature: float,
    draft_logits=None,
) -> Agreement:
    """Teacher-forced agreement of the drafter with the target over `seqs`. The drafter's
    logits at the predicting positions come from one forward per batch, or from
    `draft_logits(ids, attn, predicts)` when given."""
    draft.eval()
    hits = overlap = 0.0
    n = 0
    size = settings.batch_size
    for i in range(0, len(seqs), size):
        ids, attn, predicts = collate(seqs[i : i + size], settings.max_length, 0, device)
        if draft_logits is None:
            d = draft(input_ids=ids, attention_mask=attn).logits[predicts].float()
        else:
            d = draft_logits(ids, attn, predicts).float()
        t = target(input_ids=ids, attention_mask=attn).logits[predicts].float()
        hits += (d.argmax(-1) == t.argmax(-1)).sum().item()
        p = (t / temperature).softmax(-1)
        q = (d / temperature).softmax(-1)
        overlap += torch.minimum(p, q).sum(-1).sum().item()
        n += int(predicts.sum())
    return Agreement(hits / max(n, 1), overlap / max(n, 1), n)


def token_by_token(model):
    """Logits at the predicting positions as a drafter computes them while drafting: the
    prompt in one call, then each output token in a call of its own (a KV cache between
    them). Under int8 this is what the drafter serves: dynamic quantization rounds a
    call's activations with one scale, so one forward over a whole sequence rounds
    coarser than drafting does (a distilled 0.5B drafter, 2026-11-26: 0.712 teacher-forced
    greedy agreement as int8 in whole-sequence calls, against 0.807 in bfloat16; served
    int8, it accepts as much as in bfloat16)."""

    def logits(ids, attn, predicts):
        out = []
        for b in range(ids.shape[0]):
            where = predicts[b].nonzero()[:, 0].tolist()
            if not where:
                continue
            first, last = where[0], where[-1]
            step = model(input_ids=ids[b : b + 1, : first + 1], use_cache=True)
            rows, cache = [step.logits[0, -1]], step.cache
            for p in range(first + 1, last + 1):
                step = model(input_ids=ids[b : b + 1, p : p + 1], cache=cache,
                             use_cache=True)  # fmt: skip
                rows.append(step.logits[0, -1])
                cache = step.cache
            out.append(torch.stack(rows))
        return torch.cat(out)

    return logits


def int8_agreement(
    draft, target, seqs: list[Sequence], settings: TrainSettings, device, temperature: float
) -> Agreement | None:
    """With --quant-aware int8: the agreement of the drafter as it serves with --quantize
    int8 (a float32 CPU copy through the drafter's own quantizer, token by token);
    None otherwise."""
    if settings.quant_aware != "int8":
        return None
    import copy

    from specdec.drafter.quantize import quantize_model

    int8 = quantize_model(copy.deepcopy(draft).to("cpu", dtype=torch.float32), "int8")
    where = next(target.parameters()).device  # int8 runs on the CPU only
    try:
        return agreement(
            int8, target.to("cpu"), seqs, settings, "cpu", temperature, token_by_token(int8)
        )
    finally:
        target.to(where)


def _decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: no model.layers (a decoder-only transformers model "
            "such as Llama or Qwen2 is expected)"
        )
    return layers


def prepare(draft, settings: TrainSettings):
    """Freeze what does not train; LoRA adapters when asked. Returns the model to train."""
    layers = parse_layers(settings.train_layers, len(_decoder_layers(draft)))
    for p in draft.parameters():
        p.requires_grad_(False)
    if settings.lora_rank:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=0.0,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            layers_to_transform=layers,
            init_lora_weights=True,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)
            draft = get_peft_model(draft, config)
    else:
        decoder = _decoder_layers(draft)
        for i in layers:
            for p in decoder[i].parameters():
                p.requires_grad_(True)
        norm = getattr(draft.model, "norm", None)
        if norm is not None:
            for p in norm.parameters():
                p.requires_grad_(True)
    if settings.train_head:
        for p in draft.get_output_embeddings().parameters():
            p.requires_grad_(True)
    return draft


def parent_weights_dtype(draft_path: str) -> torch.dtype:
    """The dtype the drafter's checkpoint is stored in (its config's), float32 if unsaid:
    the distilled drafter is saved the same way, whatever dtype it trained in."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(draft_path)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return DTYPES.get(str(dtype).replace("torch.", ""), torch.float32)


def trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(path: Path, model, optimizer, step: int, settings: TrainSettings) -> None:
    state = {
        "settings": asdict(settings),
        "step": step,
        "weights": {n: p.detach().cpu() for n, p in trainable(model).items()},
        "optimizer": optimizer.state_dict(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a crash mid-save leaves the previous checkpoint


def load_checkpoint(path: Path, model, optimizer, settings: TrainSettings) -> int:
    """Restore a checkpoint of the same settings; returns its step."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["settings"] != asdict(settings):
        # More --steps may be asked of a run; everything else must be what it was.
        changed = sorted(
            k
            for k, v in asdict(settings).items()
            # a setting added since the checkpoint was saved counts as its default
            if k != "steps" and state["settings"].get(k, _DEFAULTS[k]) != v
        )
        if changed:
            raise ValueError(
                f"{path}: saved with other settings ({', '.join(changed)}); use the same "
                "flags to resume, or a new --out"
            )
    params = trainable(model)
    if set(state["weights"]) != set(params):
        raise ValueError(f"{path}: its weights are not this model's trainable ones")
    with torch.no_grad():
        for n, w in state["weights"].items():
            params[n].copy_(w)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def peak_memory_mb() -> float:
    """The process's peak resident memory (ru_maxrss, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def weights_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(directory.glob("*.safetensors")):
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def distill(
    *,
    target_path: str,
    draft_path: str,
    train: list[Sequence],
    held: list[Sequence],
    out: Path,
    settings: TrainSettings,
    device: str = "cpu",
    dtype: str = "float32",
    teacher_dtype: str | None = None,
    resume: bool = False,
    save_every: int = 50,
    eval_temperature: float = 1.0,
    version: str | None = None,
    progress: bool = True,
    data_note: dict | None = None,
) -> dict:
    """Train, measure before/after on `held`, write the drafter to `out`; the report."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    settings.check()
    state_dir = out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = state_dir / "checkpoint.pt"
    if checkpoint.exists() and not resume:
        raise ValueError(f"{checkpoint} exists: pass --resume to continue it, or a new --out")
    torch.manual_seed(settings.seed)
    target = (
        AutoModelForCausalLM.from_pretrained(target_path, dtype=DTYPES[teacher_dtype or dtype])
        .to(device)
        .eval()
    )
    for p in target.parameters():
        p.requires_grad_(False)
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=DTYPES[dtype]).to(device)
    parent_dtype = parent_weights_dtype(draft_path)  # what the output is saved in
    t_vocab = target.get_output_embeddings().weight.shape[0]
    d_vocab = draft.get_output_embeddings().weight.shape[0]
    if t_vocab != d_vocab:
        raise ValueError(
            f"the target's output has {t_vocab} logits, the drafter's {d_vocab}: distill "
            "needs one vocabulary"
        )
    if settings.top_m > t_vocab:
        raise ValueError(f"--top-m must be at most the vocabulary ({t_vocab})")

    before = agreement(draft, target, held, settings, device, eval_temperature)
    int8_before = int8_agreement(draft, target, held, settings, device, eval_temperature)
    model = prepare(draft, settings)
    make_quant_aware(model, settings.quant_aware)
    params = trainable(model)
    if not params:
        raise ValueError("nothing to train: --train-layers and --train-head select no weights")
    optimizer = torch.optim.AdamW(params.values(), lr=settings.lr, weight_decay=0.0)
    step = load_checkpoint(checkpoint, model, optimizer, settings) if checkpoint.exists() else 0
    pad_id = 0
    tokens = 0
    recorded_batches = 0  # batches whose KL target was recorded (no teacher forward)
    last = {"ce": float("nan"), "kl": float("nan")}
    bar = tqdm(
        total=settings.steps, initial=step, desc="distill", unit="step", disable=not progress
    )
    model.train()
    while step < settings.steps:
        batch = [train[i] for i in batches(len(train), settings.batch_size, settings.seed, step)]
        ids, attn, predicts = collate(batch, settings.max_length, pad_id, device)
        top = recorded_top(batch, settings.max_length, settings.top_m, device)
        if top is None:
            with torch.no_grad():
                target_logits = target(input_ids=ids, attention_mask=attn).logits
            top = teacher_top(target_logits, predicts, settings.top_m)
        else:
            recorded_batches += 1
        draft_logits = model(input_ids=ids, attention_mask=attn).logits
        labels = labels_of(batch, ids, predicts, top[0])
        ce, kl = losses(draft_logits, top, ids, predicts, labels)
        loss = settings.ce_weight * ce + settings.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        optimizer.step()
        step += 1
        tokens += int(predicts.sum())
        last = {"ce": ce.item(), "kl": kl.item()}
        bar.set_postfix(ce=f"{last['ce']:.3f}", kl=f"{last['kl']:.3f}")
        bar.update(1)
        if step % save_every == 0 or step == settings.steps:
            save_checkpoint(checkpoint, model, optimizer, step, settings)
    bar.close()
    model.eval()
    undo_quant_aware(model)
    if settings.lora_rank:
        model = model.merge_and_unload()  # plain weights: the drafter serves a checkpoint
    after = agreement(model, target, held, settings, device, eval_temperature)
    int8_after = int8_agreement(model, target, held, settings, device, eval_temperature)

    model.to("cpu", dtype=parent_dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(draft_path).save_pretrained(out)
    version = check_version(version) if version else f"distill-{weights_digest(out)[:12]}"
    report = {
        "version": version,
        "parent_model": str(draft_path),
        "parent_version": read_model_version(draft_path),
        "target_model": str(target_path),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": asdict(settings),
        "data": {
            **(data_note or {}),
            "train_sequences": len(train),
            "held_out_sequences": len(held),
            "train_sequences_with_recorded_top": sum(s.top_ids is not None for s in train),
            "train_sequences_on_policy": sum(s.on_policy for s in train),
        },
        "held_out": {
            "positions": after.positions,
            "eval_temperature": eval_temperature,
            "before": before.figures(),
            "after": after.figures(),
            **(
                {"int8_before": int8_before.figures(), "int8_after": int8_after.figures()}
                if int8_after
                else {}
            ),
        },
        "cost": {
            "minutes": (time.perf_counter() - started) / 60,
            "trained_positions_this_run": tokens,
            "batches_without_teacher_forward": recorded_batches,
            "peak_rss_mib": peak_memory_mb(),
            "device": device,
            "dtype": dtype,
        },
        "final_losses": last,
    }
    (out / VERSION_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (state_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
