"""The in-process anchors: the target (and draft) with transformers `generate`, assisted
generation, and the near-tie check of a difference from the baseline."""

from __future__ import annotations

import contextlib
import os
import time

from specdec.tools.bench.modes import (
    HF_PROMPT_LOOKUP_TOKENS,
    PROMPT_LOOKUP,
    PROMPT_LOOKUP_2CPU,
    STEP_TARGET,
    Mode,
    Prompt,
    Sample,
    encode_prompt,
)
from specdec.tools.bench.stats import first_difference


def pin_process(cpus: set[int] | None) -> None:
    """Move every thread of this process (torch's pool included) onto `cpus`."""
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), cpus)


class HFRunner:
    """The target (and the draft) loaded in this process with transformers."""

    def __init__(
        self,
        target: str,
        draft: str,
        dtype: str,
        pinned: tuple[int, int] | None,
        step_layout: str | None = None,
    ):
        """step_layout: also the target in that layout ("bfloat16+packed": its dtype, its
        linear layers packed), for the `target, fastest step` mode. Only the tokenizer is
        loaded here: the models load on first use (`load`), and `unload` frees them (the
        bench's in-process rows after the stack's, when both do not fit in memory)."""
        import torch
        from transformers import AutoTokenizer

        self.torch = torch
        self.paths, self.dtype, self.step_layout = (target, draft), dtype, step_layout
        self._models: tuple | None = None
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        self.pinned = pinned  # (drafter cpu, verifier cpu)
        self.default_threads = torch.get_num_threads()
        self.eos = None

    def load(self) -> None:
        if self._models is not None:
            return
        from transformers import AutoModelForCausalLM

        from specdec.replica import packing

        torch = self.torch
        dt_ = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        target, draft = self.paths
        step = None
        if self.step_layout:
            step_dtype, _, packed = self.step_layout.partition("+")
            step = AutoModelForCausalLM.from_pretrained(target, dtype=dt_[step_dtype]).eval()
            if packed:
                packing.pack_linears(step)
        self._models = (
            AutoModelForCausalLM.from_pretrained(target, dtype=dt_[self.dtype]).eval(),
            AutoModelForCausalLM.from_pretrained(draft, dtype=dt_[self.dtype]).eval(),
            step,
        )
        eos = self.target.generation_config.eos_token_id
        self.eos = eos if eos is not None else self.tokenizer.eos_token_id

    def unload(self) -> None:
        import gc

        self._models = None
        gc.collect()

    @property
    def target(self):
        self.load()
        return self._models[0]

    @property
    def draft(self):
        self.load()
        return self._models[1]

    @property
    def step_target(self):
        self.load()
        return self._models[2]

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def _placement(self, mode: Mode) -> tuple[set[int] | None, int]:
        if self.pinned is None:
            return None, self.default_threads
        draft_cpu, target_cpu = self.pinned
        # The target alone is its own baseline, whichever variant's ("target", "target
        # [int8]"): the verifier's one CPU, not assisted generation's two. Prompt lookup
        # runs the target alone too: the verifier's CPU, as a lookup method in the stack.
        if mode.baseline == mode.name or mode.name == PROMPT_LOOKUP:
            return {target_cpu}, 1
        if mode.name == "draft":
            return {draft_cpu}, 1
        return {draft_cpu, target_cpu}, 2

    def run(self, mode: Mode, ids: list[int], n: int) -> Sample:
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):
            def __init__(self):
                self.puts, self.at = 0, None

            def put(self, value):
                self.puts += 1
                if self.puts == 2:  # the first put is the prompt
                    self.at = time.perf_counter()

            def end(self):
                pass

        torch = self.torch
        cpus, threads = self._placement(mode)
        torch.set_num_threads(threads)
        pin_process(cpus)
        model = self.draft if mode.name == "draft" else self.target
        if mode.name.startswith(STEP_TARGET):
            model = self.step_target
        config = GenerationConfig(
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
        )
        extra: dict = {}
        if mode.name == "assisted":
            extra = {"assistant_model": self.draft}
        elif mode.name in (PROMPT_LOOKUP, PROMPT_LOOKUP_2CPU):
            extra = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS}
        streamer = FirstToken()
        input_ids = torch.tensor([ids])
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                streamer=streamer,
                **extra,
            )
        seconds = time.perf_counter() - started
        ttft = ((streamer.at or started + seconds) - started) * 1e3
        return Sample(out[0, len(ids) :].tolist(), seconds, ttft)


# Two bfloat16 computations of the same logits (a one-token decode step and a batched
# verification) differ by a few units in the last place after 28 layers; tokens whose logits
# are this close can come out in either order.
NEAR_TIE_ULPS = 4


def last_place(value) -> float:
    """One unit in the last place of `value` (a 0-d tensor) in its own dtype."""
    import torch

    return float(torch.nextafter(value, value + 1) - value)


def tie_break(hf: HFRunner, ids: list[int], base: list[int], other: list[int]) -> dict:
    """Where `other` first leaves the baseline `base`: how far apart the two tokens' logits
    are there (one forward of the target), in units of the last place of the top logit."""
    torch = hf.torch
    i = first_difference(other, base)
    if i is None or i >= min(len(base), len(other)):
        return {"position": i, "gap_ulps": None}  # one is a prefix of the other
    with torch.inference_mode():
        logits = hf.target(input_ids=torch.tensor([[*ids, *base[:i]]])).logits[0, -1]
    ulp = last_place(logits.max())
    gap = float(abs(logits[base[i]].float() - logits[other[i]].float()))
    return {"position": i, "gap": gap, "ulp": ulp, "gap_ulps": gap / ulp if ulp else None}


def near_ties_only(row: dict) -> bool:
    """Every difference from the baseline starts where the two tokens' logits are within
    NEAR_TIE_ULPS of each other (a numerical near-tie, not a wrong acceptance)."""
    checks = row.get("tie_breaks") or []
    return bool(checks) and all(
        c["gap_ulps"] is not None and c["gap_ulps"] <= NEAR_TIE_ULPS for c in checks
    )
