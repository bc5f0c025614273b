"""The dashboard page of the docs' screenshots (specdec.tools.docs.dashboard), without a
browser or a Prometheus: queries as Grafana would send them, series as it would draw them."""

from __future__ import annotations

import itertools
import math

from specdec.tools.docs import dashboard
from specdec.tools.docs.dashboard import Panel, Series

START = 1_700_000_000.0


def test_rate_interval_is_grafanas():
    assert dashboard.rate_interval(step=1, scrape_s=1) == 4  # 4 x scrape
    assert dashboard.rate_interval(step=10, scrape_s=1) == 11  # step + scrape


def test_legend_templates():
    metric = {"__name__": "x_total", "method": "ngram", "instance": "a:1"}
    assert dashboard.legend_name("{{method}} drafts", metric) == "ngram drafts"
    assert dashboard.legend_name("{{ missing }}x", metric) == "x"
    assert dashboard.legend_name("", metric) == 'x_total{instance="a:1", method="ngram"}'


def test_every_query_runs_expanded_and_nan_is_no_point():
    board = dashboard.load()
    sent = []

    def query_range(expr, start, end, step):
        sent.append((expr, start, end, step))
        values = [[START + i, "NaN" if i == 1 else str(i)] for i in range(3)]
        return [{"metric": {"position": "0", "kind": "decode"}, "values": values}]

    panels = dashboard.query_panels(board, query_range, START, START + 2, 1, 1)
    targets = [t for p in board["panels"] for t in p.get("targets", [])]
    assert len(sent) == len(targets) >= 20
    assert all("$__" not in expr and (start, end, step) == (START, START + 2, 1)
               for expr, start, end, step in sent)  # fmt: skip
    assert any("[4s]" in expr for expr, *_ in sent)
    drawn = [p for p in panels if p.kind == "timeseries"]
    assert all(len(s.points) == 2 for p in drawn for s in p.series)  # NaN dropped
    assert [p.title for p in panels if p.kind == "row"] == [
        p["title"] for p in board["panels"] if p["type"] == "row"
    ]


def test_a_missing_sample_breaks_the_line():
    points = [(START, 1.0), (START + 1, 2.0), (START + 4, 3.0)]
    assert dashboard._runs(points, 1.0) == [points[:2], points[2:]]


def test_render_reports_what_each_panel_drew():
    full = Panel("full", "timeseries", {"x": 0, "y": 1, "w": 12, "h": 8}, "percentunit",
                 series=[Series("a", [(START + i, i / 10) for i in range(10)]),
                         Series("b", [])])  # fmt: skip
    empty = Panel("empty", "timeseries", {"x": 12, "y": 1, "w": 12, "h": 8}, "s")
    row = Panel("Row", "row", {"x": 0, "y": 0, "w": 24, "h": 1})
    page = dashboard.render({"title": "T"}, [row, full, empty], START, START + 9, "note")
    assert page.count('class="panel"') == 2 and "No data" in page
    assert 'data-series="2" data-points="10"' in page
    reports = {r["title"]: r for r in dashboard.report([row, full, empty])}
    assert reports["full"]["nonzero_points"] == 9 and reports["empty"]["points"] == 0
    x, y, w, h = full.plot  # inside its panel, left of the empty one
    assert x > 0 and x + w < empty.plot[0] and 0 < h < 8 * 38 and y > 38
    assert dashboard.page_height([row, full, empty]) >= y + h


def test_axis_labels():
    assert dashboard.fmt_value(0.5, "percentunit", 0.25) == "50%"
    assert dashboard.fmt_value(0.025, "s", 0.005) == "25 ms"
    assert dashboard.fmt_value(0.0125, "s", 0.0025) == "12.5 ms"
    assert dashboard.fmt_value(5, "reqps", 2.5) == "5.0 req/s"
    assert dashboard.fmt_value(2000, "short", 1000) == "2K"
    ticks = dashboard.nice_ticks(0, 0.93)
    assert ticks[0] == 0 and ticks[-1] >= 0.93 and 3 <= len(ticks) <= 7
    assert all(math.isclose(b - a, ticks[1] - ticks[0]) for a, b in itertools.pairwise(ticks))


def test_legend_in_natural_order_and_capped():
    def query_range(expr, start, end, step):
        return [{"metric": {"position": str(p)}, "values": [[START, "1"]]} for p in (10, 2, 0)]

    board = {"panels": [{"type": "timeseries", "title": "t", "gridPos": {"x": 0, "y": 0, "w": 4,
             "h": 4}, "targets": [{"expr": "x", "legendFormat": "position {{position}}"}]}]}  # fmt: skip
    (panel,) = dashboard.query_panels(board, query_range, START, START, 1, 1)
    assert [s.name for s in panel.series] == ["position 0", "position 2", "position 10"]
    rows, hidden = dashboard._legend_rows([f"series {i}" for i in range(40)], 400, max_rows=2)
    assert len(rows) == 2 and hidden == 40 - sum(len(r) for r in rows) > 0


def test_the_panels_min_and_max_fix_the_axis():
    clipped = Panel("ratio", "timeseries", {"x": 0, "y": 0, "w": 12, "h": 8}, "percentunit",
                    axis=(0, 1), series=[Series("a", [(START, 0.2), (START + 1, 1.5)])])  # fmt: skip
    page = dashboard.render({"title": "T"}, [clipped], START, START + 1, "note")
    assert ">100%<" in page and ">150%<" not in page
    assert dashboard.load()["panels"][1]["fieldConfig"]["defaults"]["max"] == 1
