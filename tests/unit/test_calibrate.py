"""`--dtype fastest` (specdec.replica.calibrate): the replica loads float32, times it and a
bfloat16 copy, keeps the faster, and caches the choice. On the tiny random models: no
wall-clock assertions (which dtype wins here is the machine's business), only that the
choice is one of the candidates, the model kept is exactly a load in that dtype, and the
cache is written, reused without a forward, and survives corruption."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.common.config import DTYPES
from specdec.common.cpus import cpu_info
from specdec.replica import calibrate
from specdec.replica.calibrate import DtypeChoice, choose_dtype, fastest_dtype
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


def fake_timings(monkeypatch, **per_dtype) -> list[str]:
    """time_forwards answers per_dtype[dtype name] (ms for n = 1, 8); returns the dtypes
    it was asked for, in order."""
    asked: list[str] = []

    def timed(model, device, sizes=calibrate.SIZES, cache=None):
        assert cache is None or cache.layers[0].keys.dtype == model.dtype
        name = str(model.dtype).removeprefix("torch.")
        asked.append(name)
        return dict(zip(sizes, per_dtype[name], strict=True))

    monkeypatch.setattr(calibrate, "time_forwards", timed)
    return asked


def test_fastest_is_a_replica_dtype():
    assert "fastest" in DTYPES and VerifierConfig(role="verifier", model="m").dtype == "float32"


def test_load_model_fastest_measures_both_and_keeps_one(test_models, cache_dir, forwards):
    cfg = VerifierConfig(role="verifier", model=str(test_models.target), dtype="fastest", threads=1)
    loaded = load_model(cfg, CPU)
    kept = str(loaded.model.dtype).removeprefix("torch.")
    assert kept in ("float32", "bfloat16") and forwards[0] > 0
    assert loaded.dtype_reason.startswith(f"{kept}: ")
    assert "x as long at 8 tokens" in loaded.dtype_reason
    assert cpu_info().bf16_note() in loaded.dtype_reason
    entries = json.loads((cache_dir / "calibration.json").read_text())["entries"]
    (entry,) = entries.values()
    assert entry["dtype"] == kept and entry["key"]["threads"] == 1
    assert set(entry["timings_ms"]) == {"float32", "bfloat16"}
    for timing in entry["timings_ms"].values():
        assert set(timing) == {"1", "8"} and all(ms > 0 for ms in timing.values())
    direct = AutoModelForCausalLM.from_pretrained(test_models.target, dtype=getattr(torch, kept))
    assert_same_model(loaded.model, direct.eval())

    forwards[0] = 0  # a second start-up: the cached choice, not a single forward
    again = load_model(cfg, CPU)
    assert forwards[0] == 0
    assert again.model.dtype == loaded.model.dtype
    assert again.dtype_reason == loaded.dtype_reason + " (calibration cached)"


@pytest.mark.parametrize(
    ("timings", "kept"),
    [
        ({"float32": (10.0, 30.0), "bfloat16": (5.0, 10.0)}, "bfloat16"),
        ({"float32": (10.0, 10.0), "bfloat16": (20.0, 30.0)}, "float32"),
        ({"float32": (10.0, 10.0), "bfloat16": (9.5, 9.5)}, "float32"),  # near tie: float32
    ],
)
def test_kept_model_is_exactly_a_load_in_its_dtype(test_models, monkeypatch, timings, kept):
    asked = fake_timings(monkeypatch, **timings)
    original = fp32(test_models.target)
    model, choice = choose_dtype(original, CPU, threads=1)
    assert asked == ["float32", "bfloat16"] and choice.dtype == kept and not choice.cached
    assert choice.timings_ms == {d: dict(zip((1, 8), t, strict=True)) for d, t in timings.items()}
    direct = AutoModelForCausalLM.from_pretrained(test_models.target, dtype=getattr(torch, kept))
    assert_same_model(model, direct.eval())
    assert (model is original) == (kept == "float32")
    assert_same_model(original, fp32(test_models.target))  # float32 weights untouched


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
    assert asked == ["float32", "bfloat16"]  # measured once
    assert second == DtypeChoice(first.dtype, first.reason, first.timings_ms, first.cpu, True)
    assert model.dtype == torch.bfloat16
    direct = AutoModelForCausalLM.from_pretrained(test_models.target, dtype=torch.bfloat16)
    assert_same_model(model, direct.eval())
    choose_dtype(fp32(test_models.target), CPU, threads=2)  # another key: measured
    choose_dtype(fp32(test_models.draft_small), CPU, threads=1)  # another model shape
    assert len(asked) == 6
    assert len(json.loads((cache_dir / "calibration.json").read_text())["entries"]) == 3
    assert not [p.name for p in cache_dir.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("content", ["{not json", '{"entries": []}', "[1, 2]", ""])
def test_corrupt_cache_is_ignored(test_models, monkeypatch, cache_dir, caplog, content):
    cache_dir.mkdir()
    (cache_dir / "calibration.json").write_text(content)
    asked = fake_timings(monkeypatch, float32=(10.0, 10.0), bfloat16=(20.0, 30.0))
    with caplog.at_level(logging.WARNING, logger="specdec.replica.calibrate"):
        _, choice = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert asked == ["float32", "bfloat16"] and choice.dtype == "float32"
    assert any(r.getMessage() == "calibration cache ignored" for r in caplog.records)
    _, again = choose_dtype(fp32(test_models.target), CPU, threads=1)  # rewritten, whole
    assert again.cached and len(asked) == 2


def test_bad_entry_and_unwritable_cache_are_not_fatal(test_models, monkeypatch, cache_dir):
    asked = fake_timings(monkeypatch, float32=(10.0, 10.0), bfloat16=(20.0, 30.0))
    choose_dtype(fp32(test_models.target), CPU, threads=1)
    data = json.loads((cache_dir / "calibration.json").read_text())
    for entry in data["entries"].values():
        entry["dtype"] = "int3"
    (cache_dir / "calibration.json").write_text(json.dumps(data))
    _, choice = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert not choice.cached and len(asked) == 4
    (cache_dir / "calibration.json").unlink()
    (cache_dir / "calibration.json").mkdir()  # neither readable nor replaceable
    _, choice = choose_dtype(fp32(test_models.target), CPU, threads=1)
    assert not choice.cached and choice.dtype == "float32" and len(asked) == 6


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
    assert set(choice.timings_ms) == {"float32", "bfloat16"}
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
