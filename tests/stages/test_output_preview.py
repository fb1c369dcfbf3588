"""preview.png, and a manifest that lists every file with its sha256."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.stages.preview import Peaks, size_for
from stemdeck_watch.stages.publish import SongInfo
from stemdeck_watch.stages.manifest import read_manifest, verify_folder, write_manifest
from stemdeck_watch.stages.scratch import AudioWriter
from stemdeck_watch.stages.songfolder import BEATS, PREVIEW, make_song_folder

SR = 44100
SIX = ("drums", "bass", "other", "vocals", "guitar", "piano")


@pytest.fixture
def six_stems(tmp_path: Path) -> dict[str, Path]:
    """Six stems; guitar is silent (a flat line in the picture, never an error)."""
    rng = np.random.default_rng(7)
    result = {}
    for i, name in enumerate(SIX):
        audio = (0.1 * (i + 1) * rng.standard_normal((2, 2 * SR + 11))).astype(np.float32)
        if name == "guitar":
            audio[:] = 0
        path = tmp_path / "stems" / f"{name}.npy"
        path.parent.mkdir(exist_ok=True)
        with AudioWriter(path, 2) as writer:
            writer.write(audio)
        result[name] = path
    return result


def test_peaks_per_column_equal_the_whole_signals_min_and_max() -> None:
    rng = np.random.default_rng(1)
    audio = rng.standard_normal((2, 10_007)).astype(np.float32)
    peaks = Peaks(audio.shape[1], columns=37)
    for start in range(0, audio.shape[1], 999):  # block edges fall inside columns
        peaks.add(start, audio[:, start : start + 999])
    mono = audio.mean(axis=0)
    column = np.arange(mono.size) * 37 // mono.size
    for c in range(37):
        assert peaks.low[c] == pytest.approx(mono[column == c].min())
        assert peaks.high[c] == pytest.approx(mono[column == c].max())


def test_the_song_folder_has_a_preview_png_of_the_expected_size(tmp_path: Path, six_stems) -> None:
    from PIL import Image

    out = dataclasses.replace(OutputSettings(), beat_grid=False, mixes={"band": ("drums", "bass")})
    info = SongInfo("song", tags={"title": "A Title\nwith a newline"})
    song = make_song_folder(tmp_path / "s", six_stems, SR, info, SeparationSettings(), out)
    with Image.open(tmp_path / "s" / PREVIEW) as image:
        image.verify()
    with Image.open(tmp_path / "s" / PREVIEW) as image:
        assert image.format == "PNG" and image.size == size_for(6)  # stems only, not mixes
        pixels = np.asarray(image.convert("RGB"))
    assert song.manifest["preview"] == PREVIEW and song.timings["preview"] >= 0
    assert BEATS not in song.manifest and not (tmp_path / "s" / BEATS).exists()
    # six rows of waveform: the louder stems fill more of their row than the silent guitar
    _, height = size_for(6)
    rows = [pixels[64 + 96 * i + 8 : 64 + 96 * (i + 1) - 8, 110:] for i in range(6)]
    busy = [int((row.max(axis=2) > 60).sum()) for row in rows]
    assert busy[SIX.index("guitar")] < min(b for i, b in enumerate(busy) if SIX[i] != "guitar")


def test_the_manifest_lists_every_file_with_its_sha256(tmp_path: Path, six_stems) -> None:
    import hashlib

    out = dataclasses.replace(OutputSettings(), layout="stems/{stem}.{ext}")
    stage = tmp_path / "s"
    song = make_song_folder(stage, six_stems, SR, SongInfo("song"), SeparationSettings(), out)
    write_manifest(stage, {"stems": song.entries, **song.manifest})
    manifest = json.loads((stage / "stemdeck.json").read_text())
    listed = {e["file"]: e for e in manifest["files"]}
    on_disk = {
        p.relative_to(stage).as_posix()
        for p in stage.rglob("*")
        if p.is_file() and p.name != "stemdeck.json"
    }
    assert set(listed) == on_disk and {BEATS, PREVIEW, "stems/piano.wav"} <= on_disk
    for name, entry in listed.items():
        data = (stage / name).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["bytes"] == len(data)
    assert verify_folder(stage) == [] and read_manifest(stage) is not None
    with open(stage / "stems" / "bass.wav", "r+b") as handle:  # damage: same size
        handle.seek(1000)
        handle.write(b"\x7f" * 16)
    (stage / "extra.txt").write_text("not ours")
    assert verify_folder(stage) == [
        "extra.txt is not in the manifest",
        "stems/bass.wav has changed (sha256 differs)",
    ]
    (stage / "beats.json").write_text("{}")  # a different size: not complete any more
    assert read_manifest(stage) is None


def test_a_song_folder_that_fails_stops_the_beat_grid_found_beside_it(
    tmp_path: Path, six_stems, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The beat grid is found on a thread of its own while the stems are written: when the
    writing fails, the grid is stopped at its next check, and the error is the song's."""
    import threading

    from stemdeck_watch.core.errors import Cancelled, PublishError
    from stemdeck_watch.stages import publish, songfolder

    started, ended = threading.Event(), []

    def endless_grid(stems, samplerate, check):
        started.set()
        for _ in range(3000):  # 30 s at most: only a stop ends it
            try:
                check()
            except Cancelled as exc:
                ended.append(exc.reason)
                raise
            threading.Event().wait(0.01)
        ended.append("never stopped")
        return {}

    def failing_write(*args, **kwargs):
        assert started.wait(30)
        raise PublishError("could not write bass.wav")

    monkeypatch.setattr(songfolder, "find_beat_grid", endless_grid)
    monkeypatch.setattr(publish, "write_song", failing_write)
    out = dataclasses.replace(OutputSettings(), beat_grid=True)
    with pytest.raises(PublishError, match="bass.wav"):
        make_song_folder(tmp_path / "s", six_stems, SR, SongInfo("song"), SeparationSettings(), out)
    assert ended == ["the song folder failed"]
