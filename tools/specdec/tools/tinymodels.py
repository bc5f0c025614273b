"""Tiny random causal LMs and a shared tokenizer for exactness tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained in code on a
small built-in corpus, and the models are plain ``LlamaForCausalLM`` (fp32,
safetensors, no custom code) with a deliberately "loud" random initialisation.

Why not the default init (std 0.02)? A tiny model initialised that way repeats
one token and its logits are nearly tied, so an exactness test of speculative
decoding either passes trivially or flips on fp32 rounding. Here:

* embeddings are N(0, 1) and every projection is N(0, (BLOCK_GAIN/sqrt(fan_in))^2),
  so attention and MLP outputs are of the same order as the token embedding:
  greedy output depends on the context and wanders through many distinct
  tokens instead of settling into a short loop;
* the lm_head is N(0, (LOGIT_STD/sqrt(hidden))^2), so (after the final RMSNorm)
  logits have a standard deviation of about LOGIT_STD: the top-1/top-2 gap at
  greedy steps has a median around 1.5, far above the <=5e-5 differences
  between a multi-token forward and one-token-at-a-time decoding;
* the lm_head also gets ``-ANTI_REPEAT/sqrt(hidden) * embed_tokens``, which
  lowers the logit of the token just read: without it a few seeds fall into
  "] ] ] ]" loops for some prompts;
* the lm_head rows of the special tokens (pad/bos/eos) and of byte tokens that
  do not decode to printable ASCII are zero: their logit is exactly 0 while the
  best ordinary token is typically ~19, so greedy generation never emits
  EOS and its text is printable ASCII that decodes cleanly token by token.
  (Sampling at temperature 1 picks one of them with probability ~1e-5 a step;
  at higher temperatures more often.)

``draft_noisy`` is the target plus Gaussian noise of NOISE_REL times each
tensor's std: its greedy token matches the target's on roughly 75-80% of the
positions of target-generated text. ``draft_small`` is an independently
initialised smaller model with the same vocabulary: it almost never agrees.

The tokenizer adds no BOS/EOS on encode (``tok(text).input_ids`` is just the
text), so ``tok.decode(tok(text).input_ids) == text`` for any text; the chat
template puts ``<|bos|>`` in front.

Usage::

    models = build_test_models(tmp_path)          # deterministic for a seed
    AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32)
    AutoTokenizer.from_pretrained(models.tokenizer)
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import string
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

__all__ = [
    "TestModels",
    "build_one_layer_target",
    "build_shaped_model",
    "build_test_head",
    "build_test_models",
    "write_gguf",
]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2

TOKENIZER_VOCAB_SIZE = 384
MAX_POSITIONS = 512

# A chat template that takes tools the way Qwen2.5's does (Hermes style): the tools' JSON
# in a system turn, earlier calls as <tool_call> blocks, results as `tool` turns. Without
# tools it renders what it always did.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>'
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Target: hidden 64, 3 layers, 4 heads of 16 (2 kv heads), MLP 192.
TARGET_SHAPE = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# Draft: hidden 32, 2 layers, 2 heads of 16 (1 kv head), MLP 96.
DRAFT_SMALL_SHAPE = dict(
    hidden_size=32,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)

# Initialisation gains (see _init_weights).
EMBED_STD = 1.0
BLOCK_GAIN = 1.25  # each projection: std = BLOCK_GAIN / sqrt(fan_in)
LOGIT_STD = 6.0  # lm_head std = LOGIT_STD / sqrt(hidden): logits ~ N(0, LOGIT_STD^2)
# draft_noisy: noise std = NOISE_REL * (std of the tensor it is added to).
NOISE_REL = 0.035
# lm_head -= ANTI_REPEAT / sqrt(hidden) * embedding: discourages repeating the current token.
ANTI_REPEAT = 3.0

# A small English + code corpus for the BPE. Content does not matter much; it
# only has to give the trainer enough pairs to reach TOKENIZER_VOCAB_SIZE.
_CORPUS = r'''
The quick brown fox jumps over the lazy dog. A journey of a thousand miles
begins with a single step. Speculative decoding lets a small draft model
propose several tokens that a large target model then verifies in a single
forward pass. When the draft agrees with the target, many tokens are accepted
at once; when it does not, the target's own token is used and the draft starts
again from there. The output is exactly what the target would have produced
on its own, only faster.

Once upon a time there was a little server that answered every request with
the same greeting. The operators wanted it to say something new each time, so
they gave it a model, a tokenizer and a queue of prompts. It learned to read
the prompts, to think about them, and to write the answers one token at a
time. Then the requests grew, and the server became a cluster of services
that talked to each other over the network: a gateway, a drafter and a
verifier. Each of them kept its own cache and its own clock.

What is the capital of France? Paris is the capital and the largest city of
France. How many days are there in a week? There are seven days in a week.
Please write a short poem about the sea, the wind and the stars at night.
Hello, world! How are you today? I am fine, thank you, and you?

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value

    def __repr__(self) -> str:
        return f"Counter(value={self.value})"


def read_lines(path):
    with open(path, "r", encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle if line.strip()]


async def fetch_all(client, urls):
    results = {}
    for url in urls:
        response = await client.get(url, timeout=10.0)
        if response.status_code == 200:
            results[url] = response.json()
        else:
            results[url] = None
    return results


import numpy as np

x = np.arange(10, dtype=np.float32)
y = x * 2.0 + 1.0
print("mean:", y.mean(), "max:", y.max())

for i in range(3):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

{"name": "specdec", "version": "0.1.0", "tokens": [1, 2, 3], "ok": true}
SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC;
int main(void) { printf("hello %d\n", 42); return 0; }
const add = (a, b) => a + b; let total = [1, 2, 3].reduce(add, 0);
'''


@dataclass(frozen=True)
class TestModels:
    __test__ = False  # not a pytest test class despite the name

    root: Path
    tokenizer: Path  # AutoTokenizer.from_pretrained(tokenizer)
    target: Path  # AutoModelForCausalLM.from_pretrained(target); has tokenizer files too
    draft_noisy: Path  # target + small noise: agrees with target's greedy token often
    draft_small: Path  # smaller, independently initialised; same vocab
    vocab_size: int
    eos_token_id: int


def _build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


_TEXT_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation + " \n\t")


def _suppressed_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Special tokens, and byte tokens that do not decode to printable ASCII.

    Their lm_head rows are zeroed so that greedy output is printable ASCII text
    that decodes cleanly token by token (no split UTF-8 sequences, no control
    bytes) and never stops early on EOS.
    """
    out = []
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid])
        if tid in tokenizer.all_special_ids or not text or not set(text) <= _TEXT_CHARS:
            out.append(tid)
    return out


def _make_config(shape: dict, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **shape,
    )


@torch.no_grad()
def _init_weights(model: LlamaForCausalLM, gen: torch.Generator, suppressed_ids: list[int]) -> None:
    """Overwrite every parameter with a deterministic, "loud" random init."""
    hidden = model.config.hidden_size
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name == "model.embed_tokens.weight":
            param.normal_(0.0, EMBED_STD, generator=gen)
        elif name == "lm_head.weight":
            param.normal_(0.0, LOGIT_STD / math.sqrt(hidden), generator=gen)
            param.sub_(model.model.embed_tokens.weight * (ANTI_REPEAT / math.sqrt(hidden)))
            param[suppressed_ids] = 0.0  # logit exactly 0: these (almost) never win
        elif param.dim() == 2:  # q/k/v/o and MLP projections: [out, in]
            param.normal_(0.0, BLOCK_GAIN / math.sqrt(param.shape[1]), generator=gen)
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(param.shape)}")


def _generator(seed: int, name: str) -> torch.Generator:
    """A generator per model, so that each model depends only on (seed, name)."""
    digest = hashlib.sha256(f"specdec-test-models/{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _new_model(config: LlamaConfig, gen: torch.Generator, suppressed_ids: list[int]):
    # fork_rng: building the module draws from the global RNG; leave the caller's alone.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    model.float()
    _init_weights(model, gen, suppressed_ids)
    model.eval()
    return model


@torch.no_grad()
def _add_noise(model: LlamaForCausalLM, gen: torch.Generator, suppressed_ids: list[int]) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            continue  # constant ones: keep them exact
        param.add_(torch.randn(param.shape, generator=gen) * (NOISE_REL * param.std().item()))
        if name == "lm_head.weight":
            param[suppressed_ids] = 0.0


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(path)  # model.safetensors + config.json + generation_config.json
    tokenizer.save_pretrained(path)
    return path


def build_test_models(root: Path, seed: int = 0) -> TestModels:
    """Build the tokenizer and three tiny Llama models under ``root``.

    Layout: ``root/tokenizer``, ``root/target``, ``root/draft_noisy`` and
    ``root/draft_small``; each model directory holds the tokenizer files too.
    Deterministic for a given ``seed`` (the tokenizer does not depend on it);
    takes a fraction of a second. Existing files are overwritten.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer()
    tok_dir = root / "tokenizer"
    tokenizer.save_pretrained(tok_dir)
    suppressed_ids = _suppressed_ids(tokenizer)

    target_config = _make_config(TARGET_SHAPE, tokenizer)
    target = _new_model(target_config, _generator(seed, "target"), suppressed_ids)
    noisy = copy.deepcopy(target)
    _add_noise(noisy, _generator(seed, "draft_noisy"), suppressed_ids)
    small_config = _make_config(DRAFT_SMALL_SHAPE, tokenizer)
    small = _new_model(small_config, _generator(seed, "draft_small"), suppressed_ids)

    return TestModels(
        root=root,
        tokenizer=tok_dir,
        target=_save(target, tokenizer, root / "target"),
        draft_noisy=_save(noisy, tokenizer, root / "draft_noisy"),
        draft_small=_save(small, tokenizer, root / "draft_small"),
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
    )


def build_shaped_model(path: Path, shape: dict, name: str, seed: int = 0) -> Path:
    """One model of another shape (e.g. a real model's layers and widths) with the test
    tokenizer and the same initialisation, saved under ``path`` (float32): a stand-in
    for timing a real shape through the whole stack (specdec.tools.gpucheck)."""
    tokenizer = _build_tokenizer()
    config = _make_config(shape, tokenizer)
    model = _new_model(config, _generator(seed, name), _suppressed_ids(tokenizer))
    return _save(model, tokenizer, Path(path))


def build_one_layer_target(path: Path, seed: int = 0) -> Path:
    """The tiny target's shape with one decoder layer (same tokenizer and init): the
    target a head can copy exactly (`build_test_head(..., exact=True)`)."""
    return build_shaped_model(path, dict(TARGET_SHAPE, num_hidden_layers=1), "target1", seed)


@torch.no_grad()
def build_test_head(
    target: Path, folder: Path, exact: bool = False, seed: int = 0, noise: float = 0.0
) -> Path:
    """A head folder for a tiny target (specdec.drafter.head.write_head: the embedding,
    final norm and output matrix copied from the target).

    exact: the head's decoder layer is the target's last layer and fc passes the token
    embedding through (fc = [0 | I]): on a one-layer target (`build_one_layer_target`) its
    entry at each position is the target's own, so it predicts the target's next token.
    noise: with exact, the layer's weights get Gaussian noise of `noise` times each
    tensor's std, and fc's feature half a random matrix of that scale: a head that agrees
    with the target often but not always, and reads the feature. Else a random head: a
    freshly initialised layer (the loud init) and a random fc, which drafts poorly but
    from every input, the feature included."""
    from transformers import AutoConfig

    from specdec.drafter.head import write_head

    config = AutoConfig.from_pretrained(target)
    hidden = config.hidden_size
    if exact:
        model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
        layer = model.model.layers[-1].state_dict()
        fc = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        if noise:
            gen = _generator(seed, "head-noise")
            for name, t in layer.items():
                if not name.endswith("norm.weight"):
                    t.add_(torch.randn(t.shape, generator=gen) * (noise * t.std().item()))
            fc[:, :hidden] = torch.randn(hidden, hidden, generator=gen) * (
                noise / math.sqrt(hidden)
            )
    else:
        shape = {k: getattr(config, k) for k in TARGET_SHAPE}
        tokenizer = _build_tokenizer()
        gen = _generator(seed, "head")
        model = _new_model(
            _make_config(dict(shape, num_hidden_layers=1), tokenizer),
            gen,
            _suppressed_ids(tokenizer),
        )
        layer = model.model.layers[0].state_dict()
        fc = torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden)
    return write_head(folder, target, layer, fc)


def _rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection [heads * dim, hidden] in llama.cpp's rotary layout: transformers'
    Llama rotates the two halves of each head, llama.cpp's `llama` architecture adjacent
    pairs (the permutation of llama.cpp's own converter)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(model_dir: Path, path: Path | None = None) -> Path:
    """The float32 GGUF of a tiny Llama checkpoint (one that `build_test_models` or
    `build_shaped_model` saved), with its tokenizer, for the llama.cpp engine's tests: the
    same weights as the safetensors, so llama.cpp and transformers run the same model.
    Written to ``path`` (default ``model_dir/model.gguf``); its path."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    model_dir = Path(model_dir)
    path = Path(path) if path is not None else model_dir / "model.gguf"
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # The tokenizer, so that llama.cpp loads the file (the engine feeds it token ids).
    vocab = tokenizer.get_vocab()
    tokens = [""] * len(vocab)
    for text, token_id in vocab.items():
        tokens[token_id] = text
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
            for i in range(len(tokens))
        ]
    )
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config.num_hidden_layers):
        for hf, ours in per_layer.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{ours}.weight"
    for name, tensor in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            tensor = _rope_permute(tensor, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            tensor = _rope_permute(tensor, kv_heads)
        writer.add_tensor(names[name], tensor.to(torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
