"""A head trained by `specdec distill --head` through real processes on loopback
(docs/concepts/heads.md, "How to train one"): trained to convergence on a tiny corpus, its
drafts there are accepted far more often than the untrained head's; greedy output with it
equals transformers' generate(), and each response names the head's version; and the
bench compares it with a draft model as the lead's run on the pretrained pair does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.cli import main as specdec
from specdec.common.version import VERSION_FILE
from specdec.sdk import Client
from specdec.tools.tinymodels import build_test_models
from tests.conftest import PROMPTS
from tests.integration.test_gateway import small_stack

pytestmark = pytest.mark.integration

N = 24


def train_head(target, out, prompts, *extra: str) -> dict:
    """`specdec distill --head` on the target's greedy outputs (N tokens) for `prompts`;
    the head's report."""
    prompt_file = out.parent / f"{out.name}-prompts.jsonl"
    prompt_file.write_text(
        "".join(json.dumps({"kind": "code", "prompt": p}) + "\n" for p in prompts)
    )
    argv = ["distill", "--head", "--target-model", str(target), "--out", str(out),
            "--prompts", str(prompt_file), "--max-new-tokens", str(N), "--threads", "1",
            "--no-progress", "--holdout", "0.1", *extra]  # fmt: skip
    assert specdec(argv) == 0
    return json.loads((out / VERSION_FILE).read_text())


@pytest.fixture(scope="module")
def corpus_head(test_models, tmp_path_factory):
    """A head trained to convergence on the target's outputs for the shared prompts, and
    the untrained head it started from (OUT/distill/initial)."""
    out = tmp_path_factory.mktemp("trained") / "head"
    report = train_head(test_models.target, out, PROMPTS, "--steps", "300", "--lr", "3e-3",
                        "--batch-size", "4", "--ttt")  # fmt: skip
    return {"trained": out, "untrained": out / "distill" / "initial", "report": report}


def acceptance(stack, tokenizer, reference) -> float:
    """Accepted over drafted tokens for every shared prompt at k = 4 (greedy output checked
    against generate() on the way)."""
    drafted = accepted = 0
    with Client(stack["gateway"].address, timeout=120) as client:
        for text in PROMPTS:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=4)
            assert list(got.tokens) == reference(ids, N), text
            drafted += got.stats.draft_tokens
            accepted += got.stats.accepted_tokens
    assert drafted > 0
    return accepted / drafted


def test_a_trained_head_is_accepted_more_and_stays_exact(
    test_models, corpus_head, tokenizer, reference
):
    """On the corpus it was trained on, the trained head's drafts are accepted far more
    often than the untrained head's; with either, greedy output is the target's
    generate() (chains), and every response names the head's version."""
    rates = {}
    for which in ("untrained", "trained"):
        head = str(corpus_head[which])
        with small_stack(test_models.target, test_models.target, "--head", head) as stack:
            rates[which] = acceptance(stack, tokenizer, reference)
            if which == "trained":
                with Client(stack["gateway"].address, timeout=120) as client:
                    ids = tokenizer(PROMPTS[0]).input_ids
                    got = client.generate(token_ids=ids, max_new_tokens=N, k=3)
                assert got.stats.drafter_version == corpus_head["report"]["version"]
    print(f"acceptance on the corpus: {rates}")
    assert rates["trained"] > rates["untrained"] + 0.3, rates


def test_the_bench_compares_a_head_with_a_draft_model(tmp_path):
    """The commands of docs/concepts/heads.md on tiny models: train a head on the target,
    then `specdec bench --drafters bf16,head=DIR`: the head's rows run on a stack of their
    own (the target as the drafter's --model), chains and SSD, reproduce the target's
    tokens, and report acceptance per position beside the draft model's, and the target's
    features that moved per round."""
    models = build_test_models(tmp_path / "models")  # what --tiny builds, the same weights
    head = tmp_path / "head"
    train_head(models.target, head, PROMPTS, "--steps", "20", "--lr", "3e-3")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec", "bench", "--tiny", str(tmp_path / "models")]
    cmd += ["--quick", "--max-new-tokens", "12", "--k", "3", "--ssd-k", "3", "--no-adaptive"]
    cmd += ["--drafters", f"bf16,head={head}", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    modes = result["modes"]
    assert {"k=3", "k=3 [head]", "ssd k=3 [head]", "draft [head]", "target [head]"} <= set(modes)
    assert result["meta"]["drafters"]["head"]["flags"] == ["--head", str(head)]
    for name in ("k=3", "k=3 [head]", "ssd k=3 [head]"):
        row = modes[name]
        assert row["exact"] and row["tokens"] == 3 * 12, name
        assert len(row["accepted_per_position"]) == 3
    assert modes["ssd k=3 [head]"]["ssd_hit_rate"] >= 0
    assert modes["k=3 [head]"]["feature_bytes_per_round"] > 0
    assert "feature_bytes_per_round" not in modes["k=3"]
    assert "verifier to head drafter): k=3 [head]" in (out / "results.md").read_text()
