"""`specdec distill --head` on the tiny fp32 target (docs/concepts/heads.md, "How to train
one"): training lowers the loss against its own start and raises held-out agreement, the
same seed writes the same head, the folder loads in the head drafter, which reports its
version and drafts what training predicted, every data source trains, and bad input is
refused with a message that names it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdec.cli import main as specdec
from specdec.common.prefix import prefix_hash
from specdec.common.settings import ConfigError
from specdec.common.version import VERSION_FILE, read_model_version
from specdec.drafter.config import DrafterConfig
from specdec.drafter.head import HeadDraftCall, HeadRuntime
from specdec.drafter.server import DrafterServicer
from specdec.drafter.speculate import BranchStore
from specdec.replica.engine import Prefix
from specdec.replica.sampling import SamplingParams
from specdec.tools.distill.data import Sequence, write_rows
from specdec.tools.distill.head import kept_ids, load_head, shifted
from specdec.tools.distill.prompts import bench_prompts, build_prompts, write_prompts

N_PROMPTS = 96


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "prompts.jsonl"
    write_prompts(path, build_prompts(N_PROMPTS, seed=1, exclude=bench_prompts()))
    return path


def head_args(test_models, out, *extra: str) -> list[str]:
    return [
        "distill", "--head", "--target-model", str(test_models.target), "--out", str(out),
        "--batch-size", "4", "--max-length", "96", "--max-new-tokens", "24", "--threads", "1",
        "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(test_models, prompt_file, tmp_path_factory):
    """A head trained with the training-time test on the target's outputs for stdlib
    prompts; its report."""
    out = tmp_path_factory.mktemp("head") / "head"
    argv = head_args(test_models, out, "--prompts", str(prompt_file), "--steps", "150")
    assert specdec([*argv, "--lr", "3e-3", "--ttt", "--seed", "3"]) == 0
    return out, json.loads((out / VERSION_FILE).read_text())


def test_training_lowers_the_loss_and_raises_agreement(trained):
    _, report = trained
    first, last = report["first_losses"], report["final_losses"]
    assert set(first) == {"loss", "feature1", "token1", "feature2", "token2"}  # --ttt
    assert last["loss"] < 0.6 * first["loss"], (first, last)
    for part in ("feature1", "token1", "feature2", "token2"):
        assert last[part] < first[part], (part, first, last)
    before, after = report["held_out"]["before"], report["held_out"]["after"]
    assert after["greedy_agreement"] > before["greedy_agreement"] + 0.08
    assert after["greedy_agreement_own_feature"] > before["greedy_agreement_own_feature"]
    assert report["kind"] == "head" and report["feature_layer"] == 2
    assert report["version"].startswith("head-")


def test_the_same_seed_writes_the_same_head(test_models, prompt_file, tmp_path):
    def train(name: str, seed: str) -> bytes:
        out = tmp_path / name
        argv = head_args(test_models, out, "--prompts", str(prompt_file), "--steps", "4")
        assert specdec([*argv, "--lr", "1e-3", "--seed", seed, "--ttt"]) == 0
        return (out / "model.safetensors").read_bytes()

    a, b, other = train("a", "5"), train("b", "5"), train("c", "6")
    assert a == b
    assert a != other
    assert read_model_version(str(tmp_path / "a")) == read_model_version(str(tmp_path / "b"))


def test_the_folder_serves_what_training_predicted(trained, test_models, tokenizer, target_model):
    """The head drafter loads the folder, reports its version (not the target's), and its
    first draft token, given the target's features, is the training model's prediction."""
    out, report = trained
    drafted, predicted, version, _ = _served_and_predicted(
        out, test_models, tokenizer, target_model, vocab=0
    )
    assert version == report["version"]
    assert drafted[0] == predicted


def test_a_head_trained_over_a_draft_vocabulary_drafts_it(
    test_models, prompt_file, tokenizer, target_model, tmp_path
):
    """--draft-vocab N trains the token loss over the ids the drafter keeps with the same
    flag; served with it, the head's first draft is training's prediction over those ids,
    and the held-out agreement is counted against the target's top token over all ids."""
    out = tmp_path / "head"
    argv = head_args(test_models, out, "--prompts", str(prompt_file), "--steps", "40")
    assert specdec([*argv, "--lr", "3e-3", "--seed", "3", "--draft-vocab", "200"]) == 0
    report = json.loads((out / VERSION_FILE).read_text())
    assert report["settings"]["draft_vocab"] == 200
    assert report["held_out"]["after"]["greedy_agreement"] > 0
    drafted, predicted, _, eos = _served_and_predicted(
        out, test_models, tokenizer, target_model, vocab=200
    )
    assert drafted[0] == predicted
    assert all(t < 200 or t in eos for t in drafted)


def _served_and_predicted(out, test_models, tokenizer, target_model, vocab: int):
    """The head drafter's draft from the folder `out` (--draft-vocab `vocab`), given the
    target's features of a code prefix, and training's own first prediction there; the
    drafter's model version and end-of-sequence ids."""
    cfg = DrafterConfig(
        role="drafter", model=str(test_models.target), head=str(out), draft_vocab=vocab
    )
    rt = HeadRuntime(cfg)
    rt.load()
    try:
        version = DrafterServicer(rt).model_version
        ids = tokenizer("def read_lines(path):\n    with open(path) as f:").input_ids
        features = _features(target_model, ids)
        call = HeadDraftCall(
            runtime=rt, branches=BranchStore(), session_id="t/1",
            prefix=Prefix(0, prefix_hash([])), new_tokens=ids, k=3,
            params=SamplingParams(temperature=0.0), features=((0, features),),
        )  # fmt: skip
        drafted = rt.drive(call.job()).tokens
        eos = list(rt.eos_token_ids)
    finally:
        rt.shutdown()
    head = load_head(out, test_models.target, torch.float32, "cpu")
    if vocab:
        head.keep(kept_ids(target_model, vocab))
    with torch.no_grad():
        h = head.hidden(torch.tensor([ids]), shifted(features[None]))
        top = int(head.log_probs(h[0, -1:]).argmax())
    predicted = int(head.kept[top]) if head.kept is not None else top
    return drafted, predicted, version, eos


def _features(model, ids: list[int]) -> torch.Tensor:
    """The target's last layer's output (before the final norm) at every position [n, 64]."""
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: seen.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    return seen["h"][0].clone()


def test_local_text_and_recordings_train_heads(test_models, tokenizer, tmp_path):
    """--text (local source files, cut into pieces) and --data (a gateway's recordings)."""
    import specdec.tools.distill as package

    source = tmp_path / "source"
    shutil.copytree(package.__path__[0], source, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "from-text"
    assert specdec([*head_args(test_models, out, "--text", str(source), "--steps", "2")]) == 0
    report = json.loads((out / VERSION_FILE).read_text())
    assert report["data"]["source"] == "text" and report["data"]["train_sequences"] > 1

    rows = [
        Sequence(tuple(tokenizer(t).input_ids), tuple(tokenizer(" and so on").input_ids))
        for t in ("The quick brown fox", "def fibonacci(n):", "import numpy as np")
    ]
    write_rows(tmp_path / "record" / "record-1.jsonl", rows, str(test_models.target))
    out = tmp_path / "from-data"
    argv = head_args(test_models, out, "--data", str(tmp_path / "record"), "--steps", "2")
    assert specdec([*argv, "--version", "head-from-data"]) == 0
    assert read_model_version(str(out)) == "head-from-data"


def test_resume_reuses_the_target_outputs_an_interrupted_run_collected(
    test_models, tokenizer, prompt_file, tmp_path
):
    """--resume with --head: the target's outputs for --prompts that a run into OUT wrote
    before it stopped are read back, not generated again."""
    rows = [
        Sequence(
            tuple(tokenizer(f"def f{i}(x):").input_ids), tuple(tokenizer(" return x").input_ids)
        )
        for i in range(7)
    ]
    out = tmp_path / "head"
    write_rows(out / "distill" / "data.jsonl", rows, str(test_models.target))
    argv = head_args(test_models, out, "--prompts", str(prompt_file), "--steps", "2", "--resume")
    assert specdec(argv) == 0
    data = json.loads((out / VERSION_FILE).read_text())["data"]
    assert data["source"] == "prompts" and "generated_tokens" not in data
    assert data["train_sequences"] + data["held_out_sequences"] == len(rows)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--feature-layer", "9"), "--feature-layer 9: the target's decoder layers are 0..2"),
        (("--draft-model", "x"), "--draft-model is a draft model's, not a head's"),
        (("--lora-rank", "4"), "--lora-rank is a draft model's, not a head's"),
        (("--steps", "-1"), "--steps must be >= 0"),
        (("--feature-weight", "0", "--token-weight", "0"), "not both 0"),
        (("--draft-vocab", "-1"), "--draft-vocab must be >= 0"),
        (("--draft-vocab", "10000000"), "--draft-vocab must be <= "),
    ],
)
def test_bad_flags_are_named(test_models, prompt_file, tmp_path, capsys, extra, message):
    argv = head_args(test_models, tmp_path / "out", "--prompts", str(prompt_file), *extra)
    assert specdec(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_data_and_folders_are_named(test_models, tmp_path, capsys):
    def refused(argv: list[str], message: str) -> None:
        assert specdec(argv) == 2
        assert message in capsys.readouterr().err

    out = str(tmp_path / "out")
    refused(["distill", "--head", "--target-model", str(test_models.target), "--out", out],
            "missing --data, --prompts or --text")  # fmt: skip
    refused(["distill", "--head", "--target-model", str(tmp_path / "none"), "--out", out,
             "--text", str(tmp_path)], "not a model folder (no config.json)")  # fmt: skip
    refused(["distill", "--target-model", str(test_models.target), "--draft-model",
             str(test_models.draft_small), "--out", out, "--text", str(tmp_path)],
            "--text trains heads only (--head)")  # fmt: skip
    refused(["distill", "--target-model", str(test_models.target), "--draft-model",
             str(test_models.draft_small), "--out", out, "--prompts", str(tmp_path),
             "--draft-vocab", "64"], "--draft-vocab trains heads only (--head)")  # fmt: skip
    row = Sequence((5, 6), (10**6,))  # recorded with a model of a larger vocabulary
    write_rows(tmp_path / "record" / "record-1.jsonl", [row, row], str(test_models.target))
    refused(head_args(test_models, out, "--data", str(tmp_path / "record")),
            "outside the target's vocabulary")  # fmt: skip
    refused(head_args(test_models, out, "--text", str(tmp_path / "nothing-here")),
            "no such file or folder")  # fmt: skip


def test_a_head_folder_that_does_not_fit_is_refused(trained, test_models, tmp_path):
    """At the drafter's start: a vocabulary other than the target's, a head that names no
    feature layer, a folder without its weights."""
    out, _ = trained

    def broken(name: str, edit) -> str:
        folder = tmp_path / name
        shutil.copytree(out, folder, ignore=shutil.ignore_patterns("distill"))
        config = json.loads((folder / "config.json").read_text())
        edit(folder, config)
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    def load(head: str) -> None:
        rt = HeadRuntime(DrafterConfig(role="drafter", model=str(test_models.target), head=head))
        try:
            rt.load_weights()
        finally:
            rt.shutdown()

    vocab = broken("vocab", lambda _f, c: c.update(vocab_size=c["vocab_size"] + 7))
    with pytest.raises(ConfigError, match=r"the head's vocabulary \(\d+\) is not the target's"):
        load(vocab)
    layers = broken("layers", lambda _f, c: c["specdec_head"].pop("feature_layers"))
    with pytest.raises(ConfigError, match="feature_layers must be a list of layer indices"):
        load(layers)
    weights = broken("weights", lambda f, _c: (f / "model.safetensors").unlink())
    with pytest.raises(ConfigError, match="is not a head folder"):
        load(weights)
