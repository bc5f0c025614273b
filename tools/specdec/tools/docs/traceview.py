"""One trace as a Jaeger-style timeline page, from the spans an OTLP receiver collected.

The layout of Jaeger's trace view: a header (root operation, start, duration, services,
depth, span count), a minimap of every span, then one row per span, the service and
operation indented under their parent on the left and the span's bar on a shared time axis
on the right, coloured by service. One span's tags are shown expanded, as after a click.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass

from specdec.tools.otlpsink import ReceivedSpan

WIDTH = 1440
LEFT = 430  # the service & operation column
ROW_H = 24
NAV_H, HEAD_H, MINIMAP_H, THEAD_H, TAG_H = 46, 72, 80, 31, 19  # every height is fixed
ROWS_TOP = NAV_H + HEAD_H + MINIMAP_H + THEAD_H  # where the span rows start on the page
# Jaeger's service colours, in its order.
COLORS = ("#17B8BE", "#F8DCA1", "#B7885E", "#FFCB99", "#F89570",
          "#829AE3", "#E79FD5", "#1E96BE", "#89DAC1", "#B3AD9E")  # fmt: skip


@dataclass
class Row:
    span: ReceivedSpan
    depth: int


def rows(spans: list[ReceivedSpan]) -> list[Row]:
    """Depth-first, children by start time; a span whose parent is missing is a root."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    out: list[Row] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, -s.end_ns)):
            out.append(Row(s, depth))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


def summary(spans: list[ReceivedSpan]) -> dict:
    ordered = rows(spans)
    start = min(s.start_ns for s in spans)
    end = max(s.end_ns for s in spans)
    return {
        "trace_id": spans[0].trace_id,
        "root": f"{ordered[0].span.service}: {ordered[0].span.name}",
        "spans": len(spans),
        "services": sorted({s.service for s in spans}),
        "depth": max(r.depth for r in ordered) + 1,
        "duration_ms": (end - start) / 1e6,
        "errors": sum(s.status == 2 for s in spans),
    }


def _dark(hex_color: str) -> bool:
    """Whether white text reads on this colour (relative luminance below 0.5)."""
    r, g, b = (int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5


def _ms(ns: float) -> str:
    ms = ns / 1e6
    return f"{ms:.2f}ms" if ms < 10 else f"{ms:.1f}ms" if ms < 1000 else f"{ms / 1000:.2f}s"


def _tags(span: ReceivedSpan) -> str:
    esc = html.escape
    items = [("span.kind", span.kind.lower()), *sorted(span.attributes.items())]
    cells = "".join(
        f'<tr><td class="k">{esc(k)}</td><td class="v">{esc(str(v))}</td></tr>' for k, v in items
    )
    return f'<div class="detail"><div class="dh">Tags</div><table>{cells}</table></div>'


def render(spans: list[ReceivedSpan], expand: str = "") -> str:
    """The page; `expand` is the span_id whose tags are shown (none if empty)."""
    esc = html.escape
    info = summary(spans)
    ordered = rows(spans)
    start = min(s.start_ns for s in spans)
    total = max(max(s.end_ns for s in spans) - start, 1)
    services = sorted({s.service for s in spans}, key=lambda n: (n != "specdec-gateway", n))
    color = {name: COLORS[i % len(COLORS)] for i, name in enumerate(services)}
    timeline_w = WIDTH - LEFT

    def pct(ns: float) -> float:
        return 100 * ns / total

    ticks = "".join(
        f'<div class="tick" style="left:{25 * i}%"><span>{_ms(total * i / 4)}</span></div>'
        for i in range(5)
    )
    minimap = "".join(
        f'<div class="mm" style="left:{pct(r.span.start_ns - start):.3f}%;'
        f"width:{max(pct(r.span.end_ns - r.span.start_ns), 0.15):.3f}%;top:{2 + i * (MINIMAP_H - 22) / len(ordered):.2f}px;"
        f'background:{color[r.span.service]}"></div>'
        for i, r in enumerate(ordered)
    )
    body = []
    for r in ordered:
        s = r.span
        left, width = pct(s.start_ns - start), max(pct(s.end_ns - s.start_ns), 0.1)
        err = '<span class="err">!</span>' if s.status == 2 else ""
        duration = _ms(s.end_ns - s.start_ns)
        if width > 25:  # a long bar carries its duration inside, as Jaeger's does
            ink = "#fff" if _dark(color[s.service]) else "#333"
            place = f"left:{left:.3f}%;margin-left:6px;color:{ink}"
        elif left + width > 80:  # near the right edge: the label goes left of the bar
            place = f"right:{100 - left:.3f}%;margin-right:6px"
        else:
            place = f"left:{left + width:.3f}%;margin-left:6px"
        label = f'<span class="dur" style="{place}">{duration}</span>'
        body.append(
            f'<div class="span-row{" open" if s.span_id == expand else ""}">'
            f'<div class="name" style="padding-left:{12 + 16 * r.depth}px;'
            f'border-left:4px solid {color[s.service]}">{err}'
            f'<span class="svc">{esc(s.service)}</span> <span class="op">{esc(s.name)}</span></div>'
            f'<div class="bars"><div class="bar" style="left:{left:.3f}%;width:{width:.3f}%;'
            f'background:{color[s.service]}"></div>{label}</div></div>'
        )
        if s.span_id == expand:
            body.append(f'<div class="detail-row" style="height:{_detail_h(s)}px">{_tags(s)}</div>')
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start / 1e9))
    started += f".{int(start % 1_000_000_000) // 1_000_000:03d}"
    legend = "".join(
        f'<span class="lg"><i style="background:{color[n]}"></i>{esc(n)}</span>' for n in services
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{esc(info["root"])}</title>
<style>
body {{ margin: 0; width: {WIDTH}px; height: {page_height(spans, expand)}px; overflow: hidden;
  background: #fff; color: rgba(0,0,0,0.85);
  font-family: "Helvetica Neue", Helvetica, Arial, "DejaVu Sans", sans-serif; font-size: 13px; }}
.nav {{ background: #151515; color: #fff; height: {NAV_H}px; line-height: {NAV_H}px;
  padding: 0 16px; font-size: 14px; }}
.nav b {{ margin-right: 28px; }} .nav span {{ color: #bbb; margin-right: 20px; }}
.head {{ height: {HEAD_H}px; box-sizing: border-box; padding: 10px 16px 0;
  border-bottom: 1px solid #e6e6e6; overflow: hidden; }}
.head h1 {{ font-size: 20px; font-weight: 500; margin: 0 0 6px; }}
.head h1 small {{ color: #999; font-size: 15px; margin-left: 8px; }}
.meta span {{ margin-right: 22px; }} .meta b {{ font-weight: 600; margin-right: 4px; }}
.legend {{ float: right; }} .lg {{ margin-left: 14px; }}
.lg i {{ display: inline-block; width: 10px; height: 10px; margin-right: 5px; }}
.minimap {{ position: relative; height: {MINIMAP_H - 16}px; margin: 8px 16px; background: #f6f6f6;
  border: 1px solid #e6e6e6; box-sizing: border-box; }}
.mm {{ position: absolute; height: 2px; min-width: 1px; }}
.thead {{ display: flex; height: {THEAD_H}px; line-height: {THEAD_H}px; background: #ececec;
  border-bottom: 1px solid #ccc; box-sizing: border-box; font-weight: 500; }}
.thead .name {{ width: {LEFT}px; padding-left: 12px; box-sizing: border-box; }}
.ticks {{ position: relative; width: {timeline_w}px; }}
.tick {{ position: absolute; top: 0; bottom: 0; border-left: 1px solid #ccc; }}
.tick span {{ margin-left: 4px; font-weight: 400; color: #666; font-size: 12px; }}
.tick:last-child span {{ margin-left: -64px; }}
.span-row {{ display: flex; height: {ROW_H}px; line-height: {ROW_H - 1}px;
  border-bottom: 1px solid #f0f0f0; box-sizing: border-box; }}
.span-row.open {{ background: #f0f4ff; }}
.span-row .name {{ width: {LEFT}px; box-sizing: border-box; white-space: nowrap; overflow: hidden;
  text-overflow: ellipsis; border-right: 1px solid #e6e6e6; }}
.svc {{ font-weight: 600; }} .op {{ color: #555; }}
.err {{ display: inline-block; background: #db2828; color: #fff; border-radius: 7px; width: 14px;
  height: 14px; line-height: 14px; text-align: center; font-size: 10px; margin-right: 4px; }}
.bars {{ position: relative; width: {timeline_w}px; background: repeating-linear-gradient(90deg,
  transparent 0, transparent calc(25% - 1px), #eee calc(25% - 1px), #eee 25%); }}
.bar {{ position: absolute; top: 6px; height: 12px; min-width: 2px; border-radius: 2px; }}
.dur {{ position: absolute; color: #666; font-size: 11px; white-space: nowrap; }}
.detail-row {{ padding: 6px 16px 0 {LEFT + 8}px; background: #f0f4ff;
  border-bottom: 1px solid #dde4f5; box-sizing: border-box; overflow: hidden; }}
.dh {{ font-weight: 600; }}
.detail table {{ border-collapse: collapse; font-family: "DejaVu Sans Mono", monospace;
  font-size: 12px; }}
.detail td {{ height: {TAG_H}px; box-sizing: border-box; padding: 0 10px 0 6px;
  border-bottom: 1px solid #e3e8f5; }}
.dh {{ height: 20px; }}
.detail td.k {{ color: #666; }}
</style></head><body>
<div class="nav"><b>Trace view</b><span>OTLP receiver</span><span>specdec</span></div>
<div class="head"><h1>{esc(info["root"])}<small>{info["trace_id"][:7]}</small></h1>
<div class="meta"><span><b>Trace Start</b>{started} UTC</span>
<span><b>Duration</b>{_ms(total)}</span><span><b>Services</b>{len(info["services"])}</span>
<span><b>Depth</b>{info["depth"]}</span><span><b>Total Spans</b>{info["spans"]}</span>
<span class="legend">{legend}</span></div></div>
<div class="minimap">{minimap}</div>
<div class="thead"><div class="name">Service &amp; Operation</div>
<div class="ticks">{ticks}</div></div>
{"".join(body)}
</body></html>
"""


def _detail_h(span: ReceivedSpan) -> int:
    return 6 + 20 + TAG_H * (len(span.attributes) + 1) + 10


def page_height(spans: list[ReceivedSpan], expand: str = "") -> int:
    """The page's height in CSS pixels: every part has a fixed height (see the styles)."""
    detail = sum(_detail_h(s) for s in spans if s.span_id == expand)
    return ROWS_TOP + len(spans) * ROW_H + detail + 12
