"""The bench's peer driver (specdec.tools.bench.peers) without the peers installed: the
availability reasons, the worker protocol through fake workers, and the real workers'
error path (their libraries are not in the project's venv)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from specdec.tools.bench import peers
from specdec.tools.bench.peers import PEERS, Peer, PeerError

MODELS = dict(target_gguf="/m/t.gguf", draft_gguf="/m/d.gguf", target_dir="/m/t", draft_dir="/m/d")

# Echoes the job back as results: one token id per prompt character (up to max_new_tokens),
# an acceptance for speculative modes, and the whole job under "job".
ECHO_WORKER = """
import json, sys
job = json.loads(sys.stdin.read())
print("a library's chatter on stdout")
results = []
for i, p in enumerate(job["prompts"]):
    row = {"prompt_index": i, "token_ids": [ord(c) for c in p][: job["max_new_tokens"]],
           "seconds": 0.5}
    if job["mode"] != "target":
        row["acceptance"] = 0.75
    results.append(row)
print(json.dumps({"peer": job["peer"], "version": "fake 1.0", "mode": job["mode"],
                  "job": job, "results": results}))
"""

FAILING_WORKER = """
import sys
sys.stdin.read()
for i in range(40):
    print(f"log line {i}", file=sys.stderr)
print("RuntimeError: the engine fell over", file=sys.stderr)
sys.exit(3)
"""

REFUSING_WORKER = """
import json, sys
job = json.loads(sys.stdin.read())
if job["mode"].startswith("draft"):
    print("no draft models here", file=sys.stderr)
    print(json.dumps({"error": "draft models are not supported"}))
    sys.exit(1)
print(json.dumps({"results": [{"prompt_index": 0, "token_ids": [1, 2], "seconds": 2.0}]}))
"""


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    """A peer 'fake' installed in tmp_path (its python: this interpreter), whose worker
    is the source given to the returned function."""
    monkeypatch.setenv("SPECDEC_PEERS", str(tmp_path / "peers"))
    workers = tmp_path / "workers"
    workers.mkdir()
    monkeypatch.setattr(peers, "WORKERS_DIR", workers)
    peer = Peer(
        name="fake", venv_name="bench-fake", worker="fake_worker.py", pip_steps=(("fake==1.0",),)
    )
    monkeypatch.setitem(PEERS, "fake", peer)

    def make(source: str) -> Peer:
        (workers / peer.worker).write_text(textwrap.dedent(source))
        peer.python.parent.mkdir(parents=True, exist_ok=True)
        if not peer.python.exists():
            peer.python.symlink_to(sys.executable)
        (peer.venv / ".installed").write_text(peer.pin + "\n")
        return peer

    return make


def test_peers_have_their_own_venvs_and_workers():
    assert set(PEERS) == {"vllm", "llamacpp"}
    for peer in PEERS.values():
        assert peer.venv.name.startswith("bench-")
        assert ".venv" not in peer.venv.parts
        assert (peers.WORKERS_DIR / peer.worker).is_file()
        assert peer.install_command.startswith("python3 -m venv ")
    # torch's local CPU wheel goes in before vLLM, so nothing resolves a CUDA build.
    assert PEERS["vllm"].pip_steps[0] == (f"torch=={peers.TORCH_VER}",)


def test_availability_reasons_without_an_install(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_PEERS", str(tmp_path / "nowhere"))
    assert "unknown peer" in peers.peer_available("tgi")
    for name in PEERS:
        reason = peers.peer_available(name)
        assert reason.startswith(f"{name}: not installed")
        assert "make peer-bench-install" in reason and "\n" not in reason


def test_availability_reasons(tmp_path, monkeypatch, fake_peer):
    peer = fake_peer(ECHO_WORKER)
    assert peers.peer_available("fake") is None
    (peer.venv / ".installed").write_text("fake==0.9\n")
    assert "another version" in peers.peer_available("fake")
    (peer.venv / ".installed").unlink()
    assert "did not finish" in peers.peer_available("fake")
    (peer.venv / ".installed").write_text(peer.pin)
    (peers.WORKERS_DIR / peer.worker).unlink()
    assert "worker script" in peers.peer_available("fake")


def test_run_peer_round_trip(fake_peer):
    fake_peer(ECHO_WORKER)
    rows = peers.run_peer(
        "fake",
        **MODELS,
        prompts=["abc", "hello"],
        max_new_tokens=4,
        modes=["target", "draft k=3"],
        threads=2,
        dtype="bfloat16",
    )
    assert [(r["mode"], r["prompt_index"]) for r in rows] == [
        ("target", 0),
        ("target", 1),
        ("draft k=3", 0),
        ("draft k=3", 1),
    ]
    first, last = rows[0], rows[-1]
    assert first["peer"] == "fake" and first["version"] == "fake 1.0"
    assert first["token_ids"] == [97, 98, 99] and first["tokens"] == 3
    assert first["seconds"] == 0.5 and first["tokens_per_second"] == 6.0
    assert "acceptance" not in first
    assert last["tokens"] == 4 and last["acceptance"] == 0.75


def test_the_job_reaches_the_worker_whole(fake_peer):
    fake_peer(ECHO_WORKER)
    peer = PEERS["fake"]
    job = {
        "peer": "fake",
        "mode": "ngram k=3",
        **MODELS,
        "prompts": ["<|im_start|>x\n"],
        "max_new_tokens": 48,
        "threads": 1,
        "dtype": "float32",
    }
    answer = peers.run_worker(peer.python, peers.WORKERS_DIR / peer.worker, job, peer="fake")
    assert answer["job"] == job


def test_a_crashing_worker_names_the_peer_and_its_stderr(fake_peer):
    fake_peer(FAILING_WORKER)
    with pytest.raises(PeerError) as e:
        peers.run_peer(
            "fake", **MODELS, prompts=["x"], max_new_tokens=2, modes=["target"], threads=1
        )
    text = str(e.value)
    assert "peer fake" in text and "exited 3" in text
    assert "RuntimeError: the engine fell over" in text
    assert "log line 39" in text and "log line 0\n" not in text  # the last lines only


def test_a_refused_mode_raises_or_becomes_an_error_row(fake_peer):
    fake_peer(REFUSING_WORKER)
    kwargs = dict(**MODELS, prompts=["x"], max_new_tokens=2, threads=1)
    with pytest.raises(PeerError, match="draft models are not supported"):
        peers.run_peer("fake", modes=["target", "draft k=3"], **kwargs)
    rows = peers.run_peer("fake", modes=["draft k=3", "target"], keep_going=True, **kwargs)
    assert rows[0]["mode"] == "draft k=3" and "no draft models here" in rows[0]["error"]
    assert rows[1] == {
        "peer": "fake",
        "mode": "target",
        "prompt_index": 0,
        "tokens": 2,
        "seconds": 2.0,
        "tokens_per_second": 1.0,
        "token_ids": [1, 2],
    }


def test_unavailable_and_unknown_modes_raise(tmp_path, monkeypatch, fake_peer):
    fake_peer(ECHO_WORKER)
    with pytest.raises(ValueError, match="unknown peer mode"):
        peers.run_peer(
            "fake", **MODELS, prompts=["x"], max_new_tokens=2, modes=["medusa"], threads=1
        )
    monkeypatch.setenv("SPECDEC_PEERS", str(tmp_path / "nowhere"))
    with pytest.raises(PeerError, match="fake: not installed"):
        peers.run_peer(
            "fake", **MODELS, prompts=["x"], max_new_tokens=2, modes=["target"], threads=1
        )


def _load_worker(name: str, monkeypatch):
    """The worker as its script run finds its sibling `protocol` (its folder on sys.path)."""
    monkeypatch.syspath_prepend(str(peers.WORKERS_DIR))
    path = Path(peers.WORKERS_DIR) / name
    spec = importlib.util.spec_from_file_location(name[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("worker", ["vllm_worker.py", "llamacpp_worker.py"])
def test_workers_are_self_contained_and_parse_the_modes(worker, monkeypatch):
    for name in (worker, "protocol.py"):
        source = (peers.WORKERS_DIR / name).read_text()
        assert "specdec" not in "".join(
            line for line in source.splitlines() if line.lstrip().startswith(("import", "from"))
        )
    module = _load_worker(worker, monkeypatch)
    assert module.parse_mode("target") == ("target", 0)
    assert module.parse_mode("ngram k=3") == ("ngram", 3)
    assert module.parse_mode("draft k=5") == ("draft", 5)
    with pytest.raises(ValueError):
        module.parse_mode("draft k=0")


@pytest.mark.parametrize("name", ["vllm", "llamacpp"])
def test_a_real_worker_without_its_library_answers_an_error(name, tmp_path, monkeypatch):
    """The real worker under this interpreter (no vllm / llama_cpp here, and the job's models
    do not exist): the protocol's error answer, raised with the peer's name."""
    if importlib.util.find_spec({"vllm": "vllm", "llamacpp": "llama_cpp"}[name]):
        pytest.skip("the peer's library is importable here")
    job = {
        "peer": name,
        "mode": "target",
        **MODELS,
        "prompts": ["x"],
        "max_new_tokens": 2,
        "threads": 1,
        "dtype": "float32",
    }
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # the worker sets it otherwise
    with pytest.raises(PeerError) as e:
        peers.run_worker(sys.executable, peers.WORKERS_DIR / PEERS[name].worker, job, peer=name)
    assert f"peer {name}, mode 'target'" in str(e.value)
    assert "ModuleNotFoundError" in str(e.value)


def test_install_reports_the_failed_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_PEERS", str(tmp_path / "peers"))
    broken = Peer(
        name="broken",
        venv_name="bench-broken",
        worker="x.py",
        pip_steps=(("--no-index", "--find-links", str(tmp_path), "no-such-pkg==1"),),
    )
    monkeypatch.setitem(PEERS, "broken", broken)
    broken.python.parent.mkdir(parents=True)
    broken.python.symlink_to(sys.executable)  # a venv there already: install runs pip only
    with pytest.raises(PeerError) as e:
        peers.install("broken")
    assert "peer broken" in str(e.value) and "no-such-pkg" in str(e.value)
    assert not (broken.venv / ".installed").exists()


def test_status_command(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_PEERS", str(tmp_path / "nowhere"))
    assert peers.main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.count("not installed") == 2


def test_the_answer_may_be_followed_by_shutdown_chatter(fake_peer):
    fake_peer(
        ECHO_WORKER + "print('{\"event\": \"engine shut down\"}')\nprint('INFO bye', flush=True)\n"
    )
    rows = peers.run_peer(
        "fake", **MODELS, prompts=["ab"], max_new_tokens=8, modes=["target"], threads=1
    )
    assert [r["token_ids"] for r in rows] == [[97, 98]]


def test_answer_json_is_the_last_stdout_line(fake_peer):
    fake_peer("import sys, json; sys.stdin.read(); print('{\"results\": []} junk')")
    with pytest.raises(PeerError, match="without results"):
        peers.run_peer(
            "fake", **MODELS, prompts=["x"], max_new_tokens=2, modes=["target"], threads=1
        )
