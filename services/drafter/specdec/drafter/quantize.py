"""Weight quantization of a drafter's model (``--quantize``); the verifier never uses it.

``int8``: every ``nn.Linear`` (attention and MLP projections, and the output head) gets int8
weights, one scale per output channel, through torch's dynamic quantization
(``torch.ao.quantization.quantize_dynamic``): at each matmul the activations are quantized
to int8 on the fly and the product runs as an int8 GEMM (fbgemm / oneDNN on x86). The
activations between the matmuls, the embeddings and the norms stay float32, which is why
``int8`` needs ``--dtype float32``. A drafter with rounded weights proposes different tokens
now and then: only the acceptance rate can change, never the output, since the verifier
checks every draft token against the target (docs/design.md section 2).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

QUANTIZE_MODES = ("none", "int8")
Model = TypeVar("Model", bound="PreTrainedModel")


def check_quantize(mode: str, dtype: str, device: str) -> str | None:
    """Why `mode` cannot run with this dtype and device (None: it can)."""
    if mode not in QUANTIZE_MODES:
        return f"must be one of {QUANTIZE_MODES}"
    if mode == "int8" and dtype != "float32":
        return (
            f"int8 needs --dtype float32 (its int8 matmuls take float32 activations), "
            f"got --dtype {dtype}"
        )
    if mode == "int8" and device != "cpu":
        return f"int8 runs on the CPU only (torch's dynamic quantization), got --device {device}"
    return None


def quantize_model(model: Model, mode: str) -> Model:
    """Quantize `model` in place as `mode` says and return it (a float32 CPU model for int8)."""
    if mode == "none":
        return model
    if mode != "int8":
        raise ValueError(f"unknown quantization {mode!r}; expected one of {QUANTIZE_MODES}")
    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if model.dtype != torch.float32:
        raise ValueError(f"int8 quantization needs a float32 model, got {model.dtype}")
    with warnings.catch_warnings():
        # torch marks torch.ao.quantization deprecated (in favour of torchao) but 2.13 still
        # ships and runs it; the warnings say nothing about this use.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantize_dynamic(
            model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )
    if not any(_is_dynamic_int8(m) for m in model.modules()):
        raise RuntimeError("int8 quantization changed no layer of the model (no nn.Linear?)")
    return model


def _is_dynamic_int8(module: torch.nn.Module) -> bool:
    from torch.ao.nn.quantized.dynamic import Linear

    return isinstance(module, Linear)


def quantized_layers(model: torch.nn.Module) -> int:
    """How many layers of `model` run int8 matmuls."""
    return sum(1 for m in model.modules() if _is_dynamic_int8(m))
