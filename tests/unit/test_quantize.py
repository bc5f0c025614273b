"""The drafter's --quantize: configuration checks, and int8 weights that really replace the
float32 matmuls (not a no-op) while the model's predictions stay close to the float32 ones."""

from __future__ import annotations

import pytest
import torch

from specdec.cli import build_parser
from specdec.common.settings import ConfigError
from specdec.drafter.config import DrafterConfig
from specdec.drafter.quantize import quantize_model, quantized_layers
from specdec.drafter.runtime import DrafterRuntime
from specdec.replica.engine import Prefix


def drafter(*argv: str) -> DrafterConfig:
    args = build_parser().parse_args(["serve", "drafter", "--model", "m", *argv])
    return DrafterConfig.from_args(args)


def test_quantize_setting(monkeypatch):
    assert drafter().quantize == "none"
    assert drafter("--quantize", "int8").quantize == "int8"  # default dtype float32
    monkeypatch.setenv("SPECDEC_QUANTIZE", "int8")
    assert drafter().quantize == "int8"
    assert drafter("--quantize", "none").quantize == "none"  # the flag wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--quantize", "int4"), r"--quantize / SPECDEC_QUANTIZE: must be one of"),
        (("--quantize", ""), r"--quantize / SPECDEC_QUANTIZE: must be one of"),
        (("--quantize", "int8", "--dtype", "bfloat16"), r"--quantize .*needs --dtype float32"),
        (("--quantize", "int8", "--dtype", "auto"), r"--quantize .*got --dtype auto"),
    ],
)
def test_bad_quantize_names_the_setting(argv, message):
    with pytest.raises(ConfigError, match=message):
        drafter(*argv)


def test_verifier_has_no_quantize():
    """Only the drafter's weights may be rounded: the target's distributions are the
    product, so the verifier does not take the flag at all."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "verifier", "--model", "m", "--quantize", "int8"])


def load(model, quantize: str) -> DrafterRuntime:
    rt = DrafterRuntime(DrafterConfig(role="drafter", model=str(model), quantize=quantize))
    rt.load()
    return rt


def test_int8_replaces_every_linear_and_stays_close(test_models):
    plain = load(test_models.draft_noisy, "none")
    int8 = load(test_models.draft_noisy, "int8")
    try:
        linears = sum(isinstance(m, torch.nn.Linear) for m in plain.model.modules())
        assert linears > 0 and quantized_layers(plain.model) == 0
        assert quantized_layers(int8.model) == linears  # projections and the output head
        assert not any(isinstance(m, torch.nn.Linear) for m in int8.model.modules())
        assert int8.vocab_size == plain.vocab_size and int8.quantize == "int8"
        tokens = list(range(3, 40))
        logits = {}
        for name, rt in (("fp32", plain), ("int8", int8)):
            session, first = rt.extend("s", Prefix(0, 0), tokens[:30], 40)  # [30, vocab]
            rest = rt.forward(session, tokens[30:])  # [7, vocab], through the KV cache
            logits[name] = torch.cat([first, rest])
        diff = (logits["int8"] - logits["fp32"]).abs().max().item()
        scale = logits["fp32"].abs().max().item()
        # Rounded weights: not the same numbers, but close (on this random tiny model 2.7
        # against logits up to 26, and the same argmax at 33 of 37 positions).
        assert 0 < diff < 0.2 * scale
        agree = (logits["int8"].argmax(-1) == logits["fp32"].argmax(-1)).float().mean().item()
        assert agree >= 0.75
    finally:
        plain.shutdown()
        int8.shutdown()


def test_int8_needs_a_float32_model(test_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(test_models.draft_noisy, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs a float32 model"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        quantize_model(model, "int4")
    assert quantize_model(model, "none") is model


def test_quantize_with_a_reduced_vocabulary_is_refused():
    argv = ["serve", "drafter", "--model", "m", "--dtype", "float32", "--quantize", "int8"]
    args = build_parser().parse_args([*argv, "--draft-vocab", "64"])
    with pytest.raises(ConfigError, match="not built yet"):
        DrafterConfig.from_args(args)
