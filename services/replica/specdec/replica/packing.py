"""Packed weights: a CPU replica's linear layers in oneDNN's blocked layout.

Why. A forward of a few tokens (a verify of k + 1, an SSD branch step, a batch of decodes)
multiplies a [n, in] activation by every [out, in] weight. torch's CPU matmul for a small
n does not stream a weight once for all n rows: on a 2-core Xeon (AVX-512, no bf16 units)
one 8960 x 1536 float32 projection of the Qwen2.5-Coder 1.5B target took 5.5 ms for one
row and 11 ms for four. The same weight reordered once into oneDNN's blocked layout (what
torch.compile's CPU backend does with frozen weights) took 5.9 ms for four rows, and a
whole 4-token forward of the model about one one-token step instead of two
(docs/tune/packed-weights.md, `specdec bench --shapes`).

What. `pack_linears` replaces every `torch.nn.Linear` of a model by a `PackedLinear`
holding the reordered weight (`torch.ops.mkldnn._reorder_linear_weight`) and the bias; the
plain weight is freed layer by layer, so the peak is one layer more than the model. A
tied output head (its weight is the input embeddings') gets a packed copy; the embeddings
keep theirs. `unpack_linears` restores plain layers exactly (`to_dense` of a packed weight
is the original, bit for bit), which lets the calibration measure both and keep one.

The forward is oneDNN's linear over the packed weight: the same dtype and the same
products as torch's matmul, summed in another order, so logits differ in the last bits
(as they do between torch's one-row and several-row matmuls). Greedy output through the
stack on packed float32 weights equals `generate()` on the plain model in the tests.

Which replicas pack: `--pack-weights` (specdec.replica.config). Int8 (`--quantize`) layers
are not `nn.Linear` and keep their own kernels.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

log = logging.getLogger(__name__)
L = TypeVar("L", bound=nn.Module)  # the kind of layer _swap replaces


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight in oneDNN's blocked layout (not a Parameter:
    inference only). `weight` is the packed tensor (its shape and dtype are the
    original's); `unpacked()` gives the plain layer back."""

    def __init__(self, linear: nn.Linear, tied: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # A weight another module holds too (a tied head's embeddings): unpacking gives
        # that Parameter back, so the two stay one tensor.
        self._tied = linear.weight if tied else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            rows, self.weight, self.bias, "none", [], ""
        )
        return y.view(*x.shape[:-1], self.out_features)

    def unpacked(self) -> nn.Linear:
        """The plain layer, bit for bit the one packed."""
        layer = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device="meta",
            dtype=self.weight.dtype,
        )
        if self._tied is not None:
            layer.weight = self._tied
        else:
            layer.weight = nn.Parameter(self.weight.to_dense(), requires_grad=False)
        if self.bias is not None:
            layer.bias = nn.Parameter(self.bias, requires_grad=False)
        return layer

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def available(device: torch.device) -> str | None:
    """None when weights can be packed on this device, else why not."""
    if device.type != "cpu":
        return f"packed weights are for CPUs (oneDNN), not {device.type}"
    return _cpu_packing()


@functools.cache
def _cpu_packing() -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:  # the two ops, on a small weight
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), weight, None, "none", [], "")
    except (RuntimeError, AttributeError) as e:  # an op missing from this build
        return f"oneDNN linear packing failed here: {e}"
    return None


def _swap(model: nn.Module, kind: type[L], make: Callable[[L], nn.Module]) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:  # exactly: subclasses (quantized layers) keep theirs
                setattr(parent, name, make(child))
                count += 1
    return count


@torch.inference_mode()
def pack_linears(model: nn.Module) -> int:
    """Replace the model's `nn.Linear` layers by `PackedLinear` in place; how many."""
    held = {  # weights of other modules (embeddings a head is tied to)
        id(p)
        for m in model.modules()
        if type(m) is not nn.Linear
        for p in m.parameters(recurse=False)
    }
    return _swap(model, nn.Linear, lambda layer: PackedLinear(layer, id(layer.weight) in held))


@torch.inference_mode()
def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears` in place; how many layers were restored."""
    return _swap(model, PackedLinear, PackedLinear.unpacked)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
