"""Quantization-aware distillation (`--quant-aware int8`): the training forward rounds as
the int8 drafter does, and a run trains the int8 form toward the target."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from specdec.cli import main as specdec
from specdec.common.version import VERSION_FILE
from specdec.drafter.quantize import quantize_model
from specdec.tools.distill.quant_aware import (
    fake_activation,
    fake_weight,
    make_quant_aware,
    undo_quant_aware,
)
from specdec.tools.distill.train import TrainSettings, prepare

from .test_distill import distill_args

QAT_MARGIN = 0.1  # held-out int8 agreement gained by a --quant-aware run on the tiny pair


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(48, 32)
        self.b = torch.nn.Linear(32, 24, bias=False)

    @property
    def dtype(self):  # what the drafter's quantizer checks (a transformers model's)
        return self.a.weight.dtype

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _int8(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_model(copy.deepcopy(model), "int8")


def test_weight_rounding_is_torchs_per_channel_int8():
    w = torch.randn(32, 48) * torch.linspace(0.01, 3, 32)[:, None]
    from torch.ao.quantization import default_per_channel_weight_observer

    obs = default_per_channel_weight_observer()
    obs(w)
    scale, zero = obs.calculate_qparams()
    want = torch.fake_quantize_per_channel_affine(w, scale, zero.int(), 0, -128, 127)
    assert torch.allclose(fake_weight(w), want, atol=1e-6)


def test_a_quant_aware_forward_is_the_int8_drafters_forward_token_by_token():
    """One token per call (the drafter's case when drafting): the rounded float forward
    gives the int8 model's output up to float summation order; the float model's
    output differs from both by far more."""
    torch.manual_seed(0)
    model = Tiny()
    int8 = _int8(model)
    qat = copy.deepcopy(model)
    assert make_quant_aware(qat, "int8") == 2
    x = torch.randn(16, 48) * 2
    with torch.no_grad():
        got = torch.cat([qat(r[None]) for r in x])
        want = torch.cat([int8(r[None]) for r in x])
        plain = model(x)
    gap = (got - want).abs().max().item()
    assert gap < 1e-3 * want.abs().max().item()
    assert (plain - want).abs().max().item() > 10 * gap
    undo_quant_aware(qat)
    with torch.no_grad():
        assert torch.equal(qat(x), plain)


def test_activation_rounding_is_dynamic_quantizations_reduce_range():
    x = torch.randn(1, 48) * 3 + 0.5
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    scale = (hi - lo) / 127
    zero = round(-lo / scale)
    want = torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, 127)
    assert torch.allclose(fake_activation(x), want, atol=1e-5)


def test_gradients_pass_straight_through_to_lora_and_full_weights():
    """LoRA adapters and fully trained weights both get gradients through the rounding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    for rank in (0, 4):
        torch.manual_seed(0)
        model = prepare(AutoModelForCausalLM.from_config(config), TrainSettings(lora_rank=rank))
        make_quant_aware(model, "int8")
        model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        # LoRA's B starts at zero, so A's first gradient is zero too: B's is not
        moving = {n: g for n, g in grads.items() if "lora_A" not in n}
        assert moving and all(g is not None and g.abs().sum() > 0 for g in moving.values())


def test_quant_aware_distillation_trains_the_int8_drafter(test_models, tmp_path):
    """--quant-aware int8 on the poor tiny drafter: the report gives the int8 form's
    held-out agreement before and after, and it rises by a clear margin."""
    prompts = tmp_path / "prompts.jsonl"
    from specdec.tools.distill.prompts import bench_prompts, build_prompts, write_prompts

    write_prompts(prompts, build_prompts(48, seed=2, exclude=bench_prompts()))
    out = tmp_path / "qat"
    argv = distill_args(test_models, out, "--prompts", str(prompts), "--quant-aware", "int8")
    argv += ["--steps", "100", "--lr", "3e-3", "--train-head", "--max-new-tokens", "32"]
    assert specdec(argv) == 0
    held = json.loads((out / VERSION_FILE).read_text())["held_out"]
    assert held["int8_after"]["greedy_agreement"] >= (
        held["int8_before"]["greedy_agreement"] + QAT_MARGIN
    )


def test_quant_aware_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="--quant-aware"):
        make_quant_aware(Tiny(), "int4")


def test_token_by_token_logits_are_the_whole_sequence_forwards_in_float32(test_models):
    """The int8 agreement's drafting-shaped forward (the prompt in one call, then one
    token per call) gives a float model's one-forward logits at the same positions."""
    from transformers import AutoModelForCausalLM

    from specdec.tools.distill.data import Sequence
    from specdec.tools.distill.train import collate, token_by_token

    model = AutoModelForCausalLM.from_pretrained(test_models.target).eval()
    seqs = [Sequence((5, 9, 11, 3), (7, 8, 2, 40, 41)), Sequence((4,), (6, 6, 12))]
    ids, attn, predicts = collate(seqs, 64, 0, "cpu")
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=attn).logits[predicts]
        steps = token_by_token(model)(ids, attn, predicts)
    assert steps.shape == whole.shape
    assert torch.allclose(steps, whole, atol=1e-4)
