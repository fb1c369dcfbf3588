"""A DJ stem file beside the stems: NI Stems (`<song>.stem.mp4`), read by Traktor, Mixxx, djay.

The format is an MP4 holding five AAC streams — the master (what an ordinary player plays:
the only track marked enabled) and four stems in the order drums, bass, other, vocals — and a
`stem` box under `moov/udta` holding JSON that names the stems and gives their colours (the
"stem manifest"; DJ software reads it from there).

The streams are encoded with PyAV (FFmpeg's AAC encoder) block by block from the worker's
scratch stems, so memory does not grow with the song; the master is the sum of the four
parts, every part scaled by the song's one gain, so the parts still add up to it. FFmpeg
writes `moov` last, with `udta` (the tags) as its last child; the stem box is appended to the
file and the two sizes patched, which needs no audio moved and no box read whole.

A model whose stems are not drums, bass, other and vocals (plus extras such as guitar and
piano, mixed into "other") gets no stem file and a note saying why: the format has exactly
those four slots.
"""

from __future__ import annotations

import fractions
import json
import os
import struct
from pathlib import Path
from typing import IO, Any, Callable, Mapping

import numpy as np

from stemdeck_watch.core.errors import FilesystemError, PublishError
from stemdeck_watch.stages.naming import clean_text, song_file
from stemdeck_watch.stages.preview import COLOURS
from stemdeck_watch.stages.scratch import BLOCK_FRAMES, AudioReader
from stemdeck_watch.util.safefile import open_new

SLOTS = ("drums", "bass", "other", "vocals")
SUFFIX = ".stem.mp4"
BITRATE = 256_000  # per stream: what NI's own Stem Creator writes
# the "mastering_dsp" block every stem manifest carries; off: the stems are played as they are
MASTERING_DSP = {
    "compressor": {
        "enabled": False,
        "input_gain": 0.5,
        "output_gain": 0.5,
        "threshold": 0,
        "dry_wet": 50,
        "attack": 0.003,
        "release": 0.3,
        "ratio": 3,
        "hp_cutoff": 300,
    },
    "limiter": {"enabled": False, "threshold": 0, "ceiling": 0, "release": 0.05},
}


def slot_members(sources: list[str]) -> dict[str, list[str]] | None:
    """The model's stems in each of the format's four slots (extras go into "other"), or
    None where the model lacks one of them."""
    if not all(slot in sources for slot in SLOTS):
        return None
    extras = [s for s in sources if s not in SLOTS]
    return {slot: [slot, *(extras if slot == "other" else [])] for slot in SLOTS}


def stem_manifest() -> dict[str, Any]:
    """The JSON of the `stem` box: names and colours (as in preview.png) of the four slots."""
    return {
        "version": 1,
        "mastering_dsp": MASTERING_DSP,
        "stems": [
            {"name": slot.capitalize(), "color": "#{:02X}{:02X}{:02X}".format(*COLOURS[slot])}
            for slot in SLOTS
        ],
    }


def file_name(name: str) -> str:
    """The stem file's name: the song's name and `.stem.mp4`."""
    return song_file(name, SUFFIX)


def write_stem_file(
    staging: Path,
    stems: dict[str, Path],
    samplerate: int,
    gain: float,
    name: str,
    tags: Mapping[str, Any],
    check: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Write `<song>.stem.mp4` into `staging`; returns the manifest's "stem_file"."""
    slots = slot_members(list(stems))
    if slots is None:
        return {
            "file": None,
            "notes": [
                f"no stem file: NI Stems holds drums, bass, other and vocals, and the model "
                f"separates {', '.join(stems)}"
            ],
        }
    path = staging / file_name(name)
    try:
        with open_new(path, "w+b") as handle:
            frames = _encode(handle, stems, slots, samplerate, gain, tags, check)
            _add_stem_box(handle, json.dumps(stem_manifest()).encode())
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise PublishError(str(FilesystemError("write", path, reason=exc))) from exc
    return {
        "file": path.name,
        "streams": ["master", *SLOTS],
        "codec": "aac",
        "bitrate": BITRATE,
        "samplerate": samplerate,
        "frames": frames,
        "slots": slots,
    }


def _encode(
    handle: IO[bytes],
    stems: dict[str, Path],
    slots: dict[str, list[str]],
    samplerate: int,
    gain: float,
    tags: Mapping[str, Any],
    check: Callable[[], None],
) -> int:
    """Five AAC streams, written a block of every stream at a time (the muxer interleaves
    them as they come); returns the frames of each."""
    import av

    readers = {stem: AudioReader(p) for stem, p in stems.items()}
    channels = next(iter(readers.values())).channels
    frames = min(r.frames for r in readers.values())
    layout = "stereo" if channels == 2 else "mono"
    container = av.open(handle, "w", format="mp4")
    try:
        for field in ("title", "artist", "album"):
            if clean_text(tags.get(field) or ""):
                container.metadata[field] = clean_text(tags[field])
        streams = []
        for label in ("master", *SLOTS):
            stream = container.add_stream("aac", rate=samplerate, layout=layout)
            stream.bit_rate = BITRATE
            stream.metadata["handler_name"] = label
            streams.append(stream)
        for start in range(0, frames, BLOCK_FRAMES):
            check()
            stop = min(frames, start + BLOCK_FRAMES)
            blocks = {stem: reader.read(start, stop) for stem, reader in readers.items()}
            parts = [gain * sum(blocks[m] for m in slots[slot]) for slot in SLOTS]
            for stream, audio in zip(streams, [sum(parts), *parts], strict=True):
                _mux(
                    container,
                    stream,
                    np.ascontiguousarray(audio, np.float32),
                    start,
                    samplerate,
                    layout,
                )
        for stream in streams:
            for packet in stream.encode(None):
                container.mux(packet)
    finally:
        container.close()
    return frames


def _mux(
    container: Any, stream: Any, audio: np.ndarray, start: int, samplerate: int, layout: str
) -> None:
    import av

    frame = av.AudioFrame.from_ndarray(audio, format="fltp", layout=layout)
    frame.sample_rate = samplerate
    frame.pts = start
    frame.time_base = fractions.Fraction(1, samplerate)
    for packet in stream.encode(frame):
        container.mux(packet)


def _boxes(handle: IO[bytes], start: int, end: int) -> list[tuple[bytes, int, int]]:
    """(type, offset, size) of the boxes between `start` and `end`, from their headers."""
    found = []
    offset = start
    while offset + 8 <= end:
        handle.seek(offset)
        size, kind = struct.unpack(">I4s", handle.read(8))
        if size == 1:  # a 64-bit size follows
            size = struct.unpack(">Q", handle.read(8))[0]
        elif size == 0:  # to the end
            size = end - offset
        if size < 8:
            raise OSError(f"a damaged MP4 box at byte {offset}")
        found.append((kind, offset, size))
        offset += size
    return found


def _add_stem_box(handle: IO[bytes], manifest: bytes) -> None:
    """Put the stem manifest into `moov/udta/stem`. The muxer wrote `moov` last with `udta`
    last inside it: the box goes at the end of the file and the sizes of both grow by it
    (a new `udta` is made if there is none at the end of `moov`)."""
    end = handle.seek(0, os.SEEK_END)
    top = _boxes(handle, 0, end)
    kind, moov, moov_size = top[-1]
    if kind != b"moov" or moov + moov_size != end:
        raise OSError("the MP4 muxer did not write moov last; cannot add the stem manifest")
    children = _boxes(handle, moov + 8, end)
    box = struct.pack(">I4s", 8 + len(manifest), b"stem") + manifest
    patch = [moov]
    if children and children[-1][0] == b"udta" and children[-1][1] + children[-1][2] == end:
        patch.append(children[-1][1])
    else:
        box = struct.pack(">I4s", 8 + len(box), b"udta") + box
    for offset in patch:
        handle.seek(offset)
        size = struct.unpack(">I", handle.read(4))[0]
        if size < 8:  # a 64-bit size: not what the muxer writes for moov or udta
            raise OSError("an MP4 box with a 64-bit size where the muxer writes 32 bits")
        handle.seek(offset)
        handle.write(struct.pack(">I", size + len(box)))
    handle.seek(end)
    handle.write(box)
