"""The exactness checks one stack variant repeats (a compiled verifier, packed weights):
greedy through the gateway equals transformers' generate() on the target, token for
token. Helpers, not tests: each test file starts its own stack and calls these."""

from __future__ import annotations

from specdec.sdk import Client


def greedy_equals_generate(stack, which, k, prompts, tokenizer, reference, n, timeout):
    """Every prompt through gateway `which` ("plain" or "ssd") at draft length k."""
    with Client(stack[which].address, timeout=timeout) as client:
        for text in prompts:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=n, k=k)
            assert list(got.tokens) == reference(ids, n), f"{which} k={k} {text!r}"
            assert got.stats.ssd is (which == "ssd")


def second_turn_equals_generate(client, prompts, session_id, tokenizer, reference, n):
    """Two turns of one session at k = 3: the second equals generate() on the whole
    history (first prompt, its answer, second prompt)."""
    first = tokenizer(prompts[0]).input_ids
    one = client.generate(token_ids=first, max_new_tokens=8, k=3, session_id=session_id)
    more = tokenizer(prompts[1]).input_ids
    two = client.generate(token_ids=more, max_new_tokens=n, k=3, session_id=session_id)
    assert list(two.tokens) == reference([*first, *one.tokens, *more], n)
