"""The report page in a real browser: headless Chromium renders it, and the screenshot shows the charts.

The PNG is decoded with the standard library (zlib + struct). Skipped only where Chromium is not installed
(.ci/run installs the Debian package).
"""
from __future__ import annotations

import struct
import zlib
from collections import Counter
from pathlib import Path

import pytest

from supervisor.history.html import REASON_COLORS
from tests.history_demo import chromium, main
from tests.unit.test_report import marks

pytestmark = pytest.mark.skipif(chromium() is None, reason="chromium is not installed (Debian: apt-get install chromium)")


def _unfilter(kind: int, line: bytearray, prev: bytearray, bpp: int) -> bytearray:
    if kind == 1:
        for i in range(bpp, len(line)):
            line[i] = (line[i] + line[i - bpp]) & 255
    elif kind == 2:
        line = bytearray(map(lambda a, b: (a + b) & 255, line, prev))
    elif kind == 3:
        for i in range(len(line)):
            line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
    elif kind == 4:
        for i in range(len(line)):
            a, b, c = (line[i - bpp], prev[i], prev[i - bpp]) if i >= bpp else (0, prev[i], 0)
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return line


def decode_png(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(width, height, RGB pixels) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    assert header is not None
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    prev, pixels = bytearray(stride), []
    for y in range(height):
        start = y * (stride + 1)
        prev = _unfilter(raw[start], bytearray(raw[start + 1:start + 1 + stride]), prev, bpp)
        pixels += [(prev[i], prev[i + 1], prev[i + 2]) for i in range(0, stride, bpp)]
    return width, height, pixels


def assert_rendered(page: Path, png: Path, reasons: list[str]) -> None:
    """The screenshot is not blank, has the variety of a chart, and shows the attempt bars' colours."""
    width, height, pixels = decode_png(png.read_bytes())
    assert (width, height) == (1200, 900)
    colours = Counter(pixels)
    ink = len(pixels) - colours[(255, 255, 255)]
    assert ink > 0.03 * len(pixels) and len(colours) > 50, (ink, len(colours))
    for reason in reasons:
        hexa = REASON_COLORS[reason]
        want = tuple(int(hexa[i:i + 2], 16) for i in (1, 3, 5))
        near = sum(n for c, n in colours.items() if max(abs(a - b) for a, b in zip(c, want)) <= 6)
        assert near > 100, f"no {reason} bar ({hexa}) in the screenshot of {page}"


def test_demo_report_renders(tmp_path: Path) -> None:
    """The documented demo command (docs/report.png) renders a page whose SVG has every kind of mark and whose
    screenshot shows the timeline's attempts in the colour of each way they ended."""
    assert main(["--out", str(tmp_path), "--png", str(tmp_path / "report.png")]) == 0
    page = tmp_path / "report.html"
    m = marks(page.read_text())
    assert m.classes["attempt"] == 6 and m.classes["commit"] == 18 and m.classes["quarantine"] == 1
    assert m.classes["restart"] >= 4 and m.classes["loss"] >= 6 and m.classes["val-loss"] > 5
    assert_rendered(page, tmp_path / "report.png", ["signal", "hang", "stopped", "completed"])
