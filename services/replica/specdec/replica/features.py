"""The target's features: hidden states a verifier returns with its verdict, for a head
drafter that drafts from them (docs/concepts/heads.md, specdec.drafter.head).

A position's feature is the output of each asked decoder layer at that position (the
residual stream after the layer: for the last layer, before the model's final norm, the
state EAGLE's heads read), concatenated in the order asked. They are read with forward
hooks on the decoder layers (`recording`), installed only around a forward that asks for
them, so a forward that does not ask runs exactly as before. transformers'
``output_hidden_states`` is not used: it gives the last layer's state after the final
norm, and every layer's at once.

A job asks by handing `Engine.forward_steps` a `FeatureSink`: each of its forwards appends
the asked layers' outputs at the tokens it fed ([n, width] in the model's dtype, on the
device), the chunks of a long input in order. On the wire (common.proto Features) rows
are float32, float16 or bfloat16, little-endian (`encode_features`, `decode_features`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.common.errors import InvalidRequest
from specdec.v1 import common_pb2

# The wire formats and their torch dtypes.
FORMATS: dict[int, torch.dtype] = {
    common_pb2.FEATURE_FORMAT_FLOAT32: torch.float32,
    common_pb2.FEATURE_FORMAT_FLOAT16: torch.float16,
    common_pb2.FEATURE_FORMAT_BFLOAT16: torch.bfloat16,
}
FORMAT_NAMES = {"float32": 1, "float16": 2, "bfloat16": 3}  # a head's config.json names one
# At most this many bytes of features in one VerifyResponse (half the gRPC message limit):
# past it only the last positions that fit are sent.
MAX_FEATURE_BYTES = 32 << 20


@dataclass(frozen=True)
class FeatureAsk:
    """What a request asks of the target's hidden states (common.proto FeatureRequest),
    validated: its layers in order and the wire format."""

    layers: tuple[int, ...]
    format: int  # common_pb2.FeatureFormat

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.format]

    def to_proto(self) -> common_pb2.FeatureRequest:
        return common_pb2.FeatureRequest(layers=self.layers, format=self.format)  # type: ignore[arg-type]


def ask_from_proto(msg: common_pb2.FeatureRequest, num_layers: int) -> FeatureAsk:
    """A FeatureRequest for a model of num_layers decoder layers, checked
    (InvalidRequest: layers out of range, repeated or none; an unknown format)."""
    layers = tuple(int(i) for i in msg.layers)
    if not layers:
        raise InvalidRequest("features.layers is empty: name at least one decoder layer")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise InvalidRequest(
            f"features.layers holds {bad[0]}, outside the target's decoder layers [0, {num_layers})"
        )
    if len(set(layers)) != len(layers):
        raise InvalidRequest(f"features.layers names a layer twice: {list(layers)}")
    if msg.format not in FORMATS:
        raise InvalidRequest(
            f"features.format {msg.format} is not one of FEATURE_FORMAT_FLOAT32, "
            "FEATURE_FORMAT_FLOAT16, FEATURE_FORMAT_BFLOAT16"
        )
    return FeatureAsk(layers, int(msg.format))


@dataclass
class FeatureSink:
    """Where a job's forwards put the features it asked for: each forward appends the
    asked layers' outputs at the tokens it fed, concatenated [n, width] (model thread)."""

    layers: tuple[int, ...]
    rows: list[torch.Tensor] = field(default_factory=list)  # per forward [n, width]

    def add(self, rows: torch.Tensor) -> None:
        self.rows.append(rows)

    def tensor(self) -> torch.Tensor:
        """Every fed token's feature, in order [tokens, width]."""
        return self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (model.get_decoder().layers)."""
    layers: Sequence[torch.nn.Module] | None = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers to read features from")
    return layers


@contextmanager
def recording(model: Any, layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks on the given decoder layers for one forward: yields a dict that holds
    each layer's output [rows, tokens, hidden] once the forward has run (a layer that
    returns a tuple: its first element). The hooks are removed on exit."""
    outputs: dict[int, torch.Tensor] = {}
    modules = decoder_layers(model)
    handles = []

    def hook(index: int) -> Callable[[torch.nn.Module, tuple[Any, ...], Any], None]:
        def record(
            _module: torch.nn.Module,
            _args: tuple[Any, ...],
            output: torch.Tensor | tuple[torch.Tensor, ...],
        ) -> None:
            outputs[index] = output[0] if isinstance(output, tuple) else output

        return record

    try:
        for i in sorted(set(layers)):
            handles.append(modules[i].register_forward_hook(hook(i)))
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def encode_features(rows: torch.Tensor, start: int, format_: int) -> common_pb2.Features:
    """Rows [n, width] on the host, already in the format's dtype, as Features from
    sequence position `start`."""
    raw = rows.contiguous().view(torch.uint8) if rows.numel() else rows.new_empty(0)
    return common_pb2.Features(
        start=start,
        positions=rows.shape[0],
        width=rows.shape[1] if rows.dim() == 2 else 0,
        format=format_,  # type: ignore[arg-type]
        data=raw.numpy().tobytes(),
    )


def sent_rows(positions: int, width: int, format_: int) -> int:
    """How many of `positions` rows fit MAX_FEATURE_BYTES (the last ones are sent)."""
    per_row = width * FORMATS[format_].itemsize
    return min(positions, MAX_FEATURE_BYTES // max(1, per_row))


def decode_features(msg: common_pb2.Features, width: int, format_: int) -> torch.Tensor:
    """A Features message's rows [positions, width] as a CPU tensor of its format's dtype
    (InvalidRequest when its width or format is not the expected one, or its data is not
    positions x width values)."""
    if msg.format != format_:
        raise InvalidRequest(
            f"features: format {msg.format}, the head reads {common_pb2.FeatureFormat.Name(format_)}"
        )
    if msg.width != width:
        raise InvalidRequest(f"features: width {msg.width}, the head reads {width} values a row")
    dtype = FORMATS[format_]
    expected = msg.positions * width * dtype.itemsize
    if len(msg.data) != expected:
        raise InvalidRequest(
            f"features: {len(msg.data)} bytes of data for {msg.positions} rows of {width} "
            f"{dtype} values ({expected} bytes)"
        )
    if not expected:
        return torch.empty(msg.positions, width, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).view(msg.positions, width)
