"""The DJ stem file (NI Stems `.stem.mp4`), read back with PyAV and an MP4 box walker written
here from the format's description (ISO/IEC 14496-12 boxes, the `moov/udta/stem` manifest)."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from stemdeck_watch.core.config import OutputSettings, SeparationSettings, settings_from_dict
from stemdeck_watch.stages.preview import COLOURS
from stemdeck_watch.stages.publish import SongInfo
from stemdeck_watch.stages.scratch import AudioWriter
from stemdeck_watch.stages.songfolder import make_song_folder

SR = 44100
FOUR = ("drums", "bass", "other", "vocals")


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), beat_grid=False, preview=False, **kw)


def tone_stems(
    folder: Path, names: tuple[str, ...], seconds: float = 3.0, loud: float = 0.5
) -> dict[str, Path]:
    """One tone per stem, each at its own pitch, loud enough together to need the gain."""
    t = np.arange(int(seconds * SR)) / SR
    folder.mkdir(parents=True, exist_ok=True)
    stems = {}
    for i, name in enumerate(names):
        tone = loud * np.sin(2 * np.pi * 110 * (i + 1) * t)
        with AudioWriter(folder / f"{name}.npy", 2) as writer:
            writer.write(np.stack([tone, 0.8 * tone]).astype(np.float32))
        stems[name] = folder / f"{name}.npy"
    return stems


def boxes(data: bytes, start: int, end: int) -> dict[bytes, list[tuple[int, int]]]:
    """Child boxes between start and end: type → [(payload start, payload end)]."""
    found: dict[bytes, list[tuple[int, int]]] = {}
    while start + 8 <= end:
        size, kind = struct.unpack(">I4s", data[start : start + 8])
        header = 8
        if size == 1:
            size, header = struct.unpack(">Q", data[start + 8 : start + 16])[0], 16
        assert size >= header and start + size <= end, (kind, size)
        found.setdefault(kind, []).append((start + header, start + size))
        start += size
    assert start == end, "boxes do not fill their parent exactly"
    return found


def stem_box(data: bytes) -> tuple[dict, list[int]]:
    """The stem manifest (moov/udta/stem) and each track's tkhd flags."""
    top = boxes(data, 0, len(data))
    ((moov_start, moov_end),) = top[b"moov"]
    moov = boxes(data, moov_start, moov_end)
    ((udta_start, udta_end),) = moov[b"udta"]
    ((stem_start, stem_end),) = boxes(data, udta_start, udta_end)[b"stem"]
    flags = []
    for trak_start, trak_end in moov[b"trak"]:
        ((tkhd_start, _),) = boxes(data, trak_start, trak_end)[b"tkhd"]
        flags.append(int.from_bytes(data[tkhd_start + 1 : tkhd_start + 4], "big"))
    return json.loads(data[stem_start:stem_end]), flags


def decode_each(path: Path) -> list[np.ndarray]:
    """Every audio stream decoded on its own (planar float, (channels, n))."""
    import av

    result = []
    with av.open(str(path)) as probe:
        count = len(probe.streams.audio)
    for index in range(count):
        with av.open(str(path)) as container:
            stream = container.streams.audio[index]
            result.append(
                np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1)
            )
    return result


def snr(reference: np.ndarray, got: np.ndarray) -> float:
    n = min(reference.shape[1], got.shape[1])
    band = slice(SR // 10, n - SR // 10)
    error = got[:, band] - reference[:, band]
    return float(10 * np.log10(np.sum(reference[:, band] ** 2) / np.sum(error**2)))


def test_the_stem_file_holds_the_master_and_four_stems_with_names_and_colours(
    tmp_path: Path,
) -> None:
    stems = tone_stems(tmp_path / "stems", FOUR)
    info = SongInfo("Song", tags={"title": "Blue in Green", "artist": "Miles Davis"})
    folder = make_song_folder(
        tmp_path / "s", stems, SR, info, SeparationSettings(), out(stem_file=True)
    )
    summary = folder.manifest["stem_file"]
    assert summary["file"] == "Song.stem.mp4"
    path = tmp_path / "s" / "Song.stem.mp4"
    manifest, flags = stem_box(path.read_bytes())
    assert manifest["version"] == 1 and "mastering_dsp" in manifest
    assert [s["name"] for s in manifest["stems"]] == ["Drums", "Bass", "Other", "Vocals"]
    assert [s["color"] for s in manifest["stems"]] == [
        "#{:02X}{:02X}{:02X}".format(*COLOURS[n]) for n in FOUR
    ]
    # an ordinary player plays the master only: the stems' tracks are not enabled
    assert [f & 1 for f in flags] == [1, 0, 0, 0, 0]

    import av

    with av.open(str(path)) as container:
        assert container.metadata.get("title") == "Blue in Green"
        assert len(container.streams.audio) == 5
        assert {s.rate for s in container.streams.audio} == {SR}
    master, *parts = decode_each(path)
    frames = 3 * SR
    for audio in (master, *parts):
        assert audio.shape[0] == 2 and abs(audio.shape[1] - frames) <= 1024
    # one gain for the song, from the loudest thing written: here the master, the four
    # tones together (no stem alone goes beyond full scale)
    gain = folder.manifest["levels"]["gain"]
    peak = float(np.abs(sum(np.load(stems[n]) for n in FOUR)).max())
    assert peak > 1.0 and gain == pytest.approx(1 / (1.01 * peak), rel=1e-4)
    for name, part in zip(FOUR, parts, strict=True):
        reference = np.load(stems[name]).astype(np.float64) * gain
        assert snr(reference, part) > 25, name
    assert snr(sum(parts), master) > 25  # the parts add up to the master
    assert np.abs(master).max() < 1.0


def test_a_six_stem_model_folds_guitar_and_piano_into_other(tmp_path: Path) -> None:
    six = (*FOUR, "guitar", "piano")
    stems = tone_stems(tmp_path / "stems", six, seconds=1.5, loud=0.2)
    folder = make_song_folder(
        tmp_path / "s",
        stems,
        SR,
        SongInfo("six"),
        SeparationSettings(model="htdemucs_6s"),
        out(stem_file=True),
    )
    assert folder.manifest["stem_file"]["slots"]["other"] == ["other", "guitar", "piano"]
    _master, _drums, _bass, other, _vocals = decode_each(tmp_path / "s" / "six.stem.mp4")
    gain = folder.manifest["levels"]["gain"]
    reference = sum(np.load(stems[n]).astype(np.float64) for n in ("other", "guitar", "piano"))
    assert snr(reference * gain, other) > 25


def test_a_model_without_the_four_slots_gets_a_note_instead(tmp_path: Path) -> None:
    stems = tone_stems(tmp_path / "stems", ("speech", "music"), seconds=1.0)
    folder = make_song_folder(
        tmp_path / "s", stems, SR, SongInfo("talk"), SeparationSettings(), out(stem_file=True)
    )
    assert folder.manifest["stem_file"]["file"] is None
    assert "drums, bass, other and vocals" in folder.manifest["stem_file"]["notes"][0]
    assert not list((tmp_path / "s").glob("*.stem.mp4"))


def test_stem_file_is_off_by_default() -> None:
    assert settings_from_dict({}).output.stem_file is False


@pytest.mark.slow
def test_a_dropped_song_gets_a_stem_file_for_dj_software(
    make_settings, service_factory, tmp_path: Path
) -> None:
    from stemdeck_watch.core.jobs import JobState
    from stemdeck_watch.stages.manifest import read_manifest, verify_folder
    from stemdeck_watch.util.synth import write_song

    settings = make_settings(output={"stem_file": True, "preview": False})
    _service, jobs = service_factory(settings)
    made = write_song(tmp_path / "made" / "Club.wav", 4.0)
    made.replace(settings.paths.inbox / "Club.wav")
    (job,) = jobs.wait_final(1)
    assert job.state is JobState.DONE, job.error
    folder = Path(job.output)
    manifest = read_manifest(folder)
    assert manifest["stem_file"]["file"] == "Club.stem.mp4" and verify_folder(folder) == []
    names, _flags = stem_box((folder / "Club.stem.mp4").read_bytes())
    assert [s["name"] for s in names["stems"]] == ["Drums", "Bass", "Other", "Vocals"]
    streams = decode_each(folder / "Club.stem.mp4")
    assert len(streams) == 5
    assert all(abs(s.shape[1] - manifest["stem_file"]["frames"]) <= 1024 for s in streams)


def test_the_stem_file_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    """It is written, then read back and patched, through one handle opened O_EXCL and
    O_NOFOLLOW: a link where it goes is an error, and what it points at stays untouched."""
    from stemdeck_watch.core.errors import PublishError

    stems = tone_stems(tmp_path / "stems", FOUR, seconds=0.5)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "song.stem.mp4").symlink_to(victim)
    with pytest.raises(PublishError, match="song.stem.mp4"):
        make_song_folder(
            tmp_path / "s", stems, SR, SongInfo("song"), SeparationSettings(), out(stem_file=True)
        )
    assert victim.read_text() == "mine"
