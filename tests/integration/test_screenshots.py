"""The docs' screenshots (`make docs-screenshots`) from a real local run: the dashboard
image shows Prometheus's data in every panel, and the trace image one request across the
gateway, drafter and verifier.

Needs Debian's `chromium` (installed by `make system-deps`); skips without it. Also runs
the real `prometheus` binary, which the metrics test needs as well.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from PIL import Image

from specdec.tools.docs import dashboard, screenshots, traceview
from specdec.tools.docs.dashboard import Panel, Series

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("chromium") is None,
        reason="chromium is not installed; `make system-deps` installs Debian's chromium",
    ),
]

# Panels whose metrics only move on failures, memory pressure or a queue caught at a
# scrape: drawn (their series exist) but may stay at zero in a short healthy run.
QUIET = {"Cache misses, evictions, failovers", "Queue depth per pool"}


def drawn_pixels(png, box: list[int] | tuple[int, ...]) -> int:
    """Coloured pixels (series lines and fills) in the box; text, grid and axes are grey."""
    x, y, w, h = box
    rgb = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)[y : y + h, x : x + w]
    return int(((rgb.max(axis=2) - rgb.min(axis=2)) > 60).sum())


def test_pixel_check_tells_a_drawn_panel_from_an_empty_one(tmp_path):
    """The check below can fail: a panel without series has no coloured pixels."""
    start = 1_700_000_000.0
    full = Panel("with data", "timeseries", {"x": 0, "y": 0, "w": 12, "h": 8}, "short",
                 series=[Series("a", [(start + i, float(i % 5)) for i in range(30)])])  # fmt: skip
    empty = Panel("no data", "timeseries", {"x": 12, "y": 0, "w": 12, "h": 8}, "short")
    page = tmp_path / "page.html"
    page.write_text(dashboard.render({"title": "t"}, [full, empty], start, start + 29, "test"))
    png = tmp_path / "page.png"
    screenshots.shoot(
        screenshots.chromium(), page, png, dashboard.WIDTH, dashboard.page_height([full, empty])
    )
    assert drawn_pixels(png, full.plot) > 200
    assert drawn_pixels(png, empty.plot) == 0


def test_screenshots_show_real_data(test_models, tmp_path):
    shots = screenshots.run(tmp_path / "images", seconds=12, work_dir=tmp_path, models=test_models)
    assert shots.requests >= 10

    # Every timeseries panel of the shipped dashboard, each with data from Prometheus.
    panels = {p["title"]: p for p in shots.panels}
    expected = {p["title"] for p in dashboard.load()["panels"] if p["type"] != "row"}
    assert set(panels) == expected
    empty = {t: (p["series"], p["points"]) for t, p in panels.items() if p["points"] < 3}
    assert not empty, f"panels without data (series, points): {empty}"
    flat = [t for t, p in panels.items() if t not in QUIET and p["nonzero_points"] == 0]
    assert not flat, f"panels whose every point is 0: {flat}"

    # The image: the page at its size, not blank, and in every panel's plot area the
    # coloured pixels of its series.
    image = Image.open(shots.dashboard)
    assert image.size[0] == dashboard.WIDTH and image.size[1] > 1500
    assert np.asarray(image.convert("L"), dtype=float).std() > 10
    undrawn = [t for t, p in panels.items() if drawn_pixels(shots.dashboard, p["plot"]) < 50]
    assert not undrawn, f"panels with data but nothing drawn: {undrawn}"

    # The trace: one request across the three services, drawn.
    trace = shots.trace_summary
    assert {"specdec-gateway", "specdec-drafter", "specdec-verifier"} <= set(trace["services"])
    assert trace["root"].startswith("specdec-gateway: ")
    assert trace["spans"] >= 10 and trace["depth"] >= 4
    image = Image.open(shots.trace)
    assert image.size[0] == traceview.WIDTH
    assert np.asarray(image.convert("L"), dtype=float).std() > 10
    rows = (traceview.LEFT, traceview.ROWS_TOP, traceview.WIDTH - traceview.LEFT,
            image.size[1] - traceview.ROWS_TOP)  # fmt: skip
    assert drawn_pixels(shots.trace, rows) > 20 * trace["spans"]  # a bar (2 px or more) a span
