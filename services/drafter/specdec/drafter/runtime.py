"""The drafter's model runtime: a ModelRuntime with the drafter-only choices applied.

- ``--quantize int8`` (specdec.drafter.quantize): int8 weights after loading; the
  vocabulary is read from the output layer before its weight is packed.
- ``--draft-vocab`` / ``--draft-vocab-file`` (specdec.drafter.vocab): forwards go through a
  reduced output layer (`ModelRuntime.head`).

The verifier never uses either: the target's distributions are its model's own.
"""

from __future__ import annotations

import logging

import torch

from specdec.common.settings import ConfigError
from specdec.drafter.config import DrafterConfig
from specdec.drafter.quantize import quantize_model
from specdec.drafter.vocab import (
    VOCAB_FLAG,
    ReducedHead,
    read_ranking,
    subset_ids,
    where,
)
from specdec.replica.packing import PackedLinear
from specdec.replica.runtime import ModelRuntime

log = logging.getLogger(__name__)


class DrafterRuntime(ModelRuntime):
    """The drafter's ModelRuntime: int8 weights with --quantize int8, a reduced output
    layer with --draft-vocab or --draft-vocab-file (unchanged otherwise)."""

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        self.quantize = "none"  # --quantize, as applied to the loaded model

    def load(self) -> None:
        super().load()
        cfg = self.config
        assert isinstance(cfg, DrafterConfig)  # the drafter's runtime has its config
        if cfg.quantize != "none":
            self.model = quantize_model(self.model, cfg.quantize)
            log.info("drafter weights quantized", extra={"quantize": cfg.quantize})
        self.quantize = cfg.quantize
        if cfg.draft_vocab or cfg.draft_vocab_file:
            self._reduce_vocabulary()

    def _reduce_vocabulary(self) -> None:
        cfg = self.config
        assert isinstance(cfg, DrafterConfig)  # the drafter's runtime has its config
        ranking = read_ranking(cfg.draft_vocab_file) if cfg.draft_vocab_file else None
        ids = subset_ids(cfg.draft_vocab, ranking, self.vocab_size, self.eos_token_ids)
        layer = self.model.get_output_embeddings()
        if isinstance(layer, PackedLinear):  # the reduced head slices the plain rows
            layer = layer.unpacked()
        if not isinstance(layer, torch.nn.Linear):
            raise ConfigError(
                f"{where(VOCAB_FLAG)}: {cfg.model}'s output layer is a "
                f"{type(layer).__name__}, not a linear layer; a reduced vocabulary needs one"
            )
        self.head = ReducedHead(layer, ids, self.vocab_size)
        self._check_head()
        log.info(
            "reduced draft vocabulary",
            extra={
                "tokens": self.head.size,
                "vocab_size": self.vocab_size,
                "source": cfg.draft_vocab_file or "token id order",
            },
        )

    @torch.inference_mode()
    def _check_head(self) -> None:
        """Refuse a model whose logits are not its base's last hidden state times the
        output layer (final soft-capping, logit scaling): one short forward both ways must
        agree on the subset's entries, up to the rounding of the model's dtype."""
        head = self.head
        assert isinstance(head, ReducedHead)
        ids = torch.tensor([[int(head.ids[0]), int(head.ids[-1])]], device=self.device)  # [1, 2]
        full = self.model(input_ids=ids, use_cache=False).logits[0].float()  # [2, vocab]
        hidden = self.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        reduced = head(hidden[0])  # [2, vocab]
        expected = full[:, head.ids]
        got = reduced[:, head.ids]
        scale = float(expected.abs().max()) or 1.0
        tolerance = 1e-5 if self.model.dtype == torch.float32 else 2e-2
        if float((got - expected).abs().max()) > tolerance * scale:
            raise ConfigError(
                f"{where(VOCAB_FLAG)}: {self.config.model}'s logits are not its last hidden "
                "state times its output layer (soft-capping or scaling?); a reduced draft "
                "vocabulary would change its distribution, so it is refused"
            )
