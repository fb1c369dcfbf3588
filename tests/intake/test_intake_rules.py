"""Which inbox paths become jobs, and when a file counts as complete (injected clock)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from stemdeck_watch.core.config import AUDIO_EXTENSIONS, Settings
from stemdeck_watch.core.jobs import FileSignature
from stemdeck_watch.intake.filters import InboxFilter
from stemdeck_watch.intake.stability import StabilityTracker

from support.helpers import open_scheduler


@pytest.mark.parametrize(
    "rel",
    [
        "song.mp3",
        "Album/01 Intro.flac",
        "deep/er/still.M4A",
        "video.mkv",
        "take.opus",
    ],
)
def test_audio_files_are_eligible(rel: str) -> None:
    assert InboxFilter(AUDIO_EXTENSIONS).eligible(PurePosixPath(rel))


@pytest.mark.parametrize(
    "rel",
    [
        "._song.mp3",
        ".DS_Store",
        "~$notes.wav",
        ".~lock.song.wav#",
        "song.mp3.part",
        "song.mp3.crdownload",
        "song.download",
        "song.tmp",
        "song.mp3.!sync",
        "song.partial",
        ".song.mp3.icloud",
        "song.mp3.icloud",
        "song.rsls",
        "Thumbs.db",
        "desktop.ini",
        "song.sync-conflict-20260101-120000-ABCDEF.mp3",
        ".stfolder/song.mp3",
        ".stversions/song.mp3",
        ".dropbox.cache/song.mp3",
        ".tmp.drivedownload/x.mp3",
        ".tmp.driveupload/x.mp3",
        "@eaDir/song.mp3",
        "#recycle/song.mp3",
        "#snapshot/a/song.mp3",
        "$RECYCLE.BIN/song.mp3",
        ".Trashes/song.mp3",
        "__MACOSX/song.mp3",
        "notes.txt",
        "cover.jpg",
        "song",
    ],
)
def test_temporary_lock_and_metadata_files_are_never_jobs(rel: str) -> None:
    assert not InboxFilter(AUDIO_EXTENSIONS).eligible(PurePosixPath(rel))


def test_user_patterns_add_to_the_builtin_rules() -> None:
    rules = InboxFilter(AUDIO_EXTENSIONS, ["*demo*", "drafts/*"])
    assert not rules.eligible(PurePosixPath("my demo.mp3"))
    assert not rules.eligible(PurePosixPath("drafts/a.mp3"))
    assert not rules.eligible(PurePosixPath("._x.mp3"))  # built-ins still apply
    assert rules.eligible(PurePosixPath("final.mp3"))


def test_non_recursive_ignores_subfolders() -> None:
    rules = InboxFilter(AUDIO_EXTENSIONS, recursive=False)
    assert rules.eligible(PurePosixPath("a.mp3"))
    assert not rules.eligible(PurePosixPath("sub/a.mp3"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ready_names(tracker: StabilityTracker) -> list[str]:
    return [path.name for path, _ in tracker.ready()]


def tracked_song(tmp_path: Path, settle: float) -> tuple[Clock, StabilityTracker, Path]:
    """A tracker on an injected clock, already watching a 100-byte song.wav."""
    clock = Clock()
    tracker = StabilityTracker(settle, clock)
    song = tmp_path / "song.wav"
    song.write_bytes(b"x" * 100)
    tracker.touch(song)
    return clock, tracker, song


def test_a_file_is_ready_only_after_settling(tmp_path: Path) -> None:
    clock, tracker, _ = tracked_song(tmp_path, 3.0)
    assert ready_names(tracker) == []  # first look never decides
    clock.advance(2.9)
    assert ready_names(tracker) == []
    clock.advance(0.2)
    assert ready_names(tracker) == ["song.wav"]
    assert tracker.pending() == []


def test_the_intake_knows_when_to_look_next(tmp_path: Path) -> None:
    """`next_due` is when a song's quiet period ends, so the intake looks then and a song
    waits `settle_seconds`, not up to a tick more; events and growth move it later."""
    clock, tracker, song = tracked_song(tmp_path, 3.0)
    assert tracker.next_due() is None  # not looked at yet: the next tick does
    tracker.ready()
    assert tracker.next_due() == clock.now + 3.0
    clock.advance(1.0)
    tracker.touch(song)  # an event restarts the quiet period
    assert tracker.next_due() == clock.now + 3.0
    empty = tmp_path / "download.part.wav"
    empty.touch()
    tracker.touch(empty)
    tracker.ready()
    assert tracker.next_due() == clock.now + 3.0  # an empty file is never due
    clock.advance(3.0)
    assert ready_names(tracker) == ["song.wav"] and tracker.next_due() is None


def test_growth_or_events_restart_the_wait(tmp_path: Path) -> None:
    clock, tracker, song = tracked_song(tmp_path, 3.0)
    tracker.ready()
    clock.advance(2.0)
    with open(song, "ab") as handle:
        handle.write(b"more")
    assert ready_names(tracker) == []  # size changed: quiet period restarts now
    clock.advance(2.0)
    tracker.touch(song)  # an event: restarts again
    clock.advance(2.9)
    assert ready_names(tracker) == []
    clock.advance(0.2)
    assert ready_names(tracker) == ["song.wav"]


def test_a_zero_byte_file_waits_as_long_as_it_takes(tmp_path: Path) -> None:
    clock = Clock()
    tracker = StabilityTracker(1.0, clock)
    download = tmp_path / "download.mp3"
    download.touch()
    tracker.touch(download)
    for _ in range(5):
        clock.advance(3600)
        assert ready_names(tracker) == []
    download.write_bytes(b"data")
    assert ready_names(tracker) == []
    clock.advance(1.0)
    assert ready_names(tracker) == ["download.mp3"]


def test_close_after_write_shortens_the_wait_but_is_not_proof(tmp_path: Path) -> None:
    clock = Clock()
    tracker = StabilityTracker(5.0, clock, closed_settle_seconds=1.0)
    song = tmp_path / "song.wav"
    song.write_bytes(b"x" * 10)
    tracker.touch(song, closed=True)
    tracker.ready()
    clock.advance(0.5)
    with open(song, "ab") as handle:  # reopened and written after the close
        handle.write(b"y")
    assert ready_names(tracker) == []
    clock.advance(1.5)
    assert ready_names(tracker) == []  # the close no longer counts: full settle
    clock.advance(3.6)
    assert ready_names(tracker) == ["song.wav"]
    other = tmp_path / "other.wav"
    other.write_bytes(b"x")
    tracker.touch(other, closed=True)
    tracker.ready()
    clock.advance(1.0)
    assert ready_names(tracker) == ["other.wav"]


def test_a_scan_keeps_what_the_writer_said_and_a_write_takes_it_back(tmp_path: Path) -> None:
    clock = Clock()
    tracker = StabilityTracker(5.0, clock, closed_settle_seconds=1.0)
    song = tmp_path / "song.wav"
    song.write_bytes(b"x" * 10)
    tracker.touch(song, closed=True)  # renamed into place
    tracker.ready()
    tracker.touch(song)  # a rescan walks past it
    clock.advance(1.0)
    assert ready_names(tracker) == ["song.wav"]
    tracker.touch(song, closed=True)
    tracker.ready()
    tracker.touch(song, closed=False)  # written again
    clock.advance(1.0)
    assert ready_names(tracker) == []
    clock.advance(4.0)
    assert ready_names(tracker) == ["song.wav"]


def test_vanished_and_forgotten_files_are_dropped(tmp_path: Path) -> None:
    clock = Clock()
    tracker = StabilityTracker(1.0, clock)
    a, b = tmp_path / "a.wav", tmp_path / "sub" / "b.wav"
    b.parent.mkdir()
    for path in (a, b):
        path.write_bytes(b"x")
        tracker.touch(path)
    os.unlink(a)
    tracker.forget(b.parent)
    clock.advance(5)
    assert tracker.ready() == [] and tracker.pending() == []


def drop(settings: Settings, name: str) -> tuple[Path, FileSignature]:
    path = settings.paths.inbox / name
    path.write_bytes(b"RIFF....WAVE" + name.encode())
    return path, FileSignature.of(path.stat())


def test_a_file_deleted_while_it_is_being_admitted_leaves_no_job_and_no_report(
    settings: Settings,
) -> None:
    scheduler = open_scheduler(settings)
    path, sig = drop(settings, "song.wav")
    assert scheduler.wants(path, sig)  # the intake decided to admit it…
    path.unlink()  # …the user deleted it, and the delete event found no job to cancel
    scheduler.file_gone(path)
    assert scheduler.submit_file(path, PurePosixPath("song.wav"), sig) is None
    assert scheduler.registry.jobs() == [] and scheduler.queue.order() == []
    assert list(settings.paths.failed.iterdir()) == []
    scheduler.registry.close()
