"""The stand-in models of specdec.tools.bench.standin_model: what a forward waits (a + b
rows x tokens), and, with a period, an output that cycles through S off which it goes at
a `noise` share of positions, which sets prompt lookup's acceptance (replayed here with
the gateway's own n-gram proposer) apart from the drafter's (`disagree`). No clock: the
waits are recorded, not timed."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specdec.gateway.round.lookup.ngram import NgramIndex
from specdec.tools.bench import standin_model as sm
from specdec.tools.bench.standin import build_standins

P = 16


def model(**options) -> sm.StandinForCausalLM:
    return sm.StandinForCausalLM(sm.StandinConfig(forward_ms=0.0, **options)).eval()


def expected_after(cfg: sm.StandinConfig, position: int) -> int:
    """The target's token after the input at `position` (period > 0)."""
    if sm.is_noise(cfg, position):
        noise = sm.noise_tokens(cfg)
        return noise[position % len(noise)]
    return sm.sequence(cfg)[position % cfg.period]


def greedy(m: sm.StandinForCausalLM, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation in one forward: with a period, the next token depends on
    the position alone (test_generate_follows_the_cycle checks it against generate())."""
    ids = torch.tensor([prompt + [prompt[0]] * n])
    with torch.inference_mode():
        logits = m(ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + n].argmax(-1).tolist()


def replay_lookup(prompt: list[int], out: list[int], start: int, k: int = 4) -> dict:
    """The gateway's n-gram proposer (min 1, max 5) drafting up to k tokens a round over
    `out`, the target accepting the matching prefix and adding its own token; counted over
    the rounds that start at output index `start` or later."""
    index = NgramIndex(1, 5)
    index.extend(prompt)
    i = drafted = accepted = examined = rounds = 0
    while i < len(out):
        draft, _ = index.propose(min(k, len(out) - i - 1))
        a = 0
        while a < len(draft) and draft[a] == out[i + a]:
            a += 1
        if i >= start:
            rounds += 1
            drafted += len(draft)
            accepted += a
            examined += a + (a < len(draft))  # the accepted, and the first rejected
        index.extend(out[i : i + a + 1])
        i += a + 1
    return {
        "per_drafted": accepted / drafted,
        "per_examined": accepted / examined,
        "tokens_per_round": (accepted + rounds) / rounds,
    }


# -- the wait ------------------------------------------------------------------------------


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    recorded: list[float] = []
    monkeypatch.setattr(sm, "wait", recorded.append)
    return recorded


@pytest.mark.parametrize("per_token_ms", [0.0, 0.25])
def test_forward_waits_a_plus_b_rows_tokens(waits, per_token_ms):
    cfg = sm.StandinConfig(forward_ms=1.5, per_token_ms=per_token_ms, period=P)
    m = sm.StandinForCausalLM(cfg).eval()
    with torch.inference_mode():
        m(torch.full((1, 1), 7))  # a decode step
        m(torch.full((3, 5), 7))  # a padded batch: pads count
        m.get_decoder()(torch.full((2, 4), 7))  # the batched path's decoder alone
    assert waits == [1.5 + per_token_ms * t for t in (1, 15, 8)]
    assert sm.forward_ms(cfg, 3, 5) == 1.5 + per_token_ms * 15


def test_period_zero_waits_and_emits_as_before(waits):
    """No per-token cost and period 0: the fixed wait, and the tables' tokens."""
    m = sm.StandinForCausalLM(sm.StandinConfig(forward_ms=2.0)).eval()
    ids = torch.tensor([[5, 9, 200, 11]])
    with torch.inference_mode():
        logits = m(ids).logits[0]
    assert waits == [2.0]
    first, second = m.model.tables(ids.device)
    rows = torch.arange(4) % sm.PERIOD
    assert logits.argmax(-1).tolist() == first[rows, ids[0]].tolist()
    assert logits.topk(2).indices[:, 1].tolist() == second[rows, ids[0]].tolist()


# -- the cycle and its noise ---------------------------------------------------------------


def test_sequences_are_disjoint_and_prompts_avoid_them():
    cfg = sm.StandinConfig(period=P)
    s, noise, outside = sm.sequence(cfg), sm.noise_tokens(cfg), sm.outside(cfg)
    assert len(s) == len(set(s)) == P
    assert len(noise) == len(set(noise)) and len(noise) % P == 0 and len(noise) >= P
    assert len(outside) >= sm.PROMPT_TOKENS
    assert sorted(s + noise + outside) == sorted(cfg.allowed_ids)
    prompt = sm.prompt_ids(cfg, [3, 900, 3, 41])
    assert set(prompt) <= set(outside) and prompt[0] == prompt[2]
    with pytest.raises(ValueError):
        sm.StandinConfig(period=len(cfg.allowed_ids))


def test_generate_follows_the_cycle_but_at_noise_positions():
    cfg = sm.StandinConfig(forward_ms=0.0, period=P, noise=0.3)
    m = sm.StandinForCausalLM(cfg).eval()
    prompt = sm.prompt_ids(cfg, range(8))
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = m.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=120)
    got = out[0, len(prompt) :].tolist()
    # the token at sequence index t comes after the input at t - 1
    assert got == [expected_after(cfg, len(prompt) + j - 1) for j in range(120)]
    assert got == greedy(m, prompt, 120)
    noisy = [j for j in range(120) if sm.is_noise(cfg, len(prompt) + j - 1)]
    assert noisy and min(noisy) + len(prompt) - 1 >= cfg.noise_start == 2 * P
    assert set(got[: cfg.noise_start - len(prompt) + 1]) <= set(sm.sequence(cfg))


def test_noise_token_has_the_cycle_second():
    cfg = sm.StandinConfig(forward_ms=0.0, period=P, noise=0.5)
    m = sm.StandinForCausalLM(cfg).eval()
    positions = torch.arange(0, 400)[None]
    first, second = m.model.next_tokens(torch.zeros_like(positions), positions)
    s, noise = sm.sequence(cfg), sm.noise_tokens(cfg)
    for p in range(400):
        periodic, other = s[p % P], noise[p % len(noise)]
        want = (other, periodic) if sm.is_noise(cfg, p) else (periodic, other)
        assert (int(first[0, p]), int(second[0, p])) == want


@pytest.mark.parametrize("noise", [0.1, 0.3, 0.6])
def test_noise_share(noise):
    cfg = sm.StandinConfig(period=P, noise=noise)
    assert not any(sm.is_noise(cfg, p) for p in range(cfg.noise_start))
    span = range(cfg.noise_start, cfg.noise_start + 20000)
    share = sum(sm.is_noise(cfg, p) for p in span) / len(span)
    assert share == pytest.approx(noise, abs=0.015)


@pytest.mark.parametrize("disagree", [0.1, 0.3])
def test_drafter_agrees_at_one_minus_disagree_noise_included(disagree):
    target = model(period=P, noise=0.3)
    drafter = model(period=P, noise=0.3, disagree=disagree)
    prompt = sm.prompt_ids(target.config, range(8))
    seq = torch.tensor([prompt + greedy(target, prompt, 20000)])
    with torch.inference_mode():
        t = target(seq).logits[0]
        d = drafter(seq).logits[0]
    ours, theirs = t.argmax(-1), d.argmax(-1)
    agree = ours == theirs
    assert agree.float().mean().item() == pytest.approx(1 - disagree, abs=0.015)
    noisy = torch.tensor([sm.is_noise(target.config, p) for p in range(seq.shape[1])])
    assert noisy.float().mean().item() == pytest.approx(0.3, abs=0.02)
    assert agree[noisy].float().mean().item() == pytest.approx(1 - disagree, abs=0.02)
    misses = torch.tensor([sm.is_miss(drafter.config, p) for p in range(seq.shape[1])])
    assert torch.equal(~agree, misses)
    # where the drafter misses, the target's token is its runner-up
    assert torch.equal(d.topk(2).indices[:, 1][~agree], ours[~agree])


@pytest.mark.parametrize("noise", [0.0, 0.1, 0.3, 0.6])
def test_lookup_acceptance_follows_noise(noise):
    """Within the noise tokens' window (M positions) every noise token is new: per drafted
    token examined, prompt lookup's acceptance is 1 - the noise share of those positions."""
    cfg = sm.StandinConfig(forward_ms=0.0, period=P, noise=noise)
    m = sm.StandinForCausalLM(cfg).eval()
    prompt = sm.prompt_ids(cfg, range(8))
    n = cfg.noise_start + len(sm.noise_tokens(cfg)) - len(prompt)
    out = greedy(m, prompt, n)
    start = cfg.noise_start - len(prompt)  # the output's first period is clean, before it
    replay = replay_lookup(prompt, out, start)
    share = sum(sm.is_noise(cfg, len(prompt) + j - 1) for j in range(start, n)) / (n - start)
    assert share == pytest.approx(noise, abs=0.06)  # a few hundred positions
    assert replay["per_examined"] == pytest.approx(1 - share, abs=0.03)
    if noise == 0.0:
        assert replay["per_drafted"] == 1.0
        assert replay["tokens_per_round"] > 4.9  # k + 1, but the last round's


def test_lookup_and_drafter_acceptances_are_apart():
    """The drafter's agreement stays 1 - disagree whatever the noise; the lookup's drops."""
    target = model(period=P, noise=0.3)
    drafter = model(period=P, noise=0.3, disagree=0.1)
    prompt = sm.prompt_ids(target.config, range(8))
    n = target.config.noise_start + len(sm.noise_tokens(target.config)) - len(prompt)
    out = greedy(target, prompt, n)
    start = target.config.noise_start - len(prompt)
    seq = torch.tensor([prompt + out])
    with torch.inference_mode():
        agree = target(seq).logits[0].argmax(-1) == drafter(seq).logits[0].argmax(-1)
    drafter_share = agree[len(prompt) + start - 1 :].float().mean().item()
    lookup = replay_lookup(prompt, out, start)["per_examined"]
    assert drafter_share > 0.85 and lookup < 0.8


# -- the batched path ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options", [{}, {"period": P, "noise": 0.3}, {"period": P, "disagree": 0.3}]
)
def test_batched_path_equals_the_model(options):
    """The decoder over a right-padded batch with each row's positions, then the output
    layer, gives each row the logits of the model's own forward, prefill and decode steps
    on a cache alike."""
    m = model(**options)
    cfg = m.config
    rows = [list(range(40, 40 + 37)), list(range(90, 90 + 52))]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, tokens in enumerate(rows):
        ids[r, : len(tokens)] = torch.tensor(tokens)
    starts = [3, 70]  # rows continuing sessions of those lengths
    positions = torch.stack([torch.arange(s, s + width) for s in starts])
    with torch.inference_mode():
        hidden = m.get_decoder()(ids, position_ids=positions).last_hidden_state
        batched = m.get_output_embeddings()(hidden)
        for r, tokens in enumerate(rows):
            pre = [cfg.allowed_ids[0]] * starts[r]
            alone = m(torch.tensor([pre + tokens])).logits[0, starts[r] :]
            assert torch.equal(batched[r, : len(tokens)], alone)
            # step by step on a cache
            cache = DynamicCache()
            steps = [m(torch.tensor([pre + tokens[:1]]), cache=cache).logits[0, -1]]
            for t in tokens[1:]:
                steps.append(m(torch.tensor([[t]]), cache=cache).logits[0, -1])
            assert cache.get_seq_length() == starts[r] + len(tokens)
            assert torch.equal(torch.stack(steps), alone)


# -- the model directories -----------------------------------------------------------------


def test_build_standins_carries_the_options(tmp_path):
    models = build_standins(
        tmp_path, 1.0, 0.5, 0.8, target_per_token_ms=0.1, draft_per_token_ms=0.05,
        period=P, noise=0.2,
    )  # fmt: skip
    assert models.noise_start == 2 * P and len(models.sequence) == P
    target = AutoModelForCausalLM.from_pretrained(models.target, trust_remote_code=True).eval()
    draft = AutoModelForCausalLM.from_pretrained(models.draft, trust_remote_code=True).eval()
    for loaded, ms, per_token, disagree in ((target, 1.0, 0.1, 0.0), (draft, 0.5, 0.05, 0.2)):
        c = loaded.config
        assert (c.forward_ms, c.per_token_ms, c.disagree) == (
            ms,
            per_token,
            pytest.approx(disagree),
        )
        assert (c.period, c.noise, c.noise_start) == (P, 0.2, 2 * P)
        assert tuple(sm.sequence(c)) == models.sequence
    saved = json.loads((models.target / "config.json").read_text())
    assert saved["period"] == P and saved["per_token_ms"] == 0.1
    prompt = models.prompt_ids(range(10))
    assert not set(prompt) & (set(models.sequence) | set(sm.noise_tokens(target.config)))
    x = torch.tensor([prompt])
    target.config.forward_ms = target.config.per_token_ms = 0.0
    with torch.inference_mode():
        out = target.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=60
        )
    cfg = target.config
    want = [expected_after(cfg, len(prompt) + j - 1) for j in range(60)]
    assert out[0, len(prompt) :].tolist() == want
