"""Quantization-aware distillation: train the drafter as its int8 form computes.

The int8 drafter (``--quantize int8``, specdec.drafter.quantize) runs every ``nn.Linear``
as torch's dynamic int8 linear: weights rounded per output channel (symmetric, scale
max|w| / 127.5, integers in [-128, 127]) and activations rounded per call (affine, the
0..127 range of fbgemm's reduce_range). Its rounding changes some of its proposals, and
so costs acceptance. With ``--quant-aware int8`` the distillation trains through the same
rounding ("fake quantization", straight-through gradients): each linear layer computes
``x_q @ w_q.T + b`` with ``w_q`` the rounded merged weight (the base plus its LoRA
delta, or the full-fine-tuned weight) and ``x_q`` the rounded input, so the loss is the
int8 drafter's own and the weights move to where their rounded form agrees with the
target. The saved checkpoint holds the unrounded weights; the drafter rounds them when it
loads with ``--quantize int8``, as it does any checkpoint.

Activations are rounded per token (one row at a time), the drafter's case when it drafts
one token per forward; over a prompt's prefill torch rounds the whole call with one scale.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

QUANT_AWARE = ("none", "int8")
W_QMIN, W_QMAX = -128, 127  # qint8, per channel, symmetric
A_QMAX = 127  # quint8 with reduce_range: 0..127


def fake_weight(w: torch.Tensor) -> torch.Tensor:
    """`w` rounded as torch's per-channel int8 weight observer rounds it (computed in
    float32, returned in `w`'s dtype), with a straight-through gradient."""
    with torch.no_grad():
        wf = w.float()
        scale = (wf.abs().amax(dim=1, keepdim=True) / ((W_QMAX - W_QMIN) / 2)).clamp_min(1e-8)
        # times the inverse, as torch rounds: the row's largest weight is a tie at +-127.5
        q = ((wf * (1.0 / scale)).round().clamp(W_QMIN, W_QMAX) * scale).to(w.dtype)
    return w + (q - w).detach()


def fake_activation(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded per row as dynamic quantization (quint8, reduce_range) rounds it."""
    with torch.no_grad():
        xf = x.float()
        lo = xf.amin(dim=-1, keepdim=True).clamp_max(0)
        hi = xf.amax(dim=-1, keepdim=True).clamp_min(0)
        scale = ((hi - lo) / A_QMAX).clamp_min(1e-8)
        zero = (-lo / scale).round().clamp(0, A_QMAX)
        q = ((xf / scale).round() + zero).clamp(0, A_QMAX)
        q = ((q - zero) * scale).to(x.dtype)
    return x + (q - x).detach()


def _linear_forward(self, x):
    w = self.weight
    wq = fake_weight(w) if w.requires_grad else self._specdec_wq(w)
    return F.linear(fake_activation(x), wq, self.bias)


def _lora_forward(self, x, *args, **kwargs):
    base = self.base_layer
    w = base.weight
    for name in self.active_adapters:
        if name in self.lora_A:
            w = w + self.get_delta_weight(name).to(w.dtype)
    return F.linear(fake_activation(x), fake_weight(w), base.bias)


class _FrozenCache:
    """A frozen weight's rounded form, computed once (the output head is 136M weights)."""

    def __init__(self):
        self.key = None
        self.value = None

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        key = (w.data_ptr(), w._version)
        if key != self.key:
            self.key, self.value = key, fake_weight(w.detach())
        return self.value


def make_quant_aware(model, mode: str):
    """Route every linear layer of `model` (after `prepare`) through int8 rounding;
    returns the number of layers changed. LoRA layers (peft) round their merged weight."""
    if mode == "none":
        return 0
    if mode not in QUANT_AWARE:
        raise ValueError(f"--quant-aware must be one of {QUANT_AWARE}, got {mode!r}")
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is needed only with --lora-rank
        LoraLayer = None
    inside_lora = set()
    changed = 0
    for module in model.modules():
        if LoraLayer is not None and isinstance(module, LoraLayer):
            module.forward = types.MethodType(_lora_forward, module)
            module._specdec_qat = True
            inside_lora.add(id(module.base_layer))
            changed += 1
    for module in model.modules():
        if type(module) is torch.nn.Linear and id(module) not in inside_lora:
            module._specdec_wq = _FrozenCache()
            module.forward = types.MethodType(_linear_forward, module)
            module._specdec_qat = True
            changed += 1
    if not changed:
        raise ValueError("--quant-aware: the model has no linear layer to round")
    return changed


def undo_quant_aware(model) -> None:
    """Plain float forwards again (before merging and saving): only the forwards
    make_quant_aware set, not another library's hooks."""
    for module in model.modules():
        if vars(module).pop("_specdec_qat", False):
            del module.forward
            vars(module).pop("_specdec_wq", None)
