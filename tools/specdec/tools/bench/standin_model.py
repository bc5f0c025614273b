"""A stand-in causal LM whose forward costs a known time (modeling code).

What it stands in for: a forward of a real model, as the host sees it. Each forward over
input_ids [b, n] waits ``forward_ms + per_token_ms * b * n`` (sleeping, then spinning the
last `SPIN_MS` so the wait is exact to a few microseconds) and returns fixed logits, so the
time a serving stack adds around it can be measured exactly: anything beyond the forwards'
waits is the stack's own cost.

- ``per_token_ms = 0`` (the default): a GPU. The host launches the forward and waits for
  the device, and the wait does not depend on how many rows or tokens the forward carries
  (decode steps and short verifications are bound by reading the weights).
- ``per_token_ms > 0``: a compute-bound device (a CPU): t(n) = a + b n, every row times
  every token counted, right pads included (a CPU computes them too).

What it emits (greedy decoding is deterministic either way):

- ``period = 0`` (the default): the next token is a fixed function of the current token
  and its position (modulo `PERIOD`); nothing sets how often a lookup draft is right.
- ``period = P > 0``: the next token after the input at position p is ``S[p mod P]``, S
  being P distinct allowed tokens (`sequence`), whatever the token read: the output cycles
  through S, every n-gram of it unique within a period, so once one period is out, prompt
  lookup (the gateway's n-gram proposer, which copies what followed the first earlier
  occurrence of the longest n-gram ending the sequence) predicts the rest exactly.
  ``noise`` sets how often it does not: at positions p >= ``noise_start`` where a hash of
  p (not periodic) falls below `noise`, the target emits ``N[p mod M]`` instead, with
  ``S[p mod P]`` its runner-up (elsewhere N[p mod M] is the runner-up). N (`noise_tokens`)
  is every other allowed token but PROMPT_TOKENS kept for prompts (`outside`,
  `prompt_ids`), M = len(N) a multiple of P. So within M positions a noise token is new:
  no lookup predicts it, none matches right after it (that round drafts nothing), and the
  next round matches the clean token after it, which copies from the first period again.
  Per drafted token examined (accepted, or the round's first rejected) n-gram acceptance
  is then about 1 - noise. Past M positions a noise token may come back, at the same slot
  of S: the lookup after it copies what followed it then, right only where the two
  stretches' noise agrees (about (1 - noise)^2 + noise^2 a token), so acceptance drops
  below 1 - noise. With the tiny tokenizer's 222 allowed tokens and P 16 (M 176), k 4:
  0.90, 0.70, 0.47 over 200 positions whose noise share is 0.085, 0.295, 0.545; 0.87,
  0.60, 0.51 over 20000 (noise 0.1, 0.3, 0.6).
  No noise before ``noise_start`` (default 2 P): every lookup copies from the first period
  of the output (the first occurrence wins), which must be clean, or a noise token there
  would be copied into every later period. Prompts made of `outside` tokens and no longer
  than noise_start - P leave that clean period (the bench cuts its prompts to one length L
  and starts the noise at L + P).

The drafter: a second model built with ``disagree`` > 0 (and the target's period, noise
and noise_start) proposes the target's token except at a pseudo-random `disagree` share
of positions, which sets the draft model's acceptance; where it misses, the target's token
is its runner-up (as for a real drafter, which is what SSD's guesses of the recovered
token rely on). With period P it agrees with the target at the noise positions too (those
that are not its own misses): its acceptance stays about 1 - disagree whatever the noise,
while the lookups' follows the noise. Its misses are over positions modulo `PERIOD` for
period 0 (as ever), over absolute positions (an independent hash) for period P.

The hidden state is LOGIT on the next token and SECOND_LOGIT on the runner-up, 0
elsewhere, and the output layer the identity, so the batched path (decoder, then the
output layer on chosen rows) gives the same logits as the model's own forward: both
depend only on each input's token and position. A one-slot key/value per token keeps the
KV cache's length, crop and batching exactly as for a real model; attention is not
computed (the output does not depend on it).

This file is self-contained (torch and transformers only): `specdec.tools.bench.standin`
copies it into a model directory as `modeling_standin.py`, which loads through
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` (the replicas'
``--trust-remote-code``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

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
        per_token_ms: float = 0.0,
        period: int = 0,
        noise: float = 0.0,
        noise_start: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.forward_ms = forward_ms  # wall time of every forward
        self.per_token_ms = per_token_ms  # plus this per row and token (compute-bound)
        self.disagree = disagree  # share of positions where this model differs (a drafter)
        # Tokens it may emit (printable, never EOS): the next token is one of them.
        self.allowed_ids = list(allowed_ids or range(3, vocab_size))
        self.period = period  # 0: next token of (token, position); P: S[position mod P]
        self.noise = noise  # share of positions (>= noise_start) off S, with period P
        self.noise_start = 2 * period if noise_start is None else noise_start
        most = (len(self.allowed_ids) - PROMPT_TOKENS) // 2  # S, N (P at least), prompts
        if not 0 <= period <= most:
            raise ValueError(f"period must be in [0, {most}], got {period}")
        for name, share in (("noise", noise), ("disagree", disagree)):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {share}")
        if per_token_ms < 0 or forward_ms < 0:
            raise ValueError("forward_ms and per_token_ms must be >= 0")
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


def forward_ms(config: StandinConfig, rows: int, tokens: int) -> float:
    """What a forward over input_ids [rows, tokens] waits (ms)."""
    return config.forward_ms + config.per_token_ms * rows * tokens


PERIOD = 64  # with period 0, the next token depends on the position modulo this

# -- period P: where the output cycles through S ------------------------------------------

MASK = 0xFFFFFFFF
NOISE_SALT = 0x2545F491  # the hashes of a position: is it noise, ...
DISAGREE_SALT = 0x1B56C4E9  # ... is it one of the drafter's misses
PROMPT_TOKENS = 16  # allowed tokens kept out of the output, for prompts


def _mix(x):
    """A 32-bit integer hash (xorshift-multiply), of an int or of an int64 tensor of values
    in [0, 2**32): every product stays below 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & MASK
    return x ^ (x >> 16)


def position_hash(position, salt: int):
    """A hash in [0, 2**32) of an absolute position (int or int64 tensor) for one use."""
    return _mix(_mix(position & MASK) ^ salt)


def _order(config: StandinConfig) -> list[int]:
    """The allowed tokens in a fixed scrambled order: S, then N, then PROMPT_TOKENS for
    prompts (period P > 0)."""
    allowed = list(config.allowed_ids)
    n = len(allowed)
    step = next(s for s in range(97, 98 + n) if math.gcd(s, n) == 1)
    return [allowed[(i * step + 11) % n] for i in range(n)]


def sequence(config: StandinConfig) -> list[int]:
    """S: the `period` distinct tokens the output cycles through (empty for period 0)."""
    return _order(config)[: config.period]


def _noise_count(config: StandinConfig) -> int:
    """M = len(N): the largest multiple of P that leaves PROMPT_TOKENS for prompts."""
    p = config.period
    return (len(config.allowed_ids) - p - PROMPT_TOKENS) // p * p if p else 0


def noise_tokens(config: StandinConfig) -> list[int]:
    """N: at a noise position p the target emits N[p mod M] instead of S[p mod P], M =
    len(N), a multiple of P (tokens in neither S nor the prompts'; empty for period 0)."""
    return _order(config)[config.period : config.period + _noise_count(config)]


def outside(config: StandinConfig) -> list[int]:
    """The allowed tokens in neither S nor N (all of them for period 0, PROMPT_TOKENS at
    least): what prompts should be made of, so that a lookup in the prompt never matches
    the output."""
    return _order(config)[config.period + _noise_count(config) :]


def prompt_ids(config: StandinConfig, ids: Sequence[int]) -> list[int]:
    """`ids` mapped onto tokens outside S and N (same length; equal ids stay equal)."""
    out = outside(config)
    return [out[int(t) % len(out)] for t in ids]


def is_noise(config: StandinConfig, position: int) -> bool:
    """Whether the target (period P) emits a token off S at this absolute position."""
    return (
        config.period > 0
        and position >= config.noise_start
        and position_hash(position, NOISE_SALT) < int(config.noise * 2**32)
    )


def is_miss(config: StandinConfig, position: int) -> bool:
    """Whether a drafter (disagree > 0, period P) proposes another token than the target
    at this absolute position."""
    return config.period > 0 and position_hash(position, DISAGREE_SALT) < int(
        config.disagree * 2**32
    )


class _DecoderOutput:
    """The decoder's output: what the runtime's batched path reads (a transformers
    ModelOutput costs more Python than the rest of this model's forward)."""

    __slots__ = ("cache", "last_hidden_state")

    def __init__(self, last_hidden_state, cache):
        self.last_hidden_state = last_hidden_state
        self.cache = cache


class StandinModel(PreTrainedModel):
    """The decoder: waits forward_ms (+ per_token_ms per row and token), returns LOGIT on
    the next token and SECOND_LOGIT on the runner-up as its hidden state (the output layer
    is the identity)."""

    config_class = StandinConfig
    base_model_prefix = "model"
    config: StandinConfig

    def __init__(self, config: StandinConfig):
        super().__init__(config)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # made on first use
        self._s: tuple[torch.Tensor, torch.Tensor] | None = None
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

    def _sequences(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """S and N as tensors [P] on the device (made on first use)."""
        if self._s is None or self._s[0].device != device:
            self._s = (
                torch.tensor(sequence(self.config), dtype=torch.long, device=device),
                torch.tensor(noise_tokens(self.config), dtype=torch.long, device=device),
            )
        return self._s

    def next_tokens(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The likeliest and the second likeliest next token after each input [b, n] at its
        absolute position [b, n]: from `tables` for period 0, else S[p mod P] then
        N[p mod M], the other way round at a noise position; a drafter swaps the two at
        its misses."""
        cfg = self.config
        if not cfg.period:
            first, second = self.tables(input_ids.device)
            row = position_ids % PERIOD
            return first[row, input_ids], second[row, input_ids]
        s, n = self._sequences(input_ids.device)
        periodic, alt = s[position_ids % s.numel()], n[position_ids % n.numel()]
        noisy = (position_ids >= cfg.noise_start) & (
            position_hash(position_ids, NOISE_SALT) < int(cfg.noise * 2**32)
        )
        first, second = torch.where(noisy, alt, periodic), torch.where(noisy, periodic, alt)
        if cfg.disagree > 0:
            wrong = position_hash(position_ids, DISAGREE_SALT) < int(cfg.disagree * 2**32)
            first, second = torch.where(wrong, second, first), torch.where(wrong, first, second)
        return first, second

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool | None = True,
        **kwargs,
    ) -> _DecoderOutput:
        b, n = input_ids.shape
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + n, device=input_ids.device)[None].expand(b, n)
        if cache is not None:
            slots = input_ids[:, None, :, None].float()  # [b, 1, n, 1]
            cache.update(slots, slots, 0)
        wait(forward_ms(self.config, b, n))
        first, second = self.next_tokens(input_ids, position_ids)
        hidden = input_ids.new_zeros((b, n, self.config.vocab_size), dtype=torch.float32)
        hidden.scatter_(-1, second[..., None], SECOND_LOGIT)
        hidden.scatter_(-1, first[..., None], LOGIT)
        return _DecoderOutput(hidden, cache)


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
        cache=None,
        use_cache: bool | None = True,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(input_ids, attention_mask, position_ids, cache, use_cache)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), cache=out.cache)
