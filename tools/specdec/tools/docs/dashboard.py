"""The chart's Grafana dashboard drawn as one HTML page from a real Prometheus.

No Grafana binary installs here, so this does the part of Grafana a screenshot shows: it
reads `helm/specdec/dashboards/specdec.json`, runs every panel's PromQL over Prometheus's
HTTP API (`query_range`, `$__rate_interval` expanded the way Grafana does), and lays the
panels out on Grafana's 24-column grid, each a small inline SVG time series in Grafana's
dark theme with its title, axes, unit and legend. Each panel also reports what it drew
(series, points, non-zero points, and where its plot area lies on the page), so a test can
check the picture against the data.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[4] / "helm" / "specdec" / "dashboards" / "specdec.json"

WIDTH = 1440  # page width in CSS pixels
CELL_H, MARGIN = 30, 8  # Grafana's grid: 30 px rows, 8 px gutters, 24 columns
TITLE_H, AXIS_W, AXIS_H, LEGEND_ROW = 30, 58, 22, 18
# Grafana's classic palette, in its order.
PALETTE = ("#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42",
           "#1F78C1", "#BA43A6", "#705DA0", "#508642", "#CCA300")  # fmt: skip
BG, PANEL_BG, BORDER, TEXT, MUTED, GRID = (
    "#111217", "#181b1f", "#2c3033", "#ccccdc", "#8e8e9e", "#26292e"
)  # fmt: skip

#: query_range(promql, start, end, step) -> Prometheus's matrix result
QueryRange = Callable[[str, float, float, float], list[dict]]


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # (unix seconds, value), finite values only


@dataclass
class Panel:
    title: str
    kind: str  # "row" or "timeseries"
    grid: dict[str, int]  # Grafana's gridPos: x, y, w, h in grid units
    unit: str = "short"
    axis: tuple[float | None, float | None] = (None, None)  # fieldConfig's min and max
    queries: list[str] = field(default_factory=list)  # the PromQL sent, expanded
    series: list[Series] = field(default_factory=list)
    plot: tuple[int, int, int, int] = (0, 0, 0, 0)  # the plot area on the page: x, y, w, h

    def report(self) -> dict:
        points = [v for s in self.series for _, v in s.points]
        return {
            "title": self.title,
            "queries": self.queries,
            "series": len(self.series),
            "points": len(points),
            "nonzero_points": sum(v != 0 for v in points),
            "plot": list(self.plot),
        }


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def rate_interval(step: float, scrape_s: float) -> int:
    """Grafana's `$__rate_interval`: max($__interval + scrape interval, 4 x scrape interval)."""
    return math.ceil(max(step + scrape_s, 4 * scrape_s))


def legend_name(fmt: str, metric: dict[str, str]) -> str:
    """A series' legend: Grafana's `{{label}}` template, else the metric and its labels."""
    if fmt:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m[1], ""), fmt).strip()
    name = metric.get("__name__", "")
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{name}{{{labels}}}" if labels else (name or "value")


def query_panels(
    dashboard: dict, query_range: QueryRange, start: float, end: float, step: float,
    scrape_s: float,
) -> list[Panel]:  # fmt: skip
    """Every panel of the dashboard with the series its queries return over [start, end]."""
    interval = f"{rate_interval(step, scrape_s)}s"
    panels = []
    for p in dashboard["panels"]:
        panel = Panel(
            title=p["title"],
            kind="row" if p["type"] == "row" else "timeseries",
            grid=dict(p["gridPos"]),
            unit=p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short"),
            axis=tuple(p.get("fieldConfig", {}).get("defaults", {}).get(k) for k in ("min", "max")),
        )
        for target in p.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", interval)
            panel.queries.append(expr)
            found = []
            for result in query_range(expr, start, end, step):
                points = [(float(t), float(v)) for t, v in result["values"]]
                points = [(t, v) for t, v in points if math.isfinite(v)]
                name = legend_name(target.get("legendFormat", ""), result["metric"])
                found.append(Series(name, points))
            panel.series += sorted(found, key=lambda s: _natural(s.name))
        panels.append(panel)
    return panels


def _decimals(step: float) -> int:
    """The fewest decimals that write every multiple of `step` exactly (at most 3)."""
    return next((d for d in range(3) if abs(round(step, d) - step) < 1e-9 * max(1, step)), 3)


def fmt_value(v: float, unit: str, step: float) -> str:
    """An axis label in the panel's unit (the units this dashboard uses); `step`: the
    spacing of the ticks, which decides the decimals."""
    if unit == "percentunit":
        return f"{v * 100:.{_decimals(step * 100)}f}%"
    if unit == "s":
        if v == 0:
            return "0"
        if abs(v) < 1:
            return f"{v * 1000:.{_decimals(step * 1000)}f} ms"
        return f"{v:.{_decimals(step)}f} s"
    suffix = {"reqps": " req/s", "ops": " ops/s"}.get(unit, "")
    if abs(v) >= 1000:
        return f"{v / 1000:.{_decimals(step / 1000)}f}K{suffix}"
    return f"{v:.{_decimals(step)}f}{suffix}"


def nice_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """Round tick values covering [lo, hi], about `count` of them."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def time_ticks(start: float, end: float, width: int) -> list[float]:
    span = end - start
    steps = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
    step = next((s for s in steps if span / s <= max(2, width // 90)), steps[-1])
    first = math.ceil(start / step) * step
    return [first + i * step for i in range(int((end - first) // step) + 1)]


def _legend_rows(names: list[str], width: int, max_rows: int) -> tuple[list[list], int]:
    """Legend items wrapped into rows like Grafana's list legend, [(x, series index), ...]
    per row, at most `max_rows` (Grafana scrolls a long legend); and how many did not fit."""
    rows: list[list[tuple[int, int]]] = [[]]
    x = 8
    for i, name in enumerate(names):
        w = 24 + 7 * len(name) + 16  # swatch, text at ~7 px a character, gap
        if rows[-1] and x + w > width - 70:  # room for "+N more"
            if len(rows) == max_rows:
                return rows, len(names) - i
            rows.append([])
            x = 8
        rows[-1].append((x, i))
        x += w
    return rows, 0


def _natural(name: str) -> list:
    """Sort key: "position 2" before "position 10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _panel_svg(
    panel: Panel, width: int, height: int, start: float, end: float
) -> tuple[str, tuple[int, int, int, int]]:
    """One panel's SVG and its plot area (x, y, w, h) inside the panel."""
    esc = html.escape
    names = [s.name for s in panel.series]
    legend, hidden = _legend_rows(names, width, max(1, int(height * 0.3) // LEGEND_ROW))
    plot_x, plot_y = AXIS_W, TITLE_H
    plot_w = width - AXIS_W - 14
    plot_h = height - TITLE_H - AXIS_H - LEGEND_ROW * len(legend) - 6
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
        f'<text x="10" y="20" class="title">{esc(panel.title)}</text>',
    ]
    values = [v for s in panel.series for _, v in s.points]
    if not values:
        out.append(
            f'<text x="{width / 2}" y="{height / 2}" class="nodata" text-anchor="middle">'
            "No data</text></svg>"
        )
        return "".join(out), (plot_x, plot_y, plot_w, plot_h)
    lo, hi = min(0.0, min(values)), max(values)
    if panel.unit == "percentunit" and hi <= 1:
        hi = max(hi, 0.01)
    # The panel's own min / max fix the axis, and values beyond it are clipped, as in Grafana.
    lo = lo if panel.axis[0] is None else panel.axis[0]
    hi = hi if panel.axis[1] is None else panel.axis[1]
    ticks = nice_ticks(lo, hi if hi > lo else lo + 1)
    lo, hi = ticks[0], ticks[-1]

    def sx(t: float) -> float:
        return plot_x + (t - start) / (end - start) * plot_w

    def sy(v: float) -> float:
        return plot_y + plot_h - (min(max(v, lo), hi) - lo) / (hi - lo) * plot_h

    for v in ticks:
        y = sy(v)
        out.append(f'<line x1="{plot_x}" x2="{plot_x + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'class="grid"/>')  # fmt: skip
        out.append(f'<text x="{plot_x - 6}" y="{y + 4:.1f}" class="axis" text-anchor="end">'
                   f"{esc(fmt_value(v, panel.unit, ticks[1] - ticks[0]))}</text>")  # fmt: skip
    for t in time_ticks(start, end, plot_w):
        x = sx(t)
        label = time.strftime("%H:%M:%S", time.gmtime(t))
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{plot_y}" y2="{plot_y + plot_h}" '
                   f'class="grid"/>')  # fmt: skip
        out.append(f'<text x="{x:.1f}" y="{plot_y + plot_h + 16}" class="axis" '
                   f'text-anchor="middle">{label}</text>')  # fmt: skip
    step = _step(panel)
    for i, s in enumerate(panel.series):
        color = PALETTE[i % len(PALETTE)]
        for run in _runs(s.points, step):
            if len(run) == 1:
                t, v = run[0]
                out.append(f'<circle cx="{sx(t):.1f}" cy="{sy(v):.1f}" r="2" fill="{color}"/>')
                continue
            line = " ".join(f"{sx(t):.1f},{sy(v):.1f}" for t, v in run)
            base = f"{sx(run[-1][0]):.1f},{sy(lo):.1f} {sx(run[0][0]):.1f},{sy(lo):.1f}"
            out.append(f'<polygon points="{line} {base}" fill="{color}" fill-opacity="0.1"/>')
            out.append(f'<polyline points="{line}" fill="none" stroke="{color}" '
                       'stroke-width="1.5" stroke-linejoin="round"/>')  # fmt: skip
    legend_y = plot_y + plot_h + AXIS_H + 8
    for r, row in enumerate(legend):
        y = legend_y + r * LEGEND_ROW
        for x, i in row:
            color = PALETTE[i % len(PALETTE)]
            out.append(f'<rect x="{x}" y="{y + 5}" width="14" height="4" rx="1" fill="{color}"/>')
            out.append(f'<text x="{x + 20}" y="{y + 11}" class="legend">{esc(names[i])}</text>')
    if hidden:
        y = legend_y + (len(legend) - 1) * LEGEND_ROW
        out.append(f'<text x="{width - 10}" y="{y + 11}" class="axis" text-anchor="end">'
                   f"+{hidden} more</text>")  # fmt: skip
    out.append("</svg>")
    return "".join(out), (plot_x, plot_y, plot_w, plot_h)


def _step(panel: Panel) -> float:
    """The spacing of the panel's samples (its query step)."""
    for s in panel.series:
        if len(s.points) > 1:
            return min(b[0] - a[0] for a, b in itertools.pairwise(s.points))
    return 1.0


def _runs(points: list[tuple[float, float]], step: float) -> list[list[tuple[float, float]]]:
    """Consecutive samples; a missing sample (no data, or NaN from 0/0) breaks the line."""
    runs: list[list[tuple[float, float]]] = []
    for p in points:
        if runs and p[0] - runs[-1][-1][0] <= step * 1.5:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def render(dashboard: dict, panels: list[Panel], start: float, end: float, note: str) -> str:
    """The page: every panel at its grid position; sets each panel's `plot` (page pixels)."""
    col = (WIDTH - MARGIN) / 24
    body = []
    bottom = 0
    for panel in panels:
        g = panel.grid
        x = round(MARGIN + g["x"] * col)
        w = round(g["w"] * col - MARGIN)
        y = 56 + g["y"] * (CELL_H + MARGIN)
        h = g["h"] * (CELL_H + MARGIN) - MARGIN
        bottom = max(bottom, y + h)
        if panel.kind == "row":
            body.append(f'<div class="row" style="left:{x}px;top:{y}px;width:{w}px">'
                         f"&#9662; {html.escape(panel.title)}</div>")  # fmt: skip
            continue
        svg, (px, py, pw, ph) = _panel_svg(panel, w, h, start, end)
        panel.plot = (x + px, y + py, pw, ph)
        r = panel.report()
        body.append(
            f'<div class="panel" style="left:{x}px;top:{y}px;width:{w}px;height:{h}px" '
            f'data-series="{r["series"]}" data-points="{r["points"]}">{svg}</div>'
        )
    span = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start))
        + " to "
        + time.strftime("%H:%M:%S UTC", time.gmtime(end))
    )
    report = json.dumps([p.report() for p in panels if p.kind != "row"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(dashboard["title"])}</title>
<style>
body {{ margin: 0; background: {BG}; color: {TEXT}; width: {WIDTH}px; height: {bottom + MARGIN}px;
  font-family: Inter, "Helvetica Neue", Arial, "DejaVu Sans", sans-serif; position: relative; }}
.top {{ position: absolute; left: {MARGIN}px; top: 12px; right: {MARGIN}px; font-size: 18px; }}
.top .note {{ float: right; font-size: 13px; color: {MUTED}; padding-top: 4px; }}
.panel {{ position: absolute; background: {PANEL_BG}; border: 1px solid {BORDER};
  border-radius: 2px; box-sizing: border-box; overflow: hidden; }}
.panel svg {{ position: absolute; left: -1px; top: -1px; }}
.row {{ position: absolute; font-size: 15px; font-weight: 500; height: 30px; line-height: 30px; }}
.title {{ fill: {TEXT}; font-size: 14px; font-weight: 500; }}
.axis {{ fill: {MUTED}; font-size: 11px; }}
.legend {{ fill: {TEXT}; font-size: 12px; }}
.nodata {{ fill: {MUTED}; font-size: 14px; }}
.grid {{ stroke: {GRID}; stroke-width: 1; }}
</style></head><body>
<div class="top">Dashboards / {html.escape(dashboard["title"])}
<span class="note">{html.escape(note)} &middot; {span}</span></div>
{"".join(body)}
<script type="application/json" id="specdec-report">{html.escape(report)}</script>
</body></html>
"""


def page_height(panels: list[Panel]) -> int:
    return max(56 + (p.grid["y"] + p.grid["h"]) * (CELL_H + MARGIN) for p in panels)


def report(panels: list[Panel]) -> list[dict]:
    return [p.report() for p in panels if p.kind != "row"]
