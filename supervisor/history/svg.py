"""Just enough hand-written SVG for the report's charts: escaping, linear scales, nice ticks, a few shapes.

A plotting library would bring a dependency (and usually scripts or fonts) into a page that must stay one
self-contained, script-free file; the report draws rectangles, lines and polylines, which fit here. Every
string that reaches the page goes through `esc` (history text is untrusted: paths, exit details).
"""
from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable, Sequence

__all__ = ["esc", "Linear", "nice_ticks", "time_ticks", "fmt_num", "fmt_time", "tag", "text", "decimate", "polyline", "svg"]

_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
               172800, 604800, 1209600, 2592000)


def esc(value: object) -> str:
    """Text or attribute value, HTML-escaped (quotes too); a lone surrogate (a path's undecodable byte, a JSON
    "\\udXXX") is written as its escape, since UTF-8 cannot encode it."""
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return html.escape(text, quote=True)


class Linear:
    """Maps the domain [d0, d1] onto the range [r0, r1]; a zero-width domain maps to the middle."""

    def __init__(self, d0: float, d1: float, r0: float, r1: float) -> None:
        self.d0, self.d1, self.r0, self.r1 = d0, d1, r0, r1

    def __call__(self, v: float) -> float:
        if self.d1 == self.d0:
            return (self.r0 + self.r1) / 2
        return self.r0 + (v - self.d0) * (self.r1 - self.r0) / (self.d1 - self.d0)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) inside [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(1, n)
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def time_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Tick times at a round interval (seconds to weeks, then whole multiples of 30 days), aligned to it in UTC."""
    if hi <= lo:
        return [lo]
    longest = _TIME_STEPS[-1]
    step = next((s for s in _TIME_STEPS if (hi - lo) / s <= n), math.ceil((hi - lo) / n / longest) * longest)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) // step) + 1)]


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    if float(v).is_integer() and abs(v) < 1e9:
        return str(int(v))
    if abs(v) >= 10000 or abs(v) < 0.001:
        return f"{v:.3g}"
    return f"{v:.4g}"


def fmt_time(t: float, span: float) -> str:
    """A tick label in UTC, as precise as the span needs."""
    st = time.gmtime(t)
    if span > 2 * 86400:
        return time.strftime("%m-%d %H:%M", st)
    return time.strftime("%H:%M:%S" if span < 600 else "%H:%M", st)


def _attrs(cls: str | None, attrs: dict[str, object]) -> str:
    parts = [f' class="{esc(cls)}"'] if cls else []
    for key, value in attrs.items():
        if value is None:
            continue
        if isinstance(value, float):
            value = f"{value:.1f}"
        parts.append(f' {key.rstrip("_").replace("_", "-")}="{esc(value)}"')
    return "".join(parts)


def tag(name: str, cls: str | None = None, title: str | None = None, **attrs: object) -> str:
    """One element; `title` becomes a hover tooltip (an SVG <title> child)."""
    if title is None:
        return f"<{name}{_attrs(cls, attrs)}/>"
    return f"<{name}{_attrs(cls, attrs)}><title>{esc(title)}</title></{name}>"


def text(x: float, y: float, content: str, cls: str | None = None, anchor: str | None = None) -> str:
    return f"<text{_attrs(cls, {'x': float(x), 'y': float(y), 'text_anchor': anchor})}>{esc(content)}</text>"


def decimate(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per pixel column, only the first, lowest, highest and last point (in order): the same picture, a month of
    samples in a few thousand points."""
    out: list[tuple[float, float]] = []
    column: list[tuple[float, float]] = []
    for p in points:
        if column and int(p[0]) != int(column[0][0]):
            out += _extremes(column)
            column = []
        column.append(p)
    return out + _extremes(column)


def _extremes(column: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(column) <= 4:
        return column
    keep = {0, len(column) - 1, min(range(len(column)), key=lambda i: column[i][1]),
            max(range(len(column)), key=lambda i: column[i][1])}
    return [column[i] for i in sorted(keep)]


def polyline(points: Iterable[tuple[float, float]], cls: str, title: str | None = None) -> str:
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in decimate(points))
    return tag("polyline", cls, title, points=pts)


def svg(width: int, height: int, body: Sequence[str], label: str, cls: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="{esc(cls)}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{esc(label)}">' + "".join(body) + "</svg>")
