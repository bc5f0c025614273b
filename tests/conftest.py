"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import os
import subprocess
import sys

# One torch thread in this process and in every service a test starts (their --threads
# default reads SPECDEC_THREADS): the tiny models gain nothing from a second thread, and
# with a pytest worker per CPU (make test) every extra thread only competes for the CPUs.
# Set before torch is first imported, which reads OMP_NUM_THREADS once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SPECDEC_THREADS", "1")
# Replicas the tests start fork from one server per process that has torch and transformers
# imported already (specdec.tools.forkserver): 0.4 s of CPU a start instead of 6. The
# start-up tests that exec `specdec` themselves (test_up, the quick start) clear it.
os.environ.setdefault("SPECDEC_FORK_SERVER", "1")
# The gateway's OpenAI-compatible HTTP API serves on port 8000 by default (`serve gateway`,
# `specdec up`): tests run many gateways at once, so in tests it is off unless a test gives
# a port (a free one). The test of the default itself clears it (test_openai_door).
os.environ["SPECDEC_HTTP_PORT"] = "0"

import pytest

from specdec.tools.tinymodels import TestModels, build_test_models


@pytest.fixture(scope="session")
def test_models(tmp_path_factory) -> TestModels:
    """Tiny fp32 target / drafts and their shared tokenizer, built once per test session."""
    return build_test_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def target_model(test_models):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(test_models.target, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(test_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(test_models.tokenizer)


PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n",
    "Once upon a time, in a land far away,",
    "for i in range(10):\n    print(",
    "SELECT name FROM users WHERE",
]


@pytest.fixture(scope="session")
def reference(target_model, tokenizer):
    """reference(prompt_ids, n) -> target.generate(do_sample=False) continuation ids."""
    import torch

    cache: dict[tuple, list[int]] = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = target_model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                )
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    return generate


def start_up_error(role: str, model, *flags: str) -> str:
    """`specdec serve <role>` on a loopback port with these flags, expected to refuse its
    configuration: asserts it exits 2 and returns its stderr."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "specdec", "serve", role),
            *("--model", str(model), "--port", "0", "--host", "127.0.0.1"),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr
