"""preview.png: the song's stems as stacked waveforms, with its title and length.

What a person browsing the outbox on a phone looks at first: which stems hold something,
where the vocals come in. Drawn with Pillow (a dependency already, for the tray icon) from
peaks gathered while the stems are written — one (min, max) pair per pixel column — so the
picture costs no second pass over the audio and no memory that grows with the song.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from stemdeck_watch.stages.naming import clean_text
from stemdeck_watch.util.safefile import open_new

WIDTH = 1200
HEADER = 64
ROW = 96
LABEL = 110  # left margin holding the stem names
COLOURS = {
    "vocals": (233, 84, 106),
    "drums": (242, 166, 59),
    "bass": (90, 120, 230),
    "other": (70, 180, 140),
    "guitar": (180, 110, 220),
    "piano": (60, 180, 220),
}
FALLBACK = (150, 150, 160)
BACKGROUND, TEXT, GRID = (22, 24, 30), (235, 235, 240), (48, 52, 62)


def size_for(rows: int) -> tuple[int, int]:
    """The picture's (width, height) in pixels for `rows` stems."""
    return WIDTH, HEADER + ROW * max(1, rows)


class Peaks:
    """Minimum and maximum of the mono signal per pixel column, fed block by block."""

    def __init__(self, frames: int, columns: int = WIDTH - LABEL):
        self.frames = max(1, frames)
        self.columns = columns
        self.low = np.zeros(columns, np.float32)
        self.high = np.zeros(columns, np.float32)

    def add(self, start: int, block: np.ndarray) -> None:
        """`block` (channels, n) holds frames [start, start + n)."""
        if not block.shape[-1]:
            return
        mono = block.mean(axis=0)
        column = np.arange(start, start + mono.size, dtype=np.int64) * self.columns // self.frames
        column = np.minimum(column, self.columns - 1)
        cuts = np.flatnonzero(np.diff(column)) + 1
        first = np.concatenate([[0], cuts])
        where = column[first]
        np.minimum.at(self.low, where, np.minimum.reduceat(mono, first))
        np.maximum.at(self.high, where, np.maximum.reduceat(mono, first))


def draw_preview(path: Path, peaks: dict[str, Peaks], title: str, seconds: float) -> None:
    """Write the PNG (atomically enough for the staging folder: it is flushed to disk)."""
    from PIL import Image, ImageDraw, ImageFont

    width, height = size_for(len(peaks))
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    big, small = _font(ImageFont, 26), _font(ImageFont, 17)
    draw.text((16, 10), clean_text(title, 90) or "song", fill=TEXT, font=big)
    minutes, rest = divmod(int(round(seconds)), 60)
    draw.text((16, 40), f"{minutes}:{rest:02d}  ·  {len(peaks)} stems", fill=TEXT, font=small)
    # one scale for every row, from the loudest stem: rows stay comparable, a quiet stem
    # looks quiet, and silence is a flat line
    loudest = max(
        [
            0.05,
            *(
                max(float(np.abs(p.high).max(initial=0)), float(np.abs(p.low).max(initial=0)))
                for p in peaks.values()
            ),
        ]
    )
    scale = (ROW // 2 - 6) / loudest
    for row, (name, peak) in enumerate(peaks.items()):
        top = HEADER + row * ROW
        middle = top + ROW // 2
        colour = COLOURS.get(name, FALLBACK)
        draw.line([(0, top), (width, top)], fill=GRID)
        draw.text((16, middle - 10), name, fill=colour, font=small)
        for x in range(peak.columns):
            y0 = middle - int(round(peak.high[x] * scale))
            y1 = middle - int(round(peak.low[x] * scale))
            draw.line([(LABEL + x, y0), (LABEL + x, max(y0, y1))], fill=colour)
    with open_new(path) as handle:  # new in the staging folder: never through a link
        image.save(handle, format="PNG", optimize=False)
        handle.flush()
        os.fsync(handle.fileno())


def _font(module, size: int):  # type: ignore[no-untyped-def]
    """Pillow's built-in scalable font (no system font needed), or its bitmap font."""
    try:
        return module.load_default(size=size)
    except (TypeError, OSError, ImportError):  # Pillow without FreeType
        return module.load_default()
