"""A stand-in causal LM whose forward costs a fixed, known time (modeling code).

What it stands in for: a GPU forward of a real model, as the host sees it. The host thread
launches the forward and then waits for the device; the wait is the step time and does not
depend on how many rows or tokens the forward carries (decode steps and short
verifications are bound by reading the weights). This model waits `forward_ms` per forward
(sleeping, then spinning the last `SPIN_MS` so the wait is exact to a few microseconds)
and returns fixed logits, so the time a serving stack adds around it can be measured
exactly: anything beyond forwards x forward_ms is the stack's own cost.

Its next token is a fixed function of the current token and its position: greedy decoding
is deterministic, and a second model built with `disagree` > 0 (the drafter) proposes the
target's token except at a pseudo-random `disagree` share of positions, which sets the
acceptance rate; where it misses, the target's token is its runner-up (as for a real
drafter, which is what SSD's guesses of the recovered token rely on). The hidden state is
LOGIT on the next token and SECOND_LOGIT on the runner-up, 0 elsewhere, and the output
layer the identity, so the batched path (decoder, then the output layer on chosen
rows) gives the same logits as the model's own forward. A one-slot key/value per token
keeps the KV cache's length, crop and batching exactly as for a real model; attention is
not computed (the output does not depend on it).

This file is self-contained (torch and transformers only): `specdec.tools.bench.standin`
copies it into a model directory as `modeling_standin.py`, which loads through
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` (the replicas'
``--trust-remote-code``).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

SPIN_MS = 0.2  # the end of a wait spins: sleep alone overshoots by 50-100 us on Linux
LOGIT = 20.0  # the next token's logit; every other token's is 0 but the runner-up's
SECOND_LOGIT = 16.0


class StandinConfig(PretrainedConfig):
    model_type = "specdec_standin"

    def __init__(
        self,
        vocab_size: int = 384,
        forward_ms: float = 2.0,
        disagree: float = 0.0,
        allowed_ids: list[int] | None = None,
        max_position_embeddings: int = 4096,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.forward_ms = forward_ms  # wall time of every forward
        self.disagree = disagree  # share of positions where this model differs (a drafter)
        # Tokens it may emit (printable, never EOS): the next token is one of them.
        self.allowed_ids = list(allowed_ids or range(3, vocab_size))
        self.max_position_embeddings = max_position_embeddings
        # What the KV cache and the batching code read: one layer, one head of width 1.
        self.hidden_size = vocab_size
        self.num_hidden_layers = 1
        self.num_attention_heads = 1
        self.num_key_value_heads = 1
        self.head_dim = 1
        super().__init__(**kwargs)


def wait(ms: float) -> None:
    """Hold the calling thread for `ms` milliseconds: sleep, then spin the last SPIN_MS."""
    end = time.perf_counter() + ms / 1e3
    nap = ms / 1e3 - SPIN_MS / 1e3
    if nap > 0:
        time.sleep(nap)
    while time.perf_counter() < end:
        pass


PERIOD = 64  # the next token depends on the position modulo this


class _DecoderOutput:
    """The decoder's output: what the runtime's batched path reads (a transformers
    ModelOutput costs more Python than the rest of this model's forward)."""

    __slots__ = ("last_hidden_state", "past_key_values")

    def __init__(self, last_hidden_state, past_key_values):
        self.last_hidden_state = last_hidden_state
        self.past_key_values = past_key_values


class StandinModel(PreTrainedModel):
    """The decoder: waits forward_ms, returns LOGIT on the next token and SECOND_LOGIT on
    the runner-up as its hidden state (the output layer is the identity)."""

    config_class = StandinConfig
    base_model_prefix = "model"

    def __init__(self, config: StandinConfig):
        super().__init__(config)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # made on first use
        self.post_init()

    def _init_weights(self, module) -> None:
        pass

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[PERIOD, vocab] each: the likeliest and the second likeliest token after a token
        at a position (modulo PERIOD). The target's is a fixed function of both; a drafter
        (disagree > 0) puts the target's token second at a pseudo-random share `disagree`
        of positions and the following allowed token first, as a real drafter whose miss is
        usually its runner-up."""
        if self._tables is None or self._tables[0].device != device:
            allowed = torch.tensor(self.config.allowed_ids)
            n = allowed.numel()
            position = torch.arange(PERIOD)[:, None]  # [P, 1]
            token = torch.arange(self.config.vocab_size)[None, :]  # [1, V]
            target = (token * 7 + position * 13 + 5) % n  # [P, V]
            other = (target + 1) % n
            if self.config.disagree > 0:
                h = (position * 2654435761 + 12345) % 4294967296
                wrong = h < int(self.config.disagree * 4294967296)  # [P, 1]
                target, other = torch.where(wrong, other, target), torch.where(wrong, target, other)
            self._tables = (allowed[target].to(device), allowed[other].to(device))
        return self._tables

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = True,
        **kwargs,
    ) -> _DecoderOutput:
        b, n = input_ids.shape
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(past, past + n, device=input_ids.device)[None].expand(b, n)
        if past_key_values is not None:
            slots = input_ids[:, None, :, None].float()  # [b, 1, n, 1]
            past_key_values.update(slots, slots, 0)
        wait(self.config.forward_ms)
        first, second = self.tables(input_ids.device)
        row = position_ids % PERIOD
        hidden = input_ids.new_zeros((b, n, self.config.vocab_size), dtype=torch.float32)
        hidden.scatter_(-1, second[row, input_ids][..., None], SECOND_LOGIT)
        hidden.scatter_(-1, first[row, input_ids][..., None], LOGIT)
        return _DecoderOutput(hidden, past_key_values)


class StandinForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = StandinConfig
    base_model_prefix = "model"
    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config: StandinConfig):
        super().__init__(config)
        self.model = StandinModel(config)
        self.lm_head = nn.Linear(config.vocab_size, config.vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(config.vocab_size))
        self.post_init()

    def _init_weights(self, module) -> None:
        pass

    def get_decoder(self):
        return self.model

    def get_output_embeddings(self):
        return self.lm_head

    def get_input_embeddings(self):
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = True,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(
            logits=self.lm_head(hidden), past_key_values=out.past_key_values
        )
