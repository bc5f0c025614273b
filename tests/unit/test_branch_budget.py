"""SSD's batched branch cache is bounded (--ssd-max-branch-tokens): fan-out shrinks to fit,
down to no branch, and Speculate still succeeds (issue 11, item 3)."""

from __future__ import annotations

import pytest

from specdec.common.params import SamplingParams
from specdec.drafter.config import DrafterConfig
from specdec.drafter.speculate import BranchStore, SpeculateCall, branch_budget, speculate
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime


@pytest.fixture(scope="module")
def drafter(test_models):
    rt = ModelRuntime(DrafterConfig(role="drafter", model=str(test_models.target)))
    rt.load()
    yield rt
    rt.shutdown()


def test_branch_budget():
    assert branch_budget(0, 10_000, 4) >= 64  # 0: unbounded
    assert branch_budget(65_536, 8_188, 4) == 8
    assert branch_budget(65_536, 32_764, 4) == 2
    assert branch_budget(1_000, 1_000, 4) == 0


@pytest.mark.parametrize("budget, most", [(0, 6), (2 * (40 + 3), 2), (40, 0)])
def test_speculate_fans_out_within_the_budget(drafter, budget, most):
    tokens = list(range(10, 50))  # 37 context tokens + a draft of 3: 40 in the session
    result = drafter.drive(
        speculate(
            SpeculateCall(
                drafter,
                BranchStore(),
                f"s/{budget}",
                Prefix(0, 0),
                tokens,
                3,
                3,
                SamplingParams(),
                6,
                0.7,
                3,
                budget,
            )
        )
    )
    assert result.cached_length == 40
    if most:
        assert 0 < len(result.branches) <= most
    else:
        assert result.branches == []
