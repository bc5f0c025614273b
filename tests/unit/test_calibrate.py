"""`--dtype fastest` (specdec.replica.calibrate): the replica loads float32, times it, a
bfloat16 copy and its own linear layers packed, keeps the fastest, and caches the choice. On the tiny random models: no
wall-clock assertions (which dtype wins here is the machine's business), only that the
choice is one of the candidates, the model kept is exactly a load in that dtype, and the
cache is written, reused without a forward, and survives corruption."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.drafter.config import DrafterConfig
from specdec.replica import calibrate, packing
from specdec.replica.calibrate import DtypeChoice, choose_dtype, fastest_dtype
from specdec.replica.config import DTYPES
from specdec.replica.cpus import cpu_info
from specdec.replica.loading import load_model
from specdec.verifier.config import VerifierConfig

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Each test its own calibration cache, and torch's threads as they were."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield tmp_path / "cache"
    torch.set_num_threads(threads)


@pytest.fixture
def forwards():
    """How many module forwards ran while the test held it: [count]."""
    count = [0]

    def hook(module, args, output):
        count[0] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    yield count
    handle.remove()


def fp32(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_same_model(got, want) -> None:
    """Bitwise: every parameter and buffer, with its dtype, and the config's dtype."""
    assert got.dtype == want.dtype and got.config.dtype == want.config.dtype
    for kind in ("named_parameters", "named_buffers"):
        a, b = dict(getattr(got, kind)()), dict(getattr(want, kind)())
        assert a.keys() == b.keys()
        for name, tensor in a.items():
            assert tensor.dtype == b[name].dtype, name
            assert torch.equal(tensor, b[name]), name
    head, embed = got.get_output_embeddings(), got.get_input_embeddings()
    tied = want.get_output_embeddings().weight is want.get_input_embeddings().weight
    assert (head.weight is embed.weight) == tied


SLOW = (1e6, 1e6)  # packing loses, where a test is about the dtypes


def fake_timings(monkeypatch, packed=None, **per_dtype) -> list[str]:
    """time_forwards answers per_dtype[dtype name] (ms for n = 1, 8), and packed[label]
    for a model with its linear layers packed ("float32+packed": SLOW unless given);
    returns the candidates it was asked for, in order."""
    asked: list[str] = []

    def timed(model, device, sizes=calibrate.SIZES, cache=None):
        assert cache is None or cache.layers[0].keys.dtype == model.dtype
        name = str(model.dtype).removeprefix("torch.")
        if packing.is_packed(model):
            name += calibrate.PACKED
        asked.append(name)
        times = (packed or {}).get(name, SLOW) if name.endswith("+packed") else per_dtype[name]
        return dict(zip(sizes, times, strict=True))

    monkeypatch.setattr(calibrate, "time_forwards", timed)
    return asked


BOTH = ["float32", "float32+packed", "bfloat16", "bfloat16+packed"]  # measured, in order
F32P, BF16P = "float32+packed", "bfloat16+packed"


def test_fastest_is_a_replica_dtype():
    assert "fastest" in DTYPES and VerifierConfig(role="verifier", model="m").dtype == "float32"


def test_load_model_fastest_measures_both_and_keeps_one(test_models, cache_dir, forwards):
    cfg = VerifierConfig(role="verifier", model=str(test_models.target), dtype="fastest", threads=1)
    loaded = load_model(cfg, CPU)
    kept = str(loaded.model.dtype).removeprefix("torch.")
    assert kept in ("float32", "bfloat16") and forwards[0] > 0
    # The layout measured fastest: the dtype, its linear weights packed or not.
    assert loaded.dtype_reason.split(": ")[0] in (kept, f"{kept}+packed")
    assert "x as long at 8 tokens" in loaded.dtype_reason
    assert cpu_info().bf16_note() in loaded.dtype_reason
    entries = json.loads((cache_dir / "calibration.json").read_text())["entries"]
    (entry,) = entries.values()
    assert entry["dtype"] == kept and entry["key"]["threads"] == 1
    assert set(entry["timings_ms"]) == set(BOTH)
    for timing in entry["timings_ms"].values():
        assert set(timing) == {"1", "8"} and all(ms > 0 for ms in timing.values())
    direct = AutoModelForCausalLM.from_pretrained(test_models.target, dtype=getattr(torch, kept))
    # Packed or not is the machine's choice; packed weights unpack bit for bit.
    packed = loaded.dtype_reason.split(": ")[0].endswith(calibrate.PACKED)
    assert packing.is_packed(loaded.model) == packed
    if packed:
        packing.unpack_linears(loaded.model)
    assert_same_model(loaded.model, direct.eval())

    forwards[0] = 0  # a second start-up: the cached choice, not a single forward
    again = load_model(cfg, CPU)
    assert forwards[0] == 0
    assert again.model.dtype == loaded.model.dtype
    assert again.dtype_reason == loaded.dtype_reason + " (calibration cached)"


@pytest.mark.parametrize(
    ("timings", "packed", "kept"),
    [
        ({"float32": (10.0, 30.0), "bfloat16": (5.0, 10.0)}, {}, "bfloat16"),
        ({"float32": (10.0, 10.0), "bfloat16": (20.0, 30.0)}, {}, "float32"),
        ({"float32": (10.0, 10.0), "bfloat16": (9.5, 9.5)}, {}, "float32"),  # near tie
        ({"float32": (10.0, 30.0), "bfloat16": (7.0, 25.0)}, {F32P: (11.0, 12.0)}, F32P),
        # packed float32 keeps a near tie with bfloat16 too, and plain float32 none
        ({"float32": (10.0, 30.0), "bfloat16": (5.0, 10.0)}, {F32P: (8.0, 8.0)}, F32P),
        ({"float32": (10.0, 10.0), "bfloat16": (20.0, 30.0)}, {F32P: (10.0, 10.5)}, "float32"),
        # packed bfloat16 against the best float32, packed or not
        (
            {"float32": (10.0, 30.0), "bfloat16": (7.0, 25.0)},
            {F32P: (11.0, 12.0), BF16P: (4.0, 10.0)},
            BF16P,
        ),
        ({"float32": (10.0, 30.0), "bfloat16": (5.0, 10.0)}, {BF16P: (9.0, 9.0)}, "bfloat16"),
    ],
)
def test_kept_model_is_exactly_a_load_in_its_dtype(test_models, monkeypatch, timings, packed, kept):
    asked = fake_timings(monkeypatch, packed, **timings)
    original = fp32(test_models.target)
    model, choice = choose_dtype(original, CPU, threads=1)
    assert asked == BOTH and choice.label == kept and not choice.cached
    want = {d: dict(zip((1, 8), t, strict=True)) for d, t in timings.items()}
    for label in (F32P, BF16P):
        want[label] = dict(zip((1, 8), packed.get(label, SLOW), strict=True))
    assert choice.timings_ms == want
    assert choice.packed == packing.is_packed(model) == kept.endswith("+packed")
    dtype = getattr(torch, choice.dtype)
    direct = AutoModelForCausalLM.from_pretrained(test_models.target, dtype=dtype)
    packing.unpack_linears(model)  # the plain layers back, bit for bit
    assert_same_model(model, direct.eval())
    assert (model is original) == (choice.dtype == "float32")
    assert_same_model(original, fp32(test_models.target))  # float32 weights untouched


def test_packing_is_not_measured_when_refused(test_models, monkeypatch, cache_dir):
    """--pack-weights false (or int8 layers): only the dtypes, and a cache entry of its own."""
    fast = {F32P: (1.0, 1.0)}
    asked = fake_timings(monkeypatch, fast, float32=(10.0, 30.0), bfloat16=(5.0, 10.0))
    model, choice = choose_dtype(fp32(test_models.target), CPU, threads=1, pack=False)
    assert asked == ["float32", "bfloat16"] and choice.label == "bfloat16"
    assert not packing.is_packed(model)
    _, packed = choose_dtype(fp32(test_models.target), CPU, threads=1)  # another key
    assert asked[2:] == BOTH and packed.label == F32P and not packed.cached


def test_one_session_at_a_time_is_priced_by_the_one_token_step(test_models, monkeypatch):
    """The same timings: a replica that batches keeps the layout cheapest at 1 + 8 tokens
    (its forwards of several rows), a drafter serving one session at a time the one
    cheapest at 1 (its draft steps), each in a cache entry of its own."""
    fake_timings(
        monkeypatch,
        {F32P: (10.0, 11.0), BF16P: (6.0, 40.0)},
        float32=(9.0, 30.0),
        bfloat16=(8.0, 30.0),
    )
    _, verifier = choose_dtype(fp32(test_models.target), CPU, threads=1)
    model, drafter = choose_dtype(fp32(test_models.target), CPU, threads=1, one_token=True)
    assert verifier.label == F32P and drafter.label == BF16P and not drafter.cached
    assert model.dtype == torch.bfloat16 and packing.is_packed(model)
    assert drafter.reason.endswith("priced by its one-token step (one session at a time)")


@pytest.mark.parametrize("max_batch_size, want", [(16, F32P), (1, BF16P)])
def test_a_drafter_that_batches_is_priced_by_several_rows(
    test_models, monkeypatch, max_batch_size, want
):
    """Through the replica's loading: a drafter that batches sessions (the default
    --max-batch-size) runs forwards of several rows, so it is priced like a verifier; only
    --max-batch-size 1 prices it by its one-token step."""
    fake_timings(
        monkeypatch,
        {F32P: (10.0, 11.0), BF16P: (6.0, 40.0)},
        float32=(9.0, 30.0),
        bfloat16=(8.0, 30.0),
    )
    cfg = DrafterConfig(
        role="drafter",
        model=str(test_models.draft_small),
        dtype="fastest",
        threads=1,
        max_batch_size=max_batch_size,
    )
    loaded = load_model(cfg, CPU)
    assert loaded.dtype_reason.startswith(f"{want}: ")
    assert str(loaded.model.dtype) == "torch." + want.removesuffix(calibrate.PACKED)
    assert packing.is_packed(loaded.model)


def test_reason_names_the_ratio_and_the_cpu(test_models, monkeypatch):
    fake_timings(monkeypatch, float32=(10.0, 20.0), bfloat16=(20.0, 52.0))
    _, choice = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert choice.reason == (
        f"float32: bfloat16 took 2.60x as long at 8 tokens and 2.00x at 1 "
        f"({cpu_info().bf16_note()})"
    )
    assert choice.cpu == cpu_info().describe()


def test_cache_is_keyed_and_reused(test_models, monkeypatch, cache_dir):
    asked = fake_timings(monkeypatch, float32=(10.0, 30.0), bfloat16=(5.0, 10.0))
    _, first = choose_dtype(fp32(test_models.target), CPU, threads=1)
    model, second = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert asked == BOTH  # measured once
    assert second == DtypeChoice(first.dtype, first.reason, first.timings_ms, first.cpu, True)
    assert model.dtype == torch.bfloat16
    direct = AutoModelForCausalLM.from_pretrained(test_models.target, dtype=torch.bfloat16)
    assert_same_model(model, direct.eval())
    choose_dtype(fp32(test_models.target), CPU, threads=2)  # another key: measured
    choose_dtype(fp32(test_models.draft_small), CPU, threads=1)  # another model shape
    assert len(asked) == 12
    assert len(json.loads((cache_dir / "calibration.json").read_text())["entries"]) == 3
    assert not [p.name for p in cache_dir.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("content", ["{not json", '{"entries": []}', "[1, 2]", ""])
def test_corrupt_cache_is_ignored(test_models, monkeypatch, cache_dir, caplog, content):
    cache_dir.mkdir()
    (cache_dir / "calibration.json").write_text(content)
    asked = fake_timings(monkeypatch, float32=(10.0, 10.0), bfloat16=(20.0, 30.0))
    with caplog.at_level(logging.WARNING, logger="specdec.replica.calibrate"):
        _, choice = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert asked == BOTH and choice.dtype == "float32"
    assert any(r.getMessage() == "calibration cache ignored" for r in caplog.records)
    _, again = choose_dtype(fp32(test_models.target), CPU, threads=1)  # rewritten, whole
    assert again.cached and len(asked) == 4


def test_bad_entry_and_unwritable_cache_are_not_fatal(test_models, monkeypatch, cache_dir):
    asked = fake_timings(monkeypatch, float32=(10.0, 10.0), bfloat16=(20.0, 30.0))
    choose_dtype(fp32(test_models.target), CPU, threads=1)
    data = json.loads((cache_dir / "calibration.json").read_text())
    for entry in data["entries"].values():
        entry["dtype"] = "int3"
    (cache_dir / "calibration.json").write_text(json.dumps(data))
    _, choice = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert not choice.cached and len(asked) == 8
    (cache_dir / "calibration.json").unlink()
    (cache_dir / "calibration.json").mkdir()  # neither readable nor replaceable
    _, choice = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert not choice.cached and choice.dtype == "float32" and len(asked) == 12


def test_fastest_dtype_reads_what_the_replica_cached(test_models, forwards):
    """The bench's helper: with a replica's choice cached, no model is loaded or run."""
    cfg = VerifierConfig(role="verifier", model=str(test_models.target), dtype="fastest", threads=1)
    kept = load_model(cfg, CPU).model.dtype
    forwards[0] = 0
    choice = fastest_dtype(str(test_models.target), threads=1)
    assert choice.cached and getattr(torch, choice.dtype) == kept and forwards[0] == 0
    assert calibrate.resolve_dtype("bfloat16", "unused").dtype == "bfloat16"
    assert calibrate.resolve_dtype("fastest", str(test_models.target), threads=1) == choice


def test_fastest_dtype_measures_on_a_miss(test_models, forwards, cache_dir):
    choice = fastest_dtype(str(test_models.draft_small), threads=1)
    assert not choice.cached and choice.dtype in ("float32", "bfloat16") and forwards[0] > 0
    assert set(choice.timings_ms) == set(BOTH)
    assert (cache_dir / "calibration.json").exists()


def test_prefix_cache_and_its_cast(test_models):
    model = fp32(test_models.target)
    cache = calibrate.prefix_cache(model, CPU)
    assert cache.get_seq_length() == calibrate.PREFIX_TOKENS
    cast = calibrate.cast_cache(cache, torch.bfloat16)
    assert cast.get_seq_length() == calibrate.PREFIX_TOKENS
    assert {layer.keys.dtype for layer in cast.layers} == {torch.bfloat16}
    assert cache.layers[0].keys.dtype == torch.float32  # the float32 prefix is kept
    timings = calibrate.time_forwards(calibrate.cast_copy(model, torch.bfloat16), CPU, cache=cast)
    assert set(timings) == set(calibrate.SIZES) and cast.get_seq_length() == calibrate.PREFIX_TOKENS
