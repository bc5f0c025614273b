"""`make gpu-check`: the engine's numbers on the machine it runs on, in one table.

Made for a GPU machine with no network (the Makefile's `gpu-check` installs what it needs
from carried wheels, see `wheels` below), and run on CPU with tiny models by the tests, so
that it is known to work before a GPU is at hand. Four measurements:

1. **Forwards.** The target-shaped model (random weights from the Qwen2.5-Coder 1.5B config;
   weights do not change the time) over T new tokens x B rows after a C-token context, eager
   and compiled (`torch.compile`; on CUDA `mode="reduce-overhead"`, which captures CUDA
   graphs), beside the **bandwidth bound**: the bytes a forward reads (every weight but the
   input embedding, of which it gathers a few rows) over the device's copy bandwidth,
   measured here. The cache is a `StaticCache` whose fill is set back after each forward,
   so every timed forward has the same shapes and addresses (what graph capture needs).
2. **c**: the drafter-shaped model's one-token step over the target's, eager and compiled:
   the draft/target cost ratio that speculation's gain depends on.
3. **The stack at k = 0** (drafter, verifier and gateway as processes on loopback, greedy,
   the SDK as client) against the same model decoding alone in this process
   (`transformers`' `generate`): what the services and their calls cost per token.
4. **Self-drafting**: the target as its own drafter at k = 4, where every draft token is
   accepted under greedy, against the stack at k = 0; the ideal is 5x, reached only where
   drafting is free and verifying 5 tokens costs one step.

The stack's model (on both replicas) has the target's shape but the test tokenizer's small
vocabulary (specdec.tools.tinymodels: its "loud" initialisation keeps greedy choices clear
of near-ties, so the self-drafting acceptance is 100% in float32 and close to it in
bfloat16). Without a GPU, `--shapes tiny` gives the same table for the tiny test models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The Qwen2.5-Coder 1.5B and 0.5B Instruct configs, as their GGUF files give them.
QWEN_COMMON = dict(
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)
SHAPES = {
    "qwen2.5-coder": {
        "target": dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
        ),
        "drafter": dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
        ),
    },
}

# The GPU machine's image (Python 3.12) has these; the project's other dependencies travel
# as wheels (`--download-wheels`), pinned to the versions installed here. Those in
# ALWAYS_CARRY travel even so: the image's are older than the project needs.
_GPU_IMAGE_NAMES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cycler cython einops filelock flatbuffers fonttools frozenlist fsspec grpcio h11
h5py hf-xet httpcore httpx huggingface-hub humanize idna iniconfig jinja2 joblib
kiwisolver markdown markdown-it-py markupsafe matplotlib mdurl mpmath msgpack multidict
networkx ninja numpy packaging pandas pathspec peft pillow pip pluggy prometheus-client
propcache protobuf psutil pyarrow pygments pyparsing pytest python-dateutil pyyaml regex
requests rich safetensors scipy sentencepiece setuptools shellingham six sympy tabulate
tokenizers torch tqdm transformers triton typer typing-extensions typing-inspect urllib3
uvloop werkzeug wheel wrapt xxhash yarl zipp"""
GPU_IMAGE = frozenset(_GPU_IMAGE_NAMES.split())
ALWAYS_CARRY = frozenset({"transformers", "protobuf", "grpcio"})
# The project is built there (pip --no-build-isolation) with the setuptools built here: its
# PEP 639 metadata needs setuptools 77 or later; the SDK's build generates its gRPC stubs
# with grpcio-tools (sdk/setup.py).
BUILD_CARRY = ("setuptools", "grpcio-tools")
NEVER_CARRY = ("torch", "triton", "nvidia-", "cuda-", "numpy")
ROOTS = ("specdec-gateway", "specdec-drafter", "specdec-verifier", "specdec-sdk")

IDEAL_SELF_DRAFT = 5.0  # k = 4, all accepted: five tokens a verifier forward


@dataclass
class Forward:
    model: str  # target | drafter
    tokens: int
    batch: int
    eager_ms: float
    compiled_ms: float | None
    bound_ms: float
    max_logit_diff: float | None = None  # compiled against eager, same inputs


@dataclass
class Report:
    device: str
    device_name: str
    dtype: str
    shapes: str
    torch: str
    transformers: str
    context: int
    copy_gb_s: float
    target_read_gb: float
    drafter_read_gb: float
    compile_seconds: float | None = None
    forwards: list[Forward] = field(default_factory=list)
    stack: dict = field(default_factory=dict)

    def forward(self, model: str, tokens: int, batch: int) -> Forward | None:
        return next(
            (f for f in self.forwards if (f.model, f.tokens, f.batch) == (model, tokens, batch)),
            None,
        )

    def c(self, compiled: bool) -> float | None:
        t, d = self.forward("target", 1, 1), self.forward("drafter", 1, 1)
        if t is None or d is None:
            return None
        if compiled:
            if t.compiled_ms is None or d.compiled_ms is None:
                return None
            return d.compiled_ms / t.compiled_ms
        return d.eager_ms / t.eager_ms


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], object], device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, megabytes: int) -> float:
    """Bytes a second a device-to-device copy moves, reads and writes counted."""
    import torch

    n = megabytes * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, iters=10)
    return 2 * n / (ms / 1e3)


def random_model(shape: dict, common: dict, dtype, device):
    """A Qwen2 model of this shape with its default random initialisation (timing only)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**common, **shape)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def read_bytes(model) -> int:
    """Bytes a forward reads: every parameter but the input embedding (a few rows of it)."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


class ForwardTimer:
    """Times one model's forwards of `tokens` x `batch` after `context` cached tokens."""

    def __init__(self, model, context: int, device, iters: int):
        self.model, self.context, self.device, self.iters = model, context, device, iters

    def time(self, tokens: int, batch: int, forward):
        """(median ms, the logits of one more forward) for `forward` at this shape."""
        import torch
        from transformers import StaticCache

        vocab = self.model.config.vocab_size
        gen = torch.Generator().manual_seed(tokens * 1000 + batch)
        prompt = torch.randint(0, vocab, (batch, self.context), generator=gen).to(self.device)
        new = torch.randint(0, vocab, (batch, tokens), generator=gen).to(self.device)
        positions = torch.arange(self.context, self.context + tokens, device=self.device)
        positions = positions[None].expand(batch, tokens)
        cache = StaticCache(config=self.model.config, max_cache_len=self.context + tokens)
        with torch.inference_mode():
            self.model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)

            def step():
                out = forward(
                    input_ids=new,
                    position_ids=positions,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=tokens,
                )
                for layer in cache.layers:  # back to the context: the same shapes each time
                    layer.cumulative_length.fill_(self.context)
                return out

            ms = _median_ms(step, self.device, self.iters)
            return ms, step().logits.float()


def time_forwards(report: Report, args, device, dtype) -> None:
    import torch

    shapes = _shapes(args)
    iters = args.iters or (30 if device.type == "cuda" else 5)
    bandwidth = report.copy_gb_s * 1e9
    compile_seconds = 0.0
    torch._dynamo.config.cache_size_limit = 64  # one graph per (tokens, batch)
    for name in ("target", "drafter"):
        model = random_model(shapes[name], shapes["common"], dtype, device)
        bound_ms = read_bytes(model) / bandwidth * 1e3
        timer = ForwardTimer(model, args.context, device, iters)
        compiled = None
        if args.compile_backend != "none":
            mode = "reduce-overhead" if device.type == "cuda" else None
            compiled = torch.compile(model, backend=args.compile_backend, mode=mode, dynamic=False)
        widths = args.tokens if name == "target" else [1]
        batches = args.batches if name == "target" else [1]
        for tokens in widths:
            for batch in batches:
                eager_ms, eager_logits = timer.time(tokens, batch, model)
                compiled_ms = diff = None
                if compiled is not None:
                    started = time.perf_counter()
                    timer.time(tokens, batch, compiled)  # compiles (and captures) this shape
                    compile_seconds += time.perf_counter() - started
                    compiled_ms, logits = timer.time(tokens, batch, compiled)
                    diff = (logits - eager_logits).abs().max().item()
                report.forwards.append(
                    Forward(name, tokens, batch, eager_ms, compiled_ms, bound_ms, diff)
                )
                _say(
                    f"{name} {tokens} x {batch}: eager {eager_ms:.2f} ms"
                    + (f", compiled {compiled_ms:.2f} ms" if compiled_ms is not None else "")
                    + f", bound {bound_ms:.2f} ms"
                )
        if name == "target":
            report.target_read_gb = read_bytes(model) / 1e9
        else:
            report.drafter_read_gb = read_bytes(model) / 1e9
        del model, compiled
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.compile_seconds = compile_seconds if args.compile_backend != "none" else None


def _shapes(args) -> dict:
    if args.shapes == "tiny":
        from specdec.tools import tinymodels

        common = dict(vocab_size=tinymodels.TOKENIZER_VOCAB_SIZE, max_position_embeddings=512)
        return {
            "target": tinymodels.TARGET_SHAPE,
            "drafter": tinymodels.DRAFT_SMALL_SHAPE,
            "common": common,
        }
    return {**SHAPES[args.shapes], "common": QWEN_COMMON}


def build_stack_model(root: Path, args) -> Path:
    """The target-shaped model with the test tokenizer, saved in float32."""
    from specdec.tools import tinymodels

    return tinymodels.build_shaped_model(root / "target", _shapes(args)["target"], name="target")


def in_process_ms_per_token(model_dir: Path, prompt: list[int], new: int, device, dtype) -> float:
    """Greedy decoding by `transformers`' generate, in this process: ms per new token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def run():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    return _median_ms(run, device, iters=3, warmup=1) / new


def stack_ms_per_token(target: Path, prompt, new, args) -> dict:
    """Greedy through drafter, verifier and gateway processes, the target on both replicas:
    k = 0 (the drafter is not called), and k = 4 with the target as its own drafter."""
    from specdec.sdk import Client
    from specdec.tools.launcher import ServiceProcess

    out: dict = {}
    procs = []
    try:
        for role in ("drafter", "verifier"):
            procs.append(
                ServiceProcess.specdec(
                    role,
                    *("serve", role, "--model", str(target), "--port", "0", "--host"),
                    *("127.0.0.1", "--dtype", args.stack_dtype, "--device", args.device),
                ).start()
            )
        for p in procs:
            p.wait_healthy(timeout=1200)
        gateway = ServiceProcess.specdec(
            "gateway",
            *("serve", "gateway", "--port", "0", "--host", "127.0.0.1", "--http-port", "0"),
            *("--drafter", procs[0].address, "--verifier", procs[1].address),
        ).start()
        procs.append(gateway)
        gateway.wait_healthy(timeout=300)
        with Client(gateway.address, timeout=1200) as client:
            for label, k in (("k0", 0), ("self_k4", 4)):

                def run(k=k):
                    return client.generate(
                        token_ids=prompt,
                        max_new_tokens=new,
                        ignore_eos=True,
                        k=k,
                        k_policy="fixed",
                        method="model",
                    )

                run()  # warm-up: opens the replicas' caches of the prompt for this k
                times = []
                for _ in range(3):
                    started = time.perf_counter()
                    generation = run()
                    times.append((time.perf_counter() - started) * 1e3)
                stats = generation.stats  # the last run's
                out[label] = {
                    "ms_per_token": statistics.median(times) / new,
                    "tokens": new,
                    "rounds": stats.rounds,
                    "draft_tokens": stats.draft_tokens,
                    "accepted_tokens": stats.accepted_tokens,
                }
                _say(f"stack {label}: {out[label]['ms_per_token']:.2f} ms/token")
    finally:
        for p in procs:
            p.stop()
    return out


def run(args) -> Report:
    import torch
    import transformers

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    report = Report(
        device=str(device),
        device_name=name,
        dtype=args.dtype,
        shapes=args.shapes,
        torch=torch.__version__,
        transformers=transformers.__version__,
        context=args.context,
        copy_gb_s=copy_bandwidth(device, args.copy_mb) / 1e9,
        target_read_gb=0.0,
        drafter_read_gb=0.0,
    )
    _say(f"{name}: copy {report.copy_gb_s:.1f} GB/s")
    time_forwards(report, args, device, dtype)
    if args.stack:
        with tempfile.TemporaryDirectory(prefix="specdec-gpucheck-") as tmp:
            target = build_stack_model(Path(tmp), args)
            prompt = [(7 * i + 11) % 300 + 3 for i in range(args.prompt_tokens)]
            stack = stack_ms_per_token(target, prompt, args.new_tokens, args)
            stack["in_process_ms_per_token"] = in_process_ms_per_token(
                target, prompt, args.new_tokens, device, getattr(torch, args.stack_dtype)
            )
            report.stack = stack
    return report


def table(report: Report) -> str:
    """The report as Markdown."""
    lines = [
        f"# gpu-check: {report.device_name} ({report.device})",
        "",
        f"torch {report.torch}, transformers {report.transformers}, weights {report.dtype}, "
        f"shapes {report.shapes}, context {report.context} tokens. Copy bandwidth "
        f"{report.copy_gb_s:.1f} GB/s (reads and writes counted); a target forward reads "
        f"{report.target_read_gb:.2f} GB, a drafter forward {report.drafter_read_gb:.2f} GB.",
        "",
        "| model | tokens | batch | eager ms | compiled ms | bound ms | compiled / bound "
        "| max logit diff |",
        "| --- | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for f in report.forwards:
        compiled = f"{f.compiled_ms:.3f}" if f.compiled_ms is not None else "-"
        over = f"{f.compiled_ms / f.bound_ms:.1f}x" if f.compiled_ms is not None else "-"
        diff = f"{f.max_logit_diff:.2g}" if f.max_logit_diff is not None else "-"
        lines.append(
            f"| {f.model} | {f.tokens} | {f.batch} | {f.eager_ms:.3f} | {compiled} | "
            f"{f.bound_ms:.3f} | {over} | {diff} |"
        )
    lines.append("")
    if report.compile_seconds is not None:
        lines.append(f"Compiling every shape took {report.compile_seconds:.1f} s.")
    for timed_compiled in (False, True):
        c = report.c(timed_compiled)
        if c is not None:
            lines.append(
                f"- c (drafter step / target step), {'compiled' if timed_compiled else 'eager'}: "
                f"{c:.3f}"
            )
    s = report.stack
    if s:
        k0, self4 = s["k0"], s["self_k4"]
        accepted = self4["accepted_tokens"] / max(1, self4["draft_tokens"])
        lines += [
            f"- stack at k = 0: {k0['ms_per_token']:.2f} ms/token; the model alone in-process "
            f"(`generate`): {s['in_process_ms_per_token']:.2f} ms/token; stack / alone "
            f"{k0['ms_per_token'] / s['in_process_ms_per_token']:.2f}x",
            f"- self-drafting at k = 4: {self4['ms_per_token']:.2f} ms/token, "
            f"{k0['ms_per_token'] / self4['ms_per_token']:.2f}x the stack at k = 0 "
            f"(ideal {IDEAL_SELF_DRAFT:.0f}x); {accepted:.1%} of draft tokens accepted, "
            f"{self4['tokens'] / max(1, self4['rounds']):.2f} tokens a round",
        ]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    from specdec.replica.cpus import cpu_info

    return cpu_info().describe()


def _say(line: str) -> None:
    print(f"gpu-check: {line}", file=sys.stderr, flush=True)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m specdec.tools.gpucheck", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", default="cuda", help="torch device (cuda, cuda:N or cpu)")
    p.add_argument("--dtype", default="bfloat16", help="weights of the timed forwards")
    p.add_argument("--stack-dtype", default="bfloat16", help="weights of the stack's replicas")
    p.add_argument("--shapes", default="qwen2.5-coder", choices=[*SHAPES, "tiny"])
    p.add_argument("--tokens", type=_int_list, default=[1, 4, 16], help="new tokens a forward")
    p.add_argument("--batches", type=_int_list, default=[1, 8], help="rows a forward")
    p.add_argument("--context", type=int, default=512, help="tokens cached before each forward")
    p.add_argument("--iters", type=int, default=0, help="timed forwards a shape (0: by device)")
    p.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth copy")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend (inductor; eager: capture without code generation; none)",
    )
    p.add_argument("--prompt-tokens", type=int, default=64, help="the stack's prompt length")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens the stack generates")
    p.add_argument(
        "--stack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the stack (k = 0 and self-drafting); --no-stack: forwards only",
    )
    p.add_argument("--out", type=Path, help="write results.md and results.json to this folder")
    p.add_argument(
        "--download-wheels",
        type=Path,
        metavar="DIR",
        help="only fetch the wheels the GPU machine lacks into DIR (needs PyPI)",
    )
    return p


def carried_requirements() -> list[str]:
    """`name==version` of every installed distribution the services need that the GPU
    image lacks (or has too old), from the installed metadata of ROOTS."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, str] = {}
    todo = [Requirement(r) for r in ROOTS]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here: not needed
        extras = set(req.extras)
        if name in seen and not extras:
            continue
        seen[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(
                sub.marker.evaluate({"extra": e}) for e in (extras or {""})
            ):
                todo.append(sub)
    keep = []
    for carried, version in sorted(seen.items()):
        if carried.startswith("specdec") or carried.startswith(NEVER_CARRY):
            continue
        if carried in GPU_IMAGE and carried not in ALWAYS_CARRY:
            continue
        keep.append(f"{carried}=={version}")
    return keep


def download_wheels(dest: Path) -> None:
    """Fetch carried_requirements() as wheels for the GPU machine (CPython 3.12, x86-64
    Linux) into dest: run where PyPI is reachable, then carry dest."""
    import subprocess

    # pip matches a manylinux tag exactly: name every glibc a wheel may be built for.
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in platforms:
        cmd += ["--platform", p]
    from importlib import metadata

    build = [f"{name}=={metadata.version(name)}" for name in BUILD_CARRY]
    subprocess.run([*cmd, *carried_requirements(), *build], check=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.download_wheels:
        download_wheels(args.download_wheels)
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report = run(args)
    text = table(report)
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
