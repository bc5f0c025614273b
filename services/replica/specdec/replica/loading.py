"""Loading a replica's model and tokenizer, and what it learns from them.

``AutoModelForCausalLM.from_pretrained`` on a directory, a hub id or a GGUF file (the
real loading path, tests included) in the dtype asked for (``fastest``: the one measured
fastest here, specdec.replica.calibrate), the tokenizer beside it, and the facts a replica
reports in Info: vocabulary, context, EOS/BOS, chat template, the tokenizer's canonical
JSON and fingerprint. Models whose KV cache cannot be rolled back exactly, or that cannot
be batched across sessions, are refused with the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specdec.common.settings import ConfigError, env_name
from specdec.replica import calibrate, packing
from specdec.replica.config import ReplicaConfig
from specdec.replica.cpus import thread_budget
from specdec.sdk.request import Sampling

if TYPE_CHECKING:
    from transformers import (
        GenerationConfig,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )
    from transformers.cache_utils import Cache

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log_libraries_as_json() -> None:
    """A replica writes JSON lines only (specdec.common.logs). transformers and
    huggingface_hub write progress bars (weight loading) and warnings to stderr on their
    own: turn the bars off and send their records, and Python warnings, through the root
    logger instead."""
    import huggingface_hub.utils
    from transformers.utils import logging as hf_logging

    logging.captureWarnings(True)
    hf_logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


@dataclass(frozen=True)
class LoadedModel:
    """A model on its device, in eval mode, and what its tokenizer and config say."""

    model: Any  # a transformers causal LM
    vocab_size: int  # rows of the output layer
    max_context: int
    eos_token_ids: list[int]
    bos_token_id: int  # -1: none
    chat_template: str
    special_tokens: dict[str, str]  # bos_token, eos_token, ... (chat templates)
    tokenizer_json: bytes  # zlib-compressed canonical JSON
    tokenizer_fingerprint: str  # sha256 of the canonical JSON
    dtype_reason: str = ""  # why the weights are in their dtype (--dtype fastest: measured)
    # What the model's generation_config asks a request's unset sampling fields to be.
    sampling_defaults: Sampling = dataclasses.field(default_factory=lambda: Sampling().resolve())


def load_model(cfg: ReplicaConfig, device: torch.device) -> LoadedModel:
    """The replica's model and tokenizer (blocking), with torch's threads sized first.
    With --tensor-parallel N > 1 every rank calls this together, under torch.distributed
    (specdec.replica.tp), and holds its shard of the model (the model's own tp_plan)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    set_threads(cfg.threads)
    kwargs: dict[str, Any] = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    if cfg.trust_remote_code:
        kwargs["trust_remote_code"] = True
    sharding: dict[str, Any] = {}  # the model's own tensor-parallel plan over the ranks
    if cfg.tensor_parallel > 1:
        from transformers.distributed import DistributedConfig

        sharding["distributed_config"] = DistributedConfig(
            tp_plan="auto", tp_size=cfg.tensor_parallel
        )
    fastest = cfg.dtype == calibrate.FASTEST  # load in float32, keep it or a cast copy
    dtype = "auto" if cfg.dtype == "auto" else DTYPES["float32" if fastest else cfg.dtype]
    # A missing or malformed model is one line naming it (transformers' own error, with
    # its traceback, ends in "Repo id must use alphanumeric chars" for a missing path).
    where = f"--model / {env_name('--model')}"
    expected = (
        "expected a model directory (config.json, weights, tokenizer), the directory of "
        "--gguf-file, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
    )
    path = os.path.expanduser(cfg.model)
    if cfg.model.startswith(("/", ".", "~")) and not os.path.isdir(path):
        raise ConfigError(f"{where}: no such directory {cfg.model!r}; {expected}")
    if os.path.isdir(path) and not cfg.gguf_file and not os.path.isfile(f"{path}/config.json"):
        raise ConfigError(f"{where}: no config.json in {cfg.model!r}; {expected}")
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, **kwargs, **sharding)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, **kwargs)
    except (OSError, ValueError) as e:
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        raise ConfigError(f"{where}: cannot load {cfg.model!r}: {cause}; {expected}") from None
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' decorated .to
    # int8 layers (the drafter's --quantize, applied after loading) have their own kernels
    pack = cfg.pack_weights if getattr(cfg, "quantize", "none") == "none" else "false"
    if fastest:
        # a drafter serving one session at a time runs one-token steps; every other
        # replica runs forwards of several tokens or rows too (calibrate.score)
        one_token = cfg.role == "drafter" and cfg.max_batch_size == 1
        model, choice = calibrate.choose_dtype(
            model, device, pack=pack != "false", one_token=one_token
        )
    else:
        choice = calibrate.asked(cfg.dtype)
    if pack == "true" and not choice.packed:
        why = packing.available(device)
        if why:
            raise ConfigError(f"--pack-weights / {env_name('--pack-weights')}: {why}")
        packing.pack_linears(model)
        choice = dataclasses.replace(
            choice,
            packed=True,
            reason=choice.reason + ", linear weights packed (--pack-weights true)",
        )
    facts = model_facts(cfg, tokenizer, model.config, getattr(model, "generation_config", None))
    return loaded_model(model, facts, choice.summary())


def loaded_model(model: Any, facts: ModelFacts, dtype_reason: str) -> LoadedModel:
    """A loaded model (on its device, in eval mode) with its facts."""
    return LoadedModel(
        model=model,
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_context=facts.max_context,
        eos_token_ids=facts.eos_token_ids,
        sampling_defaults=facts.sampling_defaults,
        bos_token_id=facts.bos_token_id,
        chat_template=facts.chat_template,
        special_tokens=facts.special_tokens,
        tokenizer_json=facts.tokenizer_json,
        tokenizer_fingerprint=facts.tokenizer_fingerprint,
        dtype_reason=dtype_reason,
    )


@dataclass(frozen=True)
class ModelFacts:
    """What a replica reports of its model besides the weights: from the tokenizer, the
    model's config and its generation config."""

    vocab_size: int  # the config's (0: it names none)
    max_context: int
    eos_token_ids: list[int]
    bos_token_id: int  # -1: none
    chat_template: str
    special_tokens: dict[str, str]
    tokenizer_json: bytes  # zlib-compressed canonical JSON
    tokenizer_fingerprint: str
    sampling_defaults: Sampling


def model_facts(
    cfg: ReplicaConfig,
    tokenizer: PreTrainedTokenizerBase,
    config: PretrainedConfig,
    generation_config: GenerationConfig | None,
) -> ModelFacts:
    """The facts of a loaded tokenizer and config (--max-context caps the model's own)."""
    max_context = int(getattr(config, "max_position_embeddings", 0) or cfg.max_context or 0)
    if cfg.max_context:
        max_context = min(max_context or cfg.max_context, cfg.max_context)
    if max_context <= 0:
        raise ValueError(
            f"cannot tell the model's context length; set --max-context for {cfg.model}"
        )
    canonical = canonical_tokenizer_json(tokenizer)
    sources = (generation_config, config)
    return ModelFacts(
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        max_context=max_context,
        eos_token_ids=eos_ids(sources, tokenizer),
        sampling_defaults=generation_sampling(generation_config),
        bos_token_id=-1 if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id),
        chat_template=tokenizer.chat_template or "",
        special_tokens={k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        tokenizer_json=zlib.compress(canonical, 6),
        tokenizer_fingerprint=hashlib.sha256(canonical).hexdigest(),
    )


def load_facts(cfg: ReplicaConfig, gguf: str | os.PathLike[str] | None = None) -> ModelFacts:
    """The model's facts without its weights (an engine that loads the weights itself, the
    llama.cpp engine): the tokenizer, config and generation config of the --model folder,
    else those the GGUF file `gguf` carries."""
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = Path(cfg.model)
    kwargs: dict[str, Any] = {}
    if not (folder.is_dir() and (folder / "config.json").is_file()):
        if gguf is None:
            raise ValueError(f"{cfg.model} is no model folder (config.json) and no GGUF was given")
        folder, kwargs = Path(gguf).parent, {"gguf_file": Path(gguf).name}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    config = AutoConfig.from_pretrained(folder, **kwargs)
    try:
        generation = GenerationConfig.from_pretrained(folder, **kwargs)
    except OSError:  # none saved: the config's
        generation = GenerationConfig.from_model_config(config)
    return model_facts(cfg, tokenizer, config, generation)


def set_threads(requested: int) -> None:
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


def generation_sampling(config: GenerationConfig | None) -> Sampling:
    """The sampling a generation_config asks for, read as transformers' generate() reads it:
    greedy unless do_sample; with do_sample its Sampling.MODEL_FIELDS (temperature 1 and the
    others neutral where it sets none); its repetition_penalty either way (generate()
    applies it greedy too)."""
    if config is None:
        return Sampling().resolve()
    penalty = getattr(config, "repetition_penalty", None)
    if not getattr(config, "do_sample", False):
        return Sampling(temperature=0.0, repetition_penalty=penalty).resolve()
    values: dict[str, Any] = {name: getattr(config, name, None) for name in Sampling.MODEL_FIELDS}
    if values["temperature"] is None:
        values["temperature"] = 1.0
    return Sampling(**values).resolve()


def eos_ids(sources: Sequence[object], tokenizer: object) -> list[int]:
    """The tokens at which `generate()` stops: the generation config's EOS, else the model
    config's, else the tokenizer's (sources: the generation config and the model config,
    either None when absent)."""
    for source in (*sources, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            return [eos]
        if eos:
            return sorted({int(e) for e in eos})
    return []


def check_rollback(cache: Cache, model: str) -> None:
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


def check_batchable(
    model: PreTrainedModel, name: str, remedy: str = "run it with --max-batch-size 1"
) -> None:
    """Batched forwards (and every forward of the paged engine) run the model's decoder,
    then its output head on the kept rows: refuse models whose causal-LM head does more
    than that. remedy: how to run it anyway."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(
            f"{name} caps its logits (final_logit_softcapping); batching across sessions "
            f"does not apply that; {remedy}"
        )
    try:
        model.get_decoder()
    except (AttributeError, ValueError) as e:
        raise ValueError(
            f"{name}: cannot find the decoder of {type(model).__name__} ({e}); batching "
            f"across sessions needs it; {remedy}"
        ) from None


def canonical_tokenizer_json(tokenizer: object) -> bytes:
    """The tokenizer as canonical JSON (sorted keys), from its fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no fast (tokenizers) backend; "
            "specdec needs a fast tokenizer so the torch-free gateway can use it"
        )
    return json.dumps(json.loads(backend.to_str()), sort_keys=True, separators=(",", ":")).encode()
