"""Device-to-host copies in one transfer.

On a GPU every copy to the host (``.item()``, ``.tolist()``, ``.cpu()``, ``int(t)``)
waits for the device to finish everything queued before it: the host stops feeding the
device until then. A model call (a Draft, a Verify, a Speculate) therefore keeps its
results on the device while it works and copies them to the host once, at its end,
through `to_host`. tests/unit/test_transfers.py counts the copies of each call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Called with the results of every to_host (tests/unit/test_transfers.py counts transfers).
observer: Callable[[list[torch.Tensor]], None] | None = None


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU, bit for bit, after a single device-to-host copy: their
    bytes are packed into one buffer, copied, and unpacked (each keeps its dtype and
    shape). Tensors already on the CPU are returned as they are (contiguous)."""
    if all(t.device.type == "cpu" for t in tensors):
        out = [t.contiguous() for t in tensors]
    else:
        out = packed_copy(tensors, lambda buffer: buffer.cpu())
    if observer is not None:
        observer(out)
    return out


def packed_copy(
    tensors: Sequence[torch.Tensor], copy: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """Pack the tensors' bytes into one buffer, copy it with `copy`, unpack the copy."""
    parts, sizes = [], []
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        sizes.append(raw.numel())
        pad = -raw.numel() % 8  # each part starts 8-byte aligned, so it views as its dtype
        parts += [raw, raw.new_zeros(pad)] if pad else [raw]
    host = copy(torch.cat(parts))  # the one transfer
    out, start = [], 0
    for t, size in zip(tensors, sizes, strict=True):
        out.append(host[start : start + size].view(t.dtype).reshape(t.shape))
        start += size + (-size % 8)
    return out
