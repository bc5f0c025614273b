"""Packed weights (specdec.replica.packing) on the tiny models: packing and unpacking are
exact inverses, the packed forward is the same function to float32 rounding, tied and
int8 layers are handled, and the settings refuse what cannot be packed."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.common.settings import ConfigError
from specdec.drafter.config import DrafterConfig
from specdec.drafter.quantize import quantize_model
from specdec.replica import packing
from specdec.replica.loading import load_model
from specdec.verifier.config import VerifierConfig

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    packing.available(CPU) is not None, reason=str(packing.available(CPU))
)


def fp32(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_pack_unpack_round_trip_is_exact(test_models, tie):
    model = fp32(test_models.target)
    if tie:  # a tied head: the embeddings' Parameter is the head's
        model.lm_head.weight = model.model.embed_tokens.weight
    want = {k: v.clone() for k, v in model.state_dict().items()}
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert packing.pack_linears(model) == linears > 0 and packing.is_packed(model)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert packing.unpack_linears(model) == linears and not packing.is_packed(model)
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


def test_packed_forward_matches_plain(test_models):
    plain, packed = fp32(test_models.target), fp32(test_models.target)
    packing.pack_linears(packed)
    ids = torch.tensor([[3, 17, 40, 41, 99, 5, 8, 13]])
    with torch.inference_mode():
        a, b = plain(ids).logits, packed(ids).logits
    assert a.shape == b.shape
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_int8_layers_are_not_packed(test_models):
    model = quantize_model(fp32(test_models.draft_small), "int8")
    before = [type(m) for m in model.modules()]
    packing.pack_linears(model)
    assert [type(m) for m in model.modules()] == [
        packing.PackedLinear if t is torch.nn.Linear else t for t in before
    ]
    assert all(type(m) is not torch.nn.Linear for m in model.modules())


def test_pack_weights_true_packs_an_explicit_dtype(test_models):
    cfg = VerifierConfig(
        role="verifier", model=str(test_models.target), pack_weights="true", threads=1
    )
    loaded = load_model(cfg, CPU)
    assert packing.is_packed(loaded.model)
    assert loaded.dtype_reason.endswith("linear weights packed (--pack-weights true)")
    assert loaded.vocab_size == fp32(test_models.target).lm_head.out_features
    plain = load_model(VerifierConfig(role="verifier", model=str(test_models.target)), CPU)
    assert not packing.is_packed(plain.model)  # auto with an explicit dtype: not packed


def _args(parser_owner, *argv):
    parser = argparse.ArgumentParser()
    parser_owner.add_arguments(parser, 50051)
    return parser.parse_args(["--model", "m", *argv])


@pytest.mark.parametrize(
    ("owner", "argv", "message"),
    [
        (VerifierConfig, ("--pack-weights", "yes"), "must be one of ('auto', 'true', 'false')"),
        (VerifierConfig, ("--pack-weights", "true", "--device", "cuda"), "for --device cpu"),
        (DrafterConfig, ("--pack-weights", "true", "--quantize", "int8"), "not both"),
    ],
)
def test_settings_refuse_what_cannot_be_packed(owner, argv, message):
    with pytest.raises(ConfigError, match="--pack-weights") as e:
        owner.from_args(_args(owner, *argv))
    assert message in str(e.value)
