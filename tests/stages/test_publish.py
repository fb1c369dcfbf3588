"""Stems, mixes and the manifest are written into staging and published in one rename."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import unicodedata
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import soundfile

from stemdeck_watch.core.config import OutputSettings, SeparationSettings
from stemdeck_watch.core.errors import PublishError
from stemdeck_watch.core.jobs import Job, JobKind, JobState
from stemdeck_watch.engine.recovery import find_published
from stemdeck_watch.stages.publish import pcm, publish_folder, write_song
from stemdeck_watch.stages.manifest import read_manifest, verify_folder, write_manifest
from stemdeck_watch.stages.scratch import AudioWriter
from stemdeck_watch.util import folders

SR = 44100
SOURCES = ("drums", "bass", "other", "vocals")


@pytest.fixture
def stems(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(1)
    result = {}
    for i, name in enumerate(SOURCES):
        path = tmp_path / "stems" / f"{name}.npy"
        path.parent.mkdir(exist_ok=True)
        np.save(path, (0.2 * (i + 1) * rng.standard_normal((2, SR))).astype(np.float32))
        result[name] = path
    return result


def out(**kw) -> OutputSettings:
    return dataclasses.replace(OutputSettings(), **kw)


def sep(**kw) -> SeparationSettings:
    return dataclasses.replace(SeparationSettings(), **kw)


@pytest.mark.parametrize(
    "fmt, depth, subtype",
    [
        ("wav", 16, "PCM_16"),
        ("wav", 24, "PCM_24"),
        ("wav", 32, "FLOAT"),
        ("flac", 24, "PCM_24"),
    ],
)
def test_stems_are_written_in_the_configured_format(tmp_path: Path, stems, fmt, depth, subtype):
    entries = write_song(
        tmp_path / "stage", stems, SR, "song", sep(), out(format=fmt, bit_depth=depth)
    )
    assert [e["name"] for e in entries] == list(SOURCES)
    for entry in entries:
        info = soundfile.info(tmp_path / "stage" / entry["file"])
        assert info.subtype == subtype and info.frames == SR and info.channels == 2
        assert entry["file"] == f"{entry['name']}.{fmt}"


def test_mp3_output_has_the_requested_bitrate(tmp_path: Path, stems) -> None:
    write_song(tmp_path / "stage", stems, SR, "song", sep(), out(format="mp3", mp3_bitrate=128))
    path = tmp_path / "stage" / "vocals.mp3"
    audio, rate = soundfile.read(path)
    assert rate == SR and abs(len(audio) - SR) < 2000
    assert abs(path.stat().st_size - 128_000 / 8) < 3000  # one second at 128 kbit/s


def test_rescale_keeps_peaks_below_full_scale_and_clamp_clips(tmp_path: Path, stems) -> None:
    write_song(tmp_path / "r", stems, SR, "song", sep(), out(clip="rescale", bit_depth=24))
    loud, _ = soundfile.read(tmp_path / "r" / "vocals.wav")
    assert 0.9 < np.abs(loud).max() < 1.0
    write_song(tmp_path / "c", stems, SR, "song", sep(), out(clip="clamp", bit_depth=24))
    clamped, _ = soundfile.read(tmp_path / "c" / "vocals.wav")
    assert np.abs(clamped).max() == pytest.approx(1.0, abs=1e-4)
    write_song(tmp_path / "f", stems, SR, "song", sep(), out(bit_depth=32))
    floats, _ = soundfile.read(tmp_path / "f" / "vocals.wav")
    assert np.abs(floats).max() > 1.0  # float keeps what it was given


def test_two_stems_and_mixes(tmp_path: Path, stems) -> None:
    entries = write_song(
        tmp_path / "s",
        stems,
        SR,
        "song",
        sep(two_stems="vocals"),
        out(bit_depth=32, mixes={"instrumental": ("drums", "bass", "other")}),
    )
    assert [e["name"] for e in entries] == ["vocals", "no_vocals", "instrumental"]
    no_vocals, _ = soundfile.read(tmp_path / "s" / "no_vocals.wav", dtype="float32")
    expected = sum(np.load(stems[s]) for s in ("drums", "bass", "other")).T
    assert np.allclose(no_vocals, expected, atol=1e-5)


def test_a_two_stem_name_the_model_lacks_is_a_clear_error(tmp_path: Path, stems) -> None:
    with pytest.raises(PublishError, match="separation.two_stems = 'guitar'.*drums, bass"):
        write_song(tmp_path / "s", stems, SR, "song", sep(two_stems="guitar"), out())
    with pytest.raises(PublishError, match="output.mixes.band names piano"):
        write_song(tmp_path / "s", stems, SR, "song", sep(), out(mixes={"band": ("piano",)}))


def test_a_mix_named_like_a_stem_is_a_clear_error_not_a_lost_stem(tmp_path: Path, stems) -> None:
    """A model whose stems the config could not know (a local one): checked at publish."""
    for mix in ("drums", "DRUMS"):
        with pytest.raises(PublishError, match=f"output.mixes.{mix} has the name of a stem"):
            write_song(
                tmp_path / "s", stems, SR, "song", sep(), out(mixes={mix: ("drums", "bass")})
            )


def test_layout_template_names_the_files(tmp_path: Path, stems) -> None:
    entries = write_song(
        tmp_path / "s",
        stems,
        SR,
        "My Song",
        sep(model="tiny"),
        out(layout="{name} - {stem} ({model}).{ext}"),
    )
    assert entries[0]["file"] == "My Song - drums (tiny).wav"
    assert (tmp_path / "s" / "My Song - drums (tiny).wav").is_file()


def test_publish_never_overwrites_and_the_manifest_marks_completion(tmp_path: Path, stems) -> None:
    outbox = tmp_path / "outbox"
    (outbox / "song").mkdir(parents=True)
    (outbox / "song" / "keep.txt").write_text("mine")
    stage = outbox / ".stemdeck-staging" / "job1"
    entries = write_song(stage, stems, SR, "song", sep(), out())
    assert read_manifest(stage) is None  # no manifest yet: not a finished song
    write_manifest(stage, {"job_id": "job1", "stems": entries})
    final = publish_folder(stage, outbox, (), "song")
    assert final == outbox / "song (2)"
    assert (outbox / "song" / "keep.txt").read_text() == "mine"
    manifest = read_manifest(final)
    assert manifest["job_id"] == "job1" and not stage.exists()
    (final / "bass.wav").unlink()
    assert read_manifest(final) is None  # a listed stem is missing: incomplete
    assert json.loads((final / "stemdeck.json").read_text())["stemdeck_watch"]


def finished(outbox: Path, stems, job_id: str) -> Path:
    stage = outbox / ".stemdeck-staging" / job_id
    write_manifest(
        stage, {"job_id": job_id, "stems": write_song(stage, stems, SR, "s", sep(), out())}
    )
    return stage


@pytest.mark.parametrize("by_descriptor", [True, False], ids=["dir_fd", "by-path"])
def test_a_link_planted_in_the_outbox_is_never_gone_through(
    tmp_path: Path, stems, monkeypatch, by_descriptor: bool
) -> None:
    """Anyone who can write a shared outbox can put a link where an album's folder will be,
    or where the service keeps its staging folder: the song stays in the outbox, and nothing
    is written where the link points; also where folders are walked by path (Windows)."""
    monkeypatch.setattr(folders, "DIR_FD", by_descriptor)
    outbox, elsewhere = tmp_path / "outbox", tmp_path / "elsewhere"
    outbox.mkdir()
    elsewhere.mkdir()
    (outbox / "Album").symlink_to(elsewhere)
    (outbox / ".stemdeck-staging").symlink_to(elsewhere)
    stage = finished(outbox, stems, "job1")
    assert not stage.parent.is_symlink() and list(elsewhere.iterdir()) == []
    final = publish_folder(stage, outbox, ("Album",), "01 Intro")
    assert final == outbox / "Album (2)" / "01 Intro" and read_manifest(final)["job_id"] == "job1"
    assert (outbox / "Album").is_symlink() and list(elsewhere.iterdir()) == []


def test_a_song_is_never_published_inside_another_songs_folder(tmp_path: Path, stems) -> None:
    """The song `Live` and then the album folder `Live/` with its tracks: the tracks go to
    `Live (2)/`, so the song's folder stays whole (and deleting it deletes no track)."""
    outbox = tmp_path / "outbox"
    song = publish_folder(finished(outbox, stems, "job1"), outbox, (), "Live")
    track = publish_folder(finished(outbox, stems, "job2"), outbox, ("Live",), "01 Opener")
    assert song == outbox / "Live" and track == outbox / "Live (2)" / "01 Opener"
    assert verify_folder(song) == [] and read_manifest(track)["job_id"] == "job2"
    again = publish_folder(finished(outbox, stems, "job3"), outbox, ("Live",), "02 Closer")
    assert again.parent == track.parent  # the album's tracks stay together
    # a restart after a crash right after the rename finds the track where it went
    assert find_published(outbox, publishing("job2", "Live/01 Opener.wav")) == track


def publishing(job_id: str, rel_path: str) -> Job:
    """The job of inbox/`rel_path` cut off by a crash while it published."""
    return Job(
        id=job_id,
        name=PurePosixPath(rel_path).stem,
        kind=JobKind.FILE,
        state=JobState.PUBLISHING,
        source=f"inbox/{rel_path}",
        rel_path=rel_path,
    )


def test_a_restart_finds_a_song_its_outbox_spelled_another_way(tmp_path: Path, stems) -> None:
    """On a folder that ignores case and Unicode normalisation (macOS, Windows, most shares)
    the album `Señor` published into an existing `SEÑOR`, decomposed: a restart after a
    crash right after the rename finds the song there."""
    outbox = tmp_path / "outbox"
    album = outbox / unicodedata.normalize("NFD", "SEÑOR (2)")
    album.mkdir(parents=True)
    (album / "intro").mkdir()  # what the job's own rename made on such a folder
    song = publish_folder(finished(outbox, stems, "job1"), outbox, (album.name,), "Intro")
    assert song == album / "Intro"
    song.rename(album / "intro (2)")
    assert find_published(outbox, publishing("job1", "Señor/Intro.wav")) == album / "intro (2)"


def _whole_output(stems: dict[str, Path], members: list[str]) -> np.ndarray:
    audio = np.array(np.load(stems[members[0]]), dtype=np.float32)
    for member in members[1:]:
        audio += np.load(stems[member])
    return audio


def _whole_song_reference(
    stems: dict[str, Path],
    members: list[str],
    o: OutputSettings,
    song: list[list[str]] | None = None,
) -> np.ndarray:
    """What publish writes, from the whole song in memory: one clip rule, and with rescale
    one divisor for every output of the song (`song`: the members of each output)."""
    audio = _whole_output(stems, members)
    if o.format == "wav" and o.bit_depth == 32:
        return audio
    if o.clip == "clamp":
        return np.clip(audio, -1.0, 1.0)
    peak = max(float(np.abs(_whole_output(stems, m)).max()) for m in (song or [members]))
    return audio / max(1.01 * peak, 1.0)


@pytest.fixture
def worker_stems(tmp_path: Path) -> dict[str, Path]:
    """Stems as the worker writes them (frame-major, appended window by window), with the
    loudest moment of every stem in the last block."""
    rng = np.random.default_rng(2)
    result = {}
    for i, name in enumerate(SOURCES):
        path = tmp_path / "wstems" / f"{name}.npy"
        path.parent.mkdir(exist_ok=True)
        audio = (0.3 * (i + 1) * rng.standard_normal((2, 3 * SR + 77))).astype(np.float32)
        audio[:, -5] = 2.5 + i  # the peak comes late: every earlier block must wait for it
        with AudioWriter(path, 2) as writer:
            for start in range(0, audio.shape[1], SR // 3):
                writer.write(audio[:, start : start + SR // 3])
        result[name] = path
    return result


@pytest.mark.parametrize("fmt, bits", [("wav", 16), ("wav", 24), ("flac", 16), ("flac", 24)])
def test_integer_stems_hold_the_rounded_samples_in_every_format(tmp_path, fmt, bits) -> None:
    """Each sample is round(x * 2^(bits-1)), clipped: the same in wav and flac, and at full
    scale (+1.0 becomes the largest sample, not a wrapped-around negative one)."""
    rng = np.random.default_rng(5)
    audio = rng.uniform(-1, 1, (2, SR)).astype(np.float32)
    audio[:, :6] = [
        [1.0, -1.0, 0.0, 0.5 / 2 ** (bits - 1), 1.5 / 2 ** (bits - 1), 0.99999994],
        [-1.0, 1.0, -0.0, -0.5 / 2 ** (bits - 1), -1.5 / 2 ** (bits - 1), -0.5],
    ]
    stem = tmp_path / "vocals.npy"
    with AudioWriter(stem, 2) as writer:
        writer.write(audio)
    o = out(format=fmt, bit_depth=bits, clip="clamp")
    (entry,) = write_song(tmp_path / "s", {"vocals": stem}, SR, "song", sep(), o)
    got, _ = soundfile.read(tmp_path / "s" / entry["file"], dtype="int32")
    full = 2 ** (bits - 1)
    want = np.clip(np.rint(audio.T.astype(np.float64) * full), -full, full - 1)
    assert np.array_equal(got >> (32 - bits), want.astype(np.int64))
    assert got[0, 0] >> (32 - bits) == full - 1 and got[0, 1] >> (32 - bits) == -full


@pytest.mark.parametrize(
    "o",
    [
        out(format="wav", bit_depth=16),
        out(format="wav", bit_depth=24, clip="clamp"),
        out(format="wav", bit_depth=32),
        out(format="flac", bit_depth=16),
        out(format="flac", bit_depth=24, clip="clamp"),
    ],
    ids=["wav16-rescale", "wav24-clamp", "wav32", "flac16-rescale", "flac24-clamp"],
)
def test_streamed_outputs_equal_the_whole_song_written_at_once(tmp_path, worker_stems, o):
    o = dataclasses.replace(o, mixes={"instrumental": ("drums", "bass", "other")})
    entries = write_song(
        tmp_path / "s", worker_stems, SR, "song", sep(two_stems="vocals"), o, block_frames=10_000
    )  # many blocks, the last one short
    plan = {
        "vocals": ["vocals"],
        "no_vocals": ["drums", "bass", "other"],
        "instrumental": ["drums", "bass", "other"],
    }
    assert [e["name"] for e in entries] == list(plan)
    loudest = 0.0
    for entry in entries:
        assert entry["frames"] == 3 * SR + 77 and entry["channels"] == 2
        expected = _whole_song_reference(worker_stems, plan[entry["name"]], o, list(plan.values()))
        reference = tmp_path / f"ref-{entry['file']}"
        samples = expected.T if o.bit_depth == 32 else pcm(expected, o.bit_depth)
        soundfile.write(
            reference,
            samples,
            SR,
            format=o.format.upper(),
            subtype={16: "PCM_16", 24: "PCM_24", 32: "FLOAT"}[o.bit_depth],
        )
        got, _ = soundfile.read(tmp_path / "s" / entry["file"], dtype="float32")
        want, _ = soundfile.read(reference, dtype="float32")
        assert np.array_equal(got, want), entry["name"]
        loudest = max(loudest, float(np.abs(got).max()))
    if o.clip == "rescale" and o.bit_depth != 32:
        assert 0.98 < loudest < 1.0  # one factor for the song, from the loudest late peak


def test_streamed_mp3_is_the_same_encoding_as_the_whole_song_at_once(tmp_path, worker_stems):
    import lameenc

    o = out(format="mp3", mp3_bitrate=192, tags=False)  # the audio frames alone
    write_song(tmp_path / "s", worker_stems, SR, "song", sep(), o, block_frames=10_000)
    audio = _whole_song_reference(worker_stems, ["bass"], o, [[s] for s in SOURCES])
    encoder = lameenc.Encoder()
    encoder.set_bit_rate(192)
    encoder.set_in_sample_rate(SR)
    encoder.set_channels(2)
    encoder.set_quality(2)
    whole = encoder.encode(pcm(audio, 16).astype("<i2").tobytes())
    assert (tmp_path / "s" / "bass.mp3").read_bytes() == whole + encoder.flush()


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_a_full_disk_mid_stem_is_a_clear_error_not_a_crash_inside_soundfile(
    tmp_path: Path, stems, fmt, monkeypatch
) -> None:
    import errno

    from stemdeck_watch.stages import publish

    class FillingUp:
        """A raw file on a disk with 100 kB left: one short write, then ENOSPC."""

        def __init__(self, handle):
            self._handle, self._left = handle, 100_000

        def write(self, data) -> int:
            if self._left <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = self._handle.write(memoryview(data)[: self._left])
            self._left -= n
            return n

        def __getattr__(self, name):
            return getattr(self._handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

    real_open_new = publish.open_new
    monkeypatch.setattr(publish, "open_new", lambda *a, **k: FillingUp(real_open_new(*a, **k)))
    with pytest.raises(PublishError, match="could not write .*drums.* No space left"):
        write_song(tmp_path / "s", stems, SR, "song", sep(), out(format=fmt), block_frames=4096)


def test_a_folder_walked_by_path_refuses_links_as_the_descriptors_do(tmp_path, monkeypatch):
    """Where no folder can be opened (Windows), each level is looked at before it is used: a
    link to a folder or to a file is refused as it is where folders are descriptors."""
    monkeypatch.setattr(folders, "DIR_FD", False)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "stem.wav").write_bytes(b"RIFF")
    (tmp_path / "secret.wav").write_bytes(b"mine")
    (tmp_path / "real" / "linked.wav").symlink_to(tmp_path / "secret.wav")
    (tmp_path / "away").symlink_to(tmp_path / "real", target_is_directory=True)
    with folders.Folder.root(tmp_path) as root, root.open("real") as real:
        with os.fdopen(real.open_file("stem.wav", os.O_RDONLY), "rb") as handle:
            assert handle.read() == b"RIFF"
        for name, opener in (("linked.wav", real.open_file), ("away", root.open)):
            with pytest.raises(OSError) as refused:
                opener(name, os.O_RDONLY) if name.endswith(".wav") else opener(name)
            assert refused.value.errno == errno.ELOOP, name


def test_a_folder_left_open_when_the_check_of_a_level_fails_is_closed(tmp_path):
    """A level whose check raises (a share gone mid-walk) is closed, not leaked."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counting open descriptors needs /proc (Linux)")
    (tmp_path / "outbox" / "Album").mkdir(parents=True)
    before = len(os.listdir("/proc/self/fd"))

    def gone(folder: folders.Folder) -> bool:
        raise OSError(errno.EIO, "the share went away")

    for _ in range(5):
        with pytest.raises(OSError):
            folders.open_folders(tmp_path / "outbox", ("Album",), taken=gone)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_windows_junction_is_refused_as_a_link():
    """On Windows lstat reports a junction (which any user can make) as a folder: its
    reparse-point attribute marks it, and a folder walked by path refuses it."""
    import types

    junction = types.SimpleNamespace(st_mode=0o040755, st_file_attributes=0x410)
    folder = types.SimpleNamespace(st_mode=0o040755, st_file_attributes=0x10)
    assert folders._a_link(junction) and not folders._a_link(folder)  # type: ignore[arg-type]
