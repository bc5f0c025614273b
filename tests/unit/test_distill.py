"""`specdec distill` on the tiny fp32 models: a poor drafter gets measurably closer to its
target, LoRA merges into a plain checkpoint, a resumed run equals an uninterrupted one,
and the stdlib prompts are disjoint from the bench's."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdec.cli import main as specdec
from specdec.common.version import VERSION_FILE, read_model_version
from specdec.tools.bench.modes import load_prompts
from specdec.tools.distill.data import Sequence, read_rows
from specdec.tools.distill.prompts import bench_prompts, build_prompts, write_prompts
from specdec.tools.distill.train import collate, labels_of, losses, recorded_top, teacher_top

N_PROMPTS = 96
ON_POLICY_MARGIN = 0.1  # held-out agreement gained by --on-policy (see its test)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("distill") / "prompts.jsonl"
    write_prompts(path, build_prompts(N_PROMPTS, seed=1, exclude=bench_prompts()))
    return path


def distill_args(test_models, out, *extra: str) -> list[str]:
    return [
        "distill",
        "--target-model",
        str(test_models.target),
        "--draft-model",
        str(test_models.draft_small),
        "--out",
        str(out),
        "--batch-size",
        "8",
        "--max-length",
        "256",
        "--threads",
        "1",
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def distilled(test_models, prompt_file, tmp_path_factory):
    """draft_small (an independently initialised model: it almost never agrees with the
    target) distilled on the target's greedy outputs for stdlib prompts."""
    out = tmp_path_factory.mktemp("distill") / "drafter"
    argv = distill_args(test_models, out, "--prompts", str(prompt_file))
    argv += ["--steps", "150", "--lr", "3e-3", "--train-head", "--max-new-tokens", "48"]
    assert specdec(argv) == 0
    return out


def test_stdlib_prompts_are_disjoint_from_the_bench(tmp_path):
    rows = build_prompts(150, seed=0, exclude=bench_prompts())
    assert len(rows) == 150
    assert {r["kind"] for r in rows} == {"code", "prose", "chat"}
    texts = [r.get("prompt") or r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == len(texts)
    for b in bench_prompts():
        bench_text = b.get("prompt") or b["messages"][0]["content"]
        assert not any(bench_text in t or t in bench_text for t in texts)
    path = tmp_path / "p.jsonl"
    write_prompts(path, rows)
    assert [p.kind for p in load_prompts(str(path))] == [r["kind"] for r in rows]
    assert specdec(["distill", "prompts", "--out", str(tmp_path / "q.jsonl"), "--count", "9"]) == 0
    assert len(load_prompts(str(tmp_path / "q.jsonl"))) == 9


def test_distill_raises_held_out_agreement_by_a_clear_margin(distilled):
    report = json.loads((distilled / VERSION_FILE).read_text())
    held = report["held_out"]
    before, after = held["before"], held["after"]
    assert held["positions"] >= 200
    assert before["greedy_agreement"] < 0.05  # a poor drafter to start from
    assert after["greedy_agreement"] >= before["greedy_agreement"] + 0.12
    assert after["sum_min_pq"] >= before["sum_min_pq"] + 0.08
    version = read_model_version(str(distilled))
    assert version == report["version"] and version.startswith("distill-")
    assert report["cost"]["trained_positions_this_run"] > 0
    assert report["cost"]["peak_rss_mib"] > 0


def test_lora_is_merged_into_a_plain_checkpoint(test_models, distilled, tmp_path):
    out = tmp_path / "lora"
    argv = distill_args(test_models, out, "--data", str(distilled / "distill"))
    argv += ["--steps", "10", "--lr", "3e-3", "--lora-rank", "4", "--version", "lora-v1"]
    assert specdec(argv) == 0
    weights = load_file(out / "model.safetensors")
    assert not [k for k in weights if "lora" in k]
    base = load_file(test_models.draft_small / "model.safetensors")
    assert set(weights) == set(base)
    changed = [k for k in base if not torch.equal(base[k], weights[k])]
    assert any("q_proj" in k for k in changed)  # the adapters' product is in the weights
    assert read_model_version(str(out)) == "lora-v1"


def test_a_resumed_run_equals_an_uninterrupted_one(test_models, distilled, tmp_path, capsys):
    data = ["--data", str(distilled / "distill"), "--lr", "3e-3", "--save-every", "4"]
    straight = tmp_path / "straight"
    assert specdec([*distill_args(test_models, straight, *data), "--steps", "8"]) == 0
    split = tmp_path / "split"
    assert specdec([*distill_args(test_models, split, *data), "--steps", "4"]) == 0
    assert specdec([*distill_args(test_models, split, *data), "--steps", "8"]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert specdec([*distill_args(test_models, split, *data), "--steps", "8", "--resume"]) == 0
    a, b = load_file(straight / "model.safetensors"), load_file(split / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    argv = [*distill_args(test_models, split, *data), "--steps", "9", "--resume", "--lr", "1e-3"]
    assert specdec(argv) == 2
    assert "other settings (lr)" in capsys.readouterr().err


def test_bad_arguments_are_named(test_models, distilled, tmp_path, capsys):
    assert specdec(["distill", "--target-model", str(test_models.target)]) == 2
    err = capsys.readouterr().err
    assert "--draft-model" in err and "--out" in err and "--data or --prompts" in err
    data = ["--data", str(distilled / "distill")]
    for flags, message in (
        (["--top-m", "100000"], "--top-m must be at most the vocabulary"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--holdout", "1"], "--holdout must be in (0, 1)"),
        (["--train-layers", "7"], "--train-layers 7: layers are 0..1"),
    ):
        out = tmp_path / flags[0].strip("-")
        assert specdec([*distill_args(test_models, out, *data), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert specdec([*distill_args(test_models, tmp_path / "x", "--data", str(tmp_path))]) == 2
    assert "no record-*.jsonl files" in capsys.readouterr().err


def test_the_output_keeps_the_parents_dtype(test_models, distilled, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent = tmp_path / "bf16"
    model = AutoModelForCausalLM.from_pretrained(test_models.draft_small, dtype=torch.bfloat16)
    model.save_pretrained(parent)
    AutoTokenizer.from_pretrained(test_models.draft_small).save_pretrained(parent)
    out = tmp_path / "out"
    argv = distill_args(test_models, out, "--data", str(distilled / "distill"), "--steps", "2")
    argv[argv.index(str(test_models.draft_small))] = str(parent)
    assert specdec(argv) == 0  # trains in float32 (--dtype), saves as its parent
    assert {w.dtype for w in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


def test_batched_target_outputs_equal_one_prompt_at_a_time(target_model, tokenizer):
    """--gen-batch-size: prompts of different lengths continued together (left-padded)
    give each prompt the target's own greedy continuation, cut after its end token."""
    from specdec.tools.distill.data import batch_generate

    texts = ["def f(x):", "The history of", "a b c d e f g h i j", "import os\nimport sys\n"]
    prompts = [tokenizer(t).input_ids for t in texts]
    eos = tokenizer.eos_token_id
    got = batch_generate(target_model, prompts, "cpu", 12, eos, eos)
    for ids, out in zip(prompts, got, strict=True):
        x = torch.tensor([ids])
        with torch.inference_mode():
            y = target_model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                eos_token_id=eos, pad_token_id=eos,
            )  # fmt: skip
        assert out == y[0, len(ids) :].tolist()


@pytest.mark.parametrize("max_length", [64, 9, 5], ids=["whole", "prompt-cut", "output-cut"])
def test_recorded_top_m_lines_up_with_the_teacher_forward(max_length):
    """The KL's target from recorded rows (a gateway's --record-top-logprobs) is the one a
    teacher forward gives, position for position, also where collate cuts the sequence;
    so is the loss. log-probabilities and logits differ by a constant per row: the KL
    renormalises over the m either way."""
    torch.manual_seed(0)
    vocab, m = 32, 4
    prompts, outputs = [(1, 2, 3, 4), (5, 6)], [(7, 8, 9, 10, 11), (12, 13, 14)]
    widths = [len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)]
    logits = torch.randn(2, max(widths), vocab)  # the target's, at every position
    seqs = []
    for b, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        # output token j is predicted at position len(p) + j - 1
        rows = logits[b, len(p) - 1 : len(p) - 1 + len(o)].log_softmax(-1).topk(m, dim=-1)
        seqs.append(Sequence(p, o, tuple(map(tuple, rows.indices.tolist())),
                             tuple(map(tuple, rows.values.tolist()))))  # fmt: skip
    ids, _, predicts = collate(seqs, max_length, 0, "cpu")
    # the teacher forward of the cut batch sees each sequence's kept tail
    cut = torch.zeros(2, ids.shape[1], vocab)
    for b, width in enumerate(widths):
        start = max(0, width - max_length)
        cut[b, : width - start] = logits[b, start:width]
    teacher = teacher_top(cut, predicts, m)
    recorded = recorded_top(seqs, max_length, m, "cpu")
    assert torch.equal(recorded[0], teacher[0])
    assert torch.allclose(recorded[1].log_softmax(-1), teacher[1].log_softmax(-1), atol=1e-5)
    draft = torch.randn(2, ids.shape[1], vocab)
    got, want = losses(draft, recorded, ids, predicts), losses(draft, teacher, ids, predicts)
    assert [x.item() for x in got] == pytest.approx([x.item() for x in want], abs=1e-5)
    assert recorded_top([*seqs, Sequence((1,), (2,))], max_length, m, "cpu") is None


def test_on_policy_labels_are_the_targets_greedy_tokens():
    """On a sequence the drafter wrote, the CE's label at each position is the target's
    greedy token there (the teacher's top-1), not the drafter's next token; a target
    sequence keeps its own next tokens."""
    seqs = [Sequence((1, 2), (3, 4), on_policy=True), Sequence((5, 6), (7, 8))]
    ids, _, predicts = collate(seqs, 64, 0, "cpu")
    top_ids = torch.tensor([[30, 0], [40, 0], [70, 0], [80, 0]])  # [n = 4, m = 2]
    assert labels_of(seqs, ids, predicts, top_ids).tolist() == [30, 40, 7, 8]


def test_on_policy_distillation_trains_where_the_drafter_goes(test_models, prompt_file, tmp_path):
    """--on-policy: the poor drafter continues the prompts itself, the target labels every
    position of those sequences, and held-out agreement on such sequences (the positions
    greedy speculation drafts from) rises by a clear margin."""
    out = tmp_path / "on-policy"
    argv = distill_args(test_models, out, "--prompts", str(prompt_file), "--on-policy")
    argv += ["--steps", "150", "--lr", "3e-3", "--train-head", "--max-new-tokens", "48"]
    assert specdec(argv) == 0
    report = json.loads((out / VERSION_FILE).read_text())
    data = report["data"]
    assert data["generated_by"] == "drafter"
    assert data["train_sequences_on_policy"] == data["train_sequences"] > 0
    rows = read_rows(out / "distill" / "data.jsonl")
    assert {r["output_source"] for r in rows} == {"drafter"}
    before, after = report["held_out"]["before"], report["held_out"]["after"]
    assert after["greedy_agreement"] >= before["greedy_agreement"] + ON_POLICY_MARGIN
    # on-policy data comes from prompts: a recording is the target's already
    argv = distill_args(test_models, tmp_path / "x", "--data", str(out / "distill"))
    assert specdec([*argv, "--on-policy"]) == 2
