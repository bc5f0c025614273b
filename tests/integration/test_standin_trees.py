"""`python -m specdec.tools.bench.standin_trees` small on CPU: every mode (chains and trees,
both policies, with SSD) runs through the stack, every output equals the target alone's, the
tree modes verified trees whose continued leaves put more nodes in a round than the drafter
could as terminal leaves, and the report and its ratios are written."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_standin_trees_small(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "specdec.tools.bench.standin_trees", "--target-ms", "1"]
    cmd += ["--draft-ms", "0.2", "--prompts", "2", "--max-new-tokens", "16", "--repeats", "1"]
    cmd += ["--ssd", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    modes = result["modes"]
    names = {"fixed", "fixed tree3", "adaptive", "adaptive tree3"}
    assert set(modes) == names | {f"ssd {n}" for n in names}
    assert result["exact"] and all(r["exact"] and r["requests"] == 2 for r in modes.values())
    for name, row in modes.items():
        assert (row["tree_rounds"] > 0) == ("tree" in name), name
    # k = 4, width 3, fixed: 2 leaves continued by 2 tokens (terminal: at most 2 leaves)
    fixed = modes["fixed tree3"]
    assert fixed["tree_nodes"] > 6 * fixed["tree_rounds"]
    assert set(result["tree_vs_chain"]) == {n for n in modes if "tree" in n}
    assert "| fixed tree3 |" in (out / "report.md").read_text()
