"""``--dtype fastest``: the weights' dtype (and layout) a replica runs fastest in here,
measured once.

Whether bfloat16 beats float32 depends on the hardware, not on the model. On a CPU with
bf16 matrix units (AMX, AVX-512 BF16) and on CUDA a bf16 forward is faster; on one without
them (AVX2 or plain AVX-512) a bf16 forward of several tokens is compute-bound in software
conversions and much slower than float32. CPU flags alone do not settle it (the kernels
torch picks, the memory bandwidth, the thread count all count), so `choose_dtype` measures:

- the model is loaded in float32 once (never reloaded from disk);
- after a cached prefix of PREFIX_TOKENS tokens it times forwards of 1 and of 8 tokens
  (batch 1, the decode and verify range), a warm-up then the median of a few repetitions,
  on the replica's device with its threads (`time_forwards`: a few seconds for a 1.5B
  model on one core);
- then a copy cast to bfloat16 (and float16 on CUDA), timed the same way after the same
  prefix (made once, its cache cast). The copy's weights are the float32 weights cast,
  as ``from_pretrained(dtype=...)`` gives them;
- on a CPU with oneDNN (unless --pack-weights false), each candidate's linear layers are
  then packed in place (specdec.replica.packing) and timed again (``float32+packed``,
  ``bfloat16+packed``); unpacking restores them bit for bit when that is slower, and
  the float32 model is left as it was unless it is kept;
- it keeps the candidate that costs the replica least (`score`: t(1) + t(8), since a
  verifier verifies several tokens a row and any replica that batches runs forwards of
  several rows, which cost like a row of as many tokens; t(1) alone for a drafter that
  serves one session at a time, `--max-batch-size 1`, whose forwards are one-token draft
  steps): a float32 one unless another is more than FP32_MARGIN cheaper (float32 is
  exact, so a near tie goes to it), and frees the others.

The choice is cached in ``$SPECDEC_CACHE_DIR/calibration.json`` (default
``~/.cache/specdec/calibration.json``), keyed by the CPU (model name and the flags that
matter), torch's version, the device, the thread count, the model's shape, the price
(`one_token`) and whether packing was a candidate, so the next start-up on the same machine reuses it
without measuring. A corrupt or unwritable cache is
ignored with a warning.

`fastest_dtype` gives the choice for a model path (from the cache, or by loading and
measuring): `specdec bench` runs its in-process transformers baselines in it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdec.replica import packing
from specdec.replica.cpus import cpu_info, thread_budget

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

FASTEST = "fastest"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFIX_TOKENS = 32  # cached before the timed forwards
SIZES = (1, 8)  # tokens a timed forward feeds
REPEATS = 3  # timed forwards per size at least (median), after one warm-up
MAX_REPEATS = 25  # cheap forwards (a small model) repeat until MIN_S, up to this many
MIN_S = 0.2
BUDGET_S = 1.0  # a size stops repeating once its forwards took this long (at least one)
WARMUP_S = 0.25  # a first forward this slow is a sample, not a discarded warm-up
# Another dtype replaces float32 only when its t(1) + t(8) is this much smaller: float32 is
# exact (greedy output equals the float32 reference), so a near tie goes to it.
FP32_MARGIN = 0.10
CACHE_VERSION = 3  # bump when what is measured changes: older entries are then ignored
PACKED = "+packed"  # the suffix of a candidate whose linear layers are packed


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype kept, why, and what was measured.

    timings_ms: per candidate dtype, the median milliseconds of a forward of n tokens
    ({"float32": {1: ..., 8: ...}, ...}); empty when the dtype was asked for, not measured.
    cached: the choice came from the calibration cache (nothing was measured now).
    """

    dtype: str
    reason: str
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    cpu: str = ""
    cached: bool = False
    packed: bool = False  # the linear layers' weights are packed (specdec.replica.packing)

    @property
    def label(self) -> str:
        """The candidate kept: its dtype, `+packed` when packed."""
        return self.dtype + (PACKED if self.packed else "")

    def summary(self) -> str:
        """The reason, saying where a cached choice came from (for Info and logs)."""
        return self.reason + (" (calibration cached)" if self.cached else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "reason": self.reason,
            "timings_ms": {
                d: {str(n): ms for n, ms in t.items()} for d, t in self.timings_ms.items()
            },
            "cpu": self.cpu,
            "packed": self.packed,
        }

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> DtypeChoice:
        if entry.get("dtype") not in DTYPES or not isinstance(entry.get("reason"), str):
            raise ValueError(f"not a calibration entry: {entry!r:.200}")
        timings = {
            str(d): {int(n): float(ms) for n, ms in t.items()}
            for d, t in (entry.get("timings_ms") or {}).items()
        }
        packed = entry.get("packed", False)
        if not isinstance(packed, bool):
            raise ValueError(f"not a calibration entry: packed is {packed!r:.50}")
        cpu = str(entry.get("cpu", ""))
        return cls(entry["dtype"], entry["reason"], timings, cpu, True, packed)


def asked(dtype: str) -> DtypeChoice:
    """The choice of a replica started with an explicit --dtype (nothing measured)."""
    if dtype == "auto":
        return DtypeChoice("auto", "as stored in the checkpoint (--dtype auto)")
    return DtypeChoice(dtype, f"{dtype}: as asked (--dtype {dtype})")


# -- the hardware ------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    return device.type


def candidates(device: torch.device) -> tuple[str, ...]:
    """The dtypes measured on this device (float32 first)."""
    if device.type == "cuda":
        bf16 = ("bfloat16",) if torch.cuda.is_bf16_supported() else ()
        return ("float32", *bf16, "float16")
    return ("float32", "bfloat16")


# -- the cache ---------------------------------------------------------------------------


def cache_path() -> Path:
    """$SPECDEC_CACHE_DIR/calibration.json, default ~/.cache/specdec/calibration.json."""
    root = os.environ.get("SPECDEC_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "specdec"
    )
    return Path(root) / "calibration.json"


def model_signature(config: PretrainedConfig) -> str:
    """A hash of the model's shape: what a forward costs depends on it, not on the weights."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = {
        k: getattr(text, k, None)
        for k in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
        )
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def cache_key(config: PretrainedConfig, device: torch.device, threads: int) -> dict[str, Any]:
    cpu = cpu_info()
    return {
        "version": CACHE_VERSION,
        "cpu": cpu.name,
        "flags": list(cpu.flags),
        "torch": torch.__version__,
        "device": device_name(device),
        "threads": threads,
        "model": model_signature(config),
    }


def _entry_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries by id; {} when it is missing, unreadable or corrupt (warned)."""
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if not isinstance(entries, dict):
            raise ValueError("entries is not an object")
        return entries
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning(
            "calibration cache ignored",
            extra={"path": str(path), "why": f"{type(e).__name__}: {e}"},
        )
        return {}


def cached_choice(
    config: PretrainedConfig,
    device: torch.device,
    threads: int,
    pack: bool = True,
    one_token: bool = False,
) -> DtypeChoice | None:
    """The cached choice for this model shape, device and thread count, with packed weights
    a candidate or not, priced as `choose_dtype` prices it, if any."""
    return _cached(_key(config, device, threads, pack, one_token))


def _key(
    config: PretrainedConfig, device: torch.device, threads: int, pack: bool, one_token: bool
) -> dict[str, Any]:
    pack = pack and packing.available(device) is None
    return {**cache_key(config, device, threads), "pack": pack, "one_token": one_token}


def _cached(key: dict[str, Any]) -> DtypeChoice | None:
    path = cache_path()
    entry = _read_cache(path).get(_entry_id(key))
    if entry is None:
        return None
    try:
        return DtypeChoice.from_json(entry)
    except (ValueError, TypeError, AttributeError) as e:
        log.warning("calibration cache entry ignored", extra={"path": str(path), "why": str(e)})
        return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside the cache (the drafter and the verifier start together)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: last writer wins
        yield
        return
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store_choice(choice: DtypeChoice, key: dict[str, Any]) -> None:
    """Add the choice to the cache (read, add, write a temporary file, rename); a failure
    is warned, never raised."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            entries = _read_cache(path)
            entries[_entry_id(key)] = {
                "key": key,
                **choice.to_json(),
                "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as e:
        log.warning("calibration cache not written", extra={"path": str(path), "why": str(e)})


# -- measuring ---------------------------------------------------------------------------


# The models here are transformers causal LMs, typed Any: what is read of them (config,
# input embeddings' weight, the forward's keyword arguments) transformers types loosely.


def cast_copy(model: Any, dtype: torch.dtype) -> Any:
    """A copy of `model` whose parameters are `model`'s cast to dtype, as loading in that
    dtype gives them (buffers computed at init, such as rotary frequencies, stay as they
    are, as they do there). `model` is not touched; the float32 tensors are never copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():  # tied weights are one Parameter: cast once, still tied
        if p.is_floating_point():
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    persistent = set(model.state_dict(keep_vars=True).keys())
    for name, b in model.named_buffers():  # saved buffers are loaded in the dtype too
        if name in persistent and b.is_floating_point():
            memo[id(b)] = b.detach().to(dtype)
    out = copy.deepcopy(model, memo)
    for config in {id(c): c for c in (out.config, out.config.get_text_config())}.values():
        config.dtype = dtype
    return out


def _can_cast(model: Any, dtype: torch.dtype) -> bool:
    """False when loading in dtype would keep some modules in float32 (transformers'
    keep_in_fp32 lists): a plain cast would not give the same model, so it is not tried."""
    plan = getattr(model, "_get_dtype_plan", None)
    return not (plan and plan(dtype))


def prefix_cache(model: Any, device: torch.device) -> Any:
    """A KV cache holding PREFIX_TOKENS tokens. What a forward after it costs does not
    depend on the cached values, so one token is fed and its keys and values repeated to
    PREFIX_TOKENS positions (a 32-token forward would cost more than the measurement);
    where the cache is not laid out as expected, the whole prefix is fed."""
    from transformers import DynamicCache

    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = (torch.arange(PREFIX_TOKENS, device=device) * 7919 + 11) % vocab  # [prefix]
    cache: Any = DynamicCache(config=model.config)  # its layers' layout: see _layers
    with torch.inference_mode():
        model(input_ids=ids[:1].view(1, 1), cache=cache, use_cache=True)
        if _layers(cache) and cache.get_seq_length() == 1:
            for layer in cache.layers:  # keys, values: [batch, heads, 1, head_dim]
                layer.keys = layer.keys.repeat(1, 1, PREFIX_TOKENS, 1)
                layer.values = layer.values.repeat(1, 1, PREFIX_TOKENS, 1)
            if cache.get_seq_length() == PREFIX_TOKENS:
                return cache
        cache = DynamicCache(config=model.config)
        model(input_ids=ids.view(1, -1), cache=cache, use_cache=True)
    return cache


def _layers(cache: object) -> bool:
    """The cache's layers hold `keys` and `values` tensors [batch, heads, seq, head_dim]."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(
        isinstance(getattr(x, a, None), torch.Tensor) and getattr(x, a).dim() == 4
        for x in layers
        for a in ("keys", "values")
    )


def cast_cache(cache: Any, dtype: torch.dtype) -> Any:
    """A copy of a prefix cache with its keys and values in dtype (the prefix is made once,
    in float32). None when the cache is not laid out as expected (the candidate then makes
    its own)."""
    if not _layers(cache):
        return None
    out = copy.deepcopy(cache)
    for layer in out.layers:
        layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    return out


def time_forwards(
    model: Any, device: torch.device, sizes: Sequence[int] = SIZES, cache: Any = None
) -> dict[int, float]:
    """Median milliseconds of a batch-1 forward of n tokens after a cached prefix (`cache`,
    in the model's dtype, or None: computed here), per n. Per n: a warm-up forward (one
    that took WARMUP_S or more counts as a sample instead: its first-call costs are noise
    there), then REPEATS forwards, more while they took under MIN_S in all (up to
    MAX_REPEATS), fewer once they took BUDGET_S (at least one)."""
    if cache is None:
        cache = prefix_cache(model, device)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = (torch.arange(max(sizes), device=device) * 104729 + 7) % vocab  # [widest]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict[int, float] = {}
    with torch.inference_mode():
        for n in sizes:
            tokens = ids[:n].view(1, n)  # [1, n]
            samples: list[float] = []
            for i in range(1 + MAX_REPEATS):
                sync()
                t0 = time.perf_counter()
                model(input_ids=tokens, cache=cache, use_cache=True)
                sync()
                took = time.perf_counter() - t0
                cache.crop(PREFIX_TOKENS - cache.get_seq_length())
                if i == 0 and took < WARMUP_S:
                    continue  # the warm-up
                samples.append(took)
                spent = sum(samples)
                if spent >= BUDGET_S or (len(samples) >= REPEATS and spent >= MIN_S):
                    break
            out[n] = round(statistics.median(samples) * 1e3, 3)
    return out


def _total(t: dict[int, float]) -> float:
    return sum(t.values())


def _reason(chosen: str, timings: dict[str, dict[int, float]], note: str, one_token: bool) -> str:
    others = [d for d in timings if d != chosen]
    if not others:
        return f"{chosen}: the only layout measured ({note})"
    other = min(others, key=lambda d: score(timings[d], one_token))
    widest, narrowest = max(SIZES), min(SIZES)
    r_wide = timings[other][widest] / timings[chosen][widest]
    r_narrow = timings[other][narrowest] / timings[chosen][narrowest]
    text = (
        f"{chosen}: {other} took {r_wide:.2f}x as long at {widest} tokens and "
        f"{r_narrow:.2f}x at {narrowest} ({note})"
    )
    if chosen.startswith("float32") and score(timings[other], one_token) < score(
        timings[chosen], one_token
    ):
        text += f"; within the {FP32_MARGIN:.0%} margin float32 keeps a near tie by"
    if one_token:
        text += "; priced by its one-token step (one session at a time)"
    return text


def score(timings: dict[int, float], one_token: bool = False) -> float:
    """What a candidate costs a replica: t(1) + t(8), as a replica runs forwards of one
    token (a draft step, k = 0) and of several, a verify of k + 1 or a batch of sessions'
    rows (8 rows of one token cost about what one row of 8 does); with `one_token` (a
    drafter serving one session at a time) t(1), its one-token draft step.

    On a CPU without bf16 units a drafter priced by t(1) alone kept bfloat16 packed: 8
    sessions through `specdec up` then ran its 8-row steps at 4x its one-row step, and k
    = 3 at 8 sessions gave 5.0 tok/s against 7.3 with float32 packed (2026-11-27,
    docs/concepts/engine.md)."""
    return timings[min(SIZES)] if one_token else _total(timings)


def choose_dtype(
    model: Any,
    device: torch.device,
    threads: int | None = None,
    pack: bool = True,
    one_token: bool = False,
) -> tuple[Any, DtypeChoice]:
    """Keep `model` (loaded in float32, on device, in eval mode) or a cast copy, plain or
    with its linear layers packed, whichever costs the replica least here (`score`);
    returns (the model kept, DtypeChoice). Reuses a cached choice without measuring.
    threads: for the cache key (default: torch's intra-op threads). pack: whether packed
    layouts are candidates (where `packing.available`). one_token: price by the one-token
    step alone (a drafter serving one session at a time)."""
    threads = torch.get_num_threads() if threads is None else threads
    if model.dtype != torch.float32:
        raise ValueError(f"--dtype {FASTEST} measures from a float32 model, got {model.dtype}")
    key = _key(model.config, device, threads, pack, one_token)
    pack = key["pack"]
    cpu = cpu_info()
    note = f"on {device_name(device)[5:]}" if device.type == "cuda" else cpu.bf16_note()
    choice = _cached(key)
    if choice is None:
        started = time.monotonic()
        prefix = prefix_cache(model, device)
        timings: dict[str, dict[int, float]] = {}
        kept: dict[bool, tuple[str, Any]] = {}  # float32 or not -> (best label, its model)
        for name in candidates(device):
            dtype = DTYPES[name]
            if name != "float32" and not _can_cast(model, dtype):
                log.info("dtype not measured", extra={"dtype": name, "why": "keep_in_fp32"})
                continue
            trial = model if name == "float32" else cast_copy(model, dtype)
            cache = prefix if name == "float32" else cast_cache(prefix, dtype)
            timings[name] = time_forwards(trial, device, cache=cache)
            label = name
            if pack:  # the same weights packed in place; unpacked (bit for bit) if slower
                packing.pack_linears(trial)
                timings[name + PACKED] = time_forwards(trial, device, cache=cache)
                if score(timings[name + PACKED], one_token) < score(timings[name], one_token):
                    label = name + PACKED
                if label == name or trial is model:  # float32 stays plain: the copies
                    packing.unpack_linears(trial)  # are cast from it (packed again below)
            family = name == "float32"
            if family not in kept or score(timings[label], one_token) < score(
                timings[kept[family][0]], one_token
            ):
                kept[family] = (label, trial)
            del trial, cache
            _free(device)
        best, best_model = kept[True]
        if False in kept:  # another dtype replaces float32 only by more than the margin
            other, other_model = kept[False]
            if score(timings[other], one_token) < score(timings[best], one_token) * (
                1 - FP32_MARGIN
            ):
                best, best_model = other, other_model
            del other_model
        del kept, prefix
        chosen, packed = best.removesuffix(PACKED), best.endswith(PACKED)
        if best_model is model and packed:
            packing.pack_linears(model)
        reason = _reason(best, timings, note, one_token)
        choice = DtypeChoice(chosen, reason, timings, cpu.describe(), packed=packed)
        store_choice(choice, key)
        log.info("dtype measured", extra={"seconds": round(time.monotonic() - started, 2)})
    else:
        best_model = model if choice.dtype == "float32" else cast_copy(model, DTYPES[choice.dtype])
        if choice.packed:
            packing.pack_linears(best_model)
    if best_model is not model:
        del model
        _free(device)
    log.info(
        "dtype chosen",
        extra={
            "dtype": choice.dtype,
            "packed": choice.packed,
            "reason": choice.reason,
            "cached": choice.cached,
            "timings_ms": choice.timings_ms,
            "cpu": choice.cpu,
            "threads": threads,
            "device": str(device),
        },
    )
    return best_model, choice


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fastest_dtype(
    model: str,
    *,
    device: str = "cpu",
    threads: int = 0,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
) -> DtypeChoice:
    """The dtype a replica of `model` started with --dtype fastest on this device with
    `threads` threads (0: the CPUs this process may use) runs in: the cached choice, or
    one measured now (loading the model in float32 here, then freeing it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    dev = torch.device(device)
    count = thread_budget(threads).threads
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        hit = cached_choice(AutoConfig.from_pretrained(model, **kwargs), dev, count)
        if hit is not None:
            return hit
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **kwargs)
        # transformers types PreTrainedModel.to through a decorator mypy misreads
        kept, choice = choose_dtype(loaded.to(dev).eval(), dev, count)  # type: ignore[arg-type]
        del loaded, kept
        _free(dev)
        return choice
    finally:
        torch.set_num_threads(before)


def resolve_dtype(dtype: str, model: str, **kwargs: Any) -> DtypeChoice:
    """`dtype` as given, or with `fastest` the measured choice (`fastest_dtype`)."""
    return fastest_dtype(model, **kwargs) if dtype == FASTEST else asked(dtype)
