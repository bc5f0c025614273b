"""The tiny test models are loadable, varied, well separated and deterministic."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: E402

from specdec.tools.tinymodels import TestModels, build_test_models  # noqa: E402

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Hello, world! How are you today?",
]
MORE_PROMPTS = [*PROMPTS, "SELECT id FROM users WHERE", "Once upon a time there was"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> TestModels:
    return build_test_models(tmp_path_factory.mktemp("models"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(models):
    return AutoTokenizer.from_pretrained(models.tokenizer)


def _load(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def target(models):
    return _load(models.target)


@pytest.fixture(scope="module")
def draft_noisy(models):
    return _load(models.draft_noisy)


@pytest.fixture(scope="module")
def draft_small(models):
    return _load(models.draft_small)


def _ids(tokenizer, text):
    return tokenizer(text, return_tensors="pt").input_ids


def _greedy(model, input_ids, n):
    out = model.generate(input_ids, do_sample=False, max_new_tokens=n)
    return out[0, input_ids.shape[1] :]


@torch.no_grad()
def _agreement(target, draft, tokenizer, prompts, n=48):
    """Fraction of positions of target-generated text where the greedy tokens agree."""
    hits = total = 0
    for prompt in prompts:
        ids = _ids(tokenizer, prompt)
        seq = torch.cat([ids[0], _greedy(target, ids, n)])[None]
        span = slice(ids.shape[1] - 1, seq.shape[1] - 1)
        t = target(seq).logits[0, span].argmax(-1)
        d = draft(seq).logits[0, span].argmax(-1)
        hits += int((t == d).sum())
        total += t.numel()
    return hits / total


def test_layout(models):
    for d in (models.tokenizer, models.target, models.draft_noisy, models.draft_small):
        assert d.is_dir() and d.parent == models.root
        assert (d / "tokenizer.json").is_file()
    for d in (models.target, models.draft_noisy, models.draft_small):
        assert (d / "model.safetensors").is_file()
        assert (d / "config.json").is_file()
        assert (d / "generation_config.json").is_file()


def test_tokenizer(models, tokenizer):
    assert len(tokenizer) == models.vocab_size
    assert 300 <= models.vocab_size <= 512
    assert tokenizer.eos_token_id == models.eos_token_id
    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in specials and len(specials) == 3
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "def f(x):\n\treturn {'a': [1, 2, 3]}  # ok?\n",
        "  leading and trailing spaces  ",
        "~!@#$%^&*()_+`-=[]\\{}|;':\",./<>?",
    ]:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
        assert len(ids) < len(text) or len(text) < 8  # merges are actually used
    # Every model directory carries the same tokenizer.
    for d in (models.target, models.draft_noisy, models.draft_small):
        other = AutoTokenizer.from_pretrained(d)
        assert other.get_vocab() == tokenizer.get_vocab()
        assert other.eos_token_id == models.eos_token_id
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith(tokenizer.bos_token) and "hi" in chat


def test_models_load(models, target, draft_noisy, draft_small):
    for model in (target, draft_noisy, draft_small):
        assert isinstance(model, LlamaForCausalLM)
        assert model.dtype == torch.float32
        assert model.config.vocab_size == models.vocab_size
        assert model.config.eos_token_id == models.eos_token_id
        assert model.generation_config.eos_token_id == models.eos_token_id
        assert model.config.max_position_embeddings == 512
    same = {k: v for k, v in target.config.to_dict().items() if k != "_name_or_path"}
    assert same == {k: v for k, v in draft_noisy.config.to_dict().items() if k != "_name_or_path"}


def test_draft_small_is_smaller(target, draft_small):
    t, s = target.config, draft_small.config
    assert (s.hidden_size, s.num_hidden_layers) != (t.hidden_size, t.num_hidden_layers)
    assert s.hidden_size < t.hidden_size
    assert draft_small.num_parameters() < target.num_parameters()
    assert s.vocab_size == t.vocab_size


@pytest.mark.parametrize("which", ["target", "draft_noisy", "draft_small"])
def test_greedy_output_is_varied(request, which, tokenizer, models):
    model = request.getfixturevalue(which)
    for prompt in PROMPTS:
        new = _greedy(model, _ids(tokenizer, prompt), 32).tolist()
        assert len(new) == 32, "stopped early (EOS)"
        assert models.eos_token_id not in new
        assert len(set(new)) >= 8, (prompt, new)
        # Greedy text is printable ASCII and decodes token by token without loss.
        text = tokenizer.decode(new)
        assert text == "".join(tokenizer.decode([t]) for t in new)
        assert text.isascii() and "\ufffd" not in text


def test_draft_noisy_agreement(target, draft_noisy, draft_small, tokenizer):
    noisy = _agreement(target, draft_noisy, tokenizer, MORE_PROMPTS)
    small = _agreement(target, draft_small, tokenizer, MORE_PROMPTS)
    assert 0.4 < noisy < 0.97, noisy
    assert small < noisy, (small, noisy)


@torch.no_grad()
def test_logits_well_separated_and_incremental_exact(target, tokenizer):
    """Top-1/top-2 gaps are large, and KV-cached decoding picks the same argmax."""
    gaps = []
    for prompt in MORE_PROMPTS:
        ids = _ids(tokenizer, prompt)
        seq = torch.cat([ids[0], _greedy(target, ids, 48)])[None]
        full = target(seq).logits[0]
        span = slice(ids.shape[1] - 1, seq.shape[1] - 1)
        top2 = full[span].topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])

        past, steps = None, []
        for i in range(seq.shape[1]):
            out = target(seq[:, i : i + 1], cache=past, use_cache=True)
            past = out.cache
            steps.append(out.logits[0, -1])
        inc = torch.stack(steps)
        assert torch.equal(inc.argmax(-1), full.argmax(-1))
        assert (inc - full).abs().max() < 1e-3
    gaps = torch.cat(gaps)
    assert gaps.median() > 0.5, gaps.median()
    assert (gaps > 0.05).float().mean() > 0.9


def test_deterministic_and_seeded(tmp_path_factory, models):
    rng_before = torch.get_rng_state()
    again = build_test_models(tmp_path_factory.mktemp("again"), seed=0)
    other = build_test_models(tmp_path_factory.mktemp("other"), seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG was disturbed"
    for name in ("target", "draft_noisy", "draft_small"):
        a = (getattr(models, name) / "model.safetensors").read_bytes()
        assert a == (getattr(again, name) / "model.safetensors").read_bytes()
        assert a != (getattr(other, name) / "model.safetensors").read_bytes()
    tok = (models.tokenizer / "tokenizer.json").read_bytes()
    assert tok == (again.tokenizer / "tokenizer.json").read_bytes()
    assert (models.vocab_size, models.eos_token_id) == (other.vocab_size, other.eos_token_id)
