"""Moving inputs never overwrites, and a failed copy leaves the source in place."""

from __future__ import annotations

import errno
import os
from pathlib import Path
import shutil

import pytest

from stemdeck_watch.core import paths
from stemdeck_watch.core.errors import FilesystemError
from stemdeck_watch.core.paths import move_file, numbered, unique_path


def test_collisions_get_numbered_names(tmp_path: Path) -> None:
    assert numbered(Path("song.mp3"), 2) == Path("song (2).mp3")
    assert numbered(Path("My.Song"), 3, keep_suffix=False) == Path("My.Song (3)")
    (tmp_path / "song.mp3").touch()
    (tmp_path / "song (2).mp3").touch()
    assert unique_path(tmp_path / "song.mp3") == tmp_path / "song (3).mp3"


def test_move_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "song.mp3").write_text("old")
    src = tmp_path / "song.mp3"
    src.write_text("new")
    target = move_file(src, tmp_path / "done" / "song.mp3")
    assert target.name == "song (2).mp3" and target.read_text() == "new"
    assert (tmp_path / "done" / "song.mp3").read_text() == "old"
    assert not src.exists()


def test_move_across_filesystems_copies_then_removes(tmp_path: Path, monkeypatch) -> None:
    def cross_device(src, dst):  # what os.link/os.rename say across mounts
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(paths.os, "link", cross_device)
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append(Path(src).name)
        if not Path(src).name.startswith("."):
            cross_device(src, dst)
        return real_rename(src, dst)  # the temporary copy beside the target

    monkeypatch.setattr(paths.os, "rename", rename)
    src = tmp_path / "in" / "song.mp3"
    src.parent.mkdir()
    src.write_bytes(b"audio" * 1000)
    target = move_file(src, tmp_path / "out" / "song.mp3")
    assert target.read_bytes() == b"audio" * 1000 and not src.exists()
    assert not list((tmp_path / "out").glob(".*"))


def test_a_failed_copy_leaves_the_source(tmp_path: Path, monkeypatch) -> None:
    def cross_device(*_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(paths.os, "link", cross_device)
    monkeypatch.setattr(paths.os, "rename", cross_device)

    def disk_full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths.shutil, "copyfileobj", disk_full)
    src = tmp_path / "song.mp3"
    src.write_bytes(b"audio")
    with pytest.raises(FilesystemError, match="could not copy .*song.mp3 to .*: No space left"):
        move_file(src, tmp_path / "out" / "song.mp3")
    assert src.read_bytes() == b"audio"
    assert list((tmp_path / "out").iterdir()) == []


def test_only_one_service_per_state_folder(tmp_path: Path) -> None:
    from stemdeck_watch.core.lock import AlreadyRunning, ServiceLock, running_pid

    assert running_pid(tmp_path) is None
    lock = ServiceLock.acquire(tmp_path)
    try:
        assert running_pid(tmp_path) == os.getpid()
        with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}.*{tmp_path}"):
            ServiceLock.acquire(tmp_path)
    finally:
        lock.release()
    assert running_pid(tmp_path) is None
    ServiceLock.acquire(tmp_path).release()


def test_a_copy_cut_off_before_the_source_was_removed_is_finished(tmp_path: Path) -> None:
    src, dst = tmp_path / "inbox" / "song.wav", tmp_path / "failed" / "song.wav"
    src.parent.mkdir()
    dst.parent.mkdir()
    src.write_bytes(b"audio" * 1000)
    shutil.copy2(src, dst)  # what the cross-filesystem move had done when the power went
    assert move_file(src, dst) == dst
    assert not src.exists() and sorted(p.name for p in dst.parent.iterdir()) == ["song.wav"]
    other = tmp_path / "inbox" / "song.wav"
    other.write_bytes(b"other" * 1000)  # same name, other content: a new number
    assert move_file(other, dst) == dst.with_name("song (2).wav")


def test_a_name_near_the_limit_of_one_name_is_moved_numbered_and_reported(tmp_path):
    """255 bytes is one name on ext4 and APFS: 125 Cyrillic letters and `.wav` are 254. Its
    numbered copy, its report and the temporary names written beside it are cut to fit,
    keeping what tells them apart."""
    from stemdeck_watch.util.safefile import is_temp_name, temp_name, write_replacing

    name = "Ж" * 125 + ".wav"
    assert len(name.encode()) == 254
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / name).write_bytes(b"first")
    (tmp_path / "in" / name).write_bytes(b"second")
    moved = move_file(tmp_path / "in" / name, tmp_path / "out" / name, paths.report_path)
    assert moved.name.endswith("Ж (2).wav") and len(moved.name.encode()) <= 255
    assert moved.read_bytes() == b"second" and (tmp_path / "out" / name).read_bytes() == b"first"
    report = paths.report_path(moved)
    write_replacing(report, "why")
    assert report.read_text() == "why" and report.name.endswith(".error.txt")
    assert len(report.name.encode()) <= 255
    temp = temp_name(name)
    assert len(temp.encode()) <= 255 and is_temp_name(temp, name)
    # a restart finds the cut numbered copy where the move put it
    assert paths.numbered_siblings(tmp_path / "out" / name) == [tmp_path / "out" / name, moved]
    folder = numbered(tmp_path / ("Ж" * 127), 2, keep_suffix=False)
    assert folder.name.endswith("Ж (2)") and len(folder.name.encode()) <= 255


def test_long_names_that_differ_at_the_end_keep_their_ends_when_cut(tmp_path: Path) -> None:
    """Two tracks of an album with long names, " - 01.wav" and " - 02.wav": each report,
    numbered copy and temporary name is cut in the middle, so the two never share one."""
    from stemdeck_watch.util.safefile import temp_name

    names = ["Ж" * 123 + f" - 0{i}.wav" for i in (1, 2)]
    assert all(len(n.encode()) == 255 for n in names)
    for made in (
        lambda n: paths.report_path(tmp_path / n).name,
        lambda n: numbered(tmp_path / n, 2).name,
        lambda n: temp_name(n)[: -len(".0123456789abcdef.tmp")],
    ):
        first, second = (made(n) for n in names)
        assert first != second and all(len(x.encode()) <= 255 for x in (first, second))
        assert "…" in first and first.lstrip(".").startswith("Ж") and " - 01" in first


def test_numbered_copies_are_found_whatever_case_the_folder_gave_them(tmp_path: Path) -> None:
    """A folder that ignores case keeps the first spelling: `song.wav (2)` made as
    `SONG (2).wav`; a restart looking for `Song.wav`'s copies finds it (callers check)."""
    for name in ("SONG (2).wav", "song.wav", "Other (2).wav", "Song (x).wav"):
        (tmp_path / name).write_bytes(b"x")
    found = paths.numbered_siblings(tmp_path / "Song.wav")
    assert found == [tmp_path / "song.wav", tmp_path / "SONG (2).wav"]


def test_a_link_planted_where_the_input_goes_never_costs_the_input(tmp_path: Path) -> None:
    """A peer who can write processed/ plants `song.wav` (any case) as a link to the song in
    the inbox: the move must not take it for the song already moved there and delete the
    input; the song is moved beside it, the link left alone."""
    for planted in ("Song.wav", "SONG.wav", "Song (2).wav"):
        root = tmp_path / planted
        (root / "inbox").mkdir(parents=True)
        (root / "processed").mkdir()
        src = root / "inbox" / "Song.wav"
        src.write_bytes(b"the only copy of my song")
        (root / "processed" / planted).symlink_to(src)
        where = move_file(src, root / "processed" / "Song.wav", within=root / "processed")
        assert not where.is_symlink() and where.read_bytes() == b"the only copy of my song"
        assert (root / "processed" / planted).is_symlink(), planted
        signature = os.stat(where)
        found = paths.find_moved(
            root / "processed" / "Song.wav", signature.st_size, signature.st_mtime_ns
        )
        assert found == where, planted


def test_names_are_cut_to_one_name_whatever_their_suffix(tmp_path: Path) -> None:
    """A suffix too long to keep is cut with the rest; an emoji's joiner is never the first
    character kept after the cut."""
    from stemdeck_watch.util.safetext import NAME_BYTES, fit_bytes, numbered_name, with_suffix_bytes

    long_suffix = "a." + "b" * 250
    assert len(numbered_name(long_suffix, 2).encode()) <= NAME_BYTES
    assert len(with_suffix_bytes("x" * 100, "." + "y" * 300).encode()) <= NAME_BYTES
    assert fit_bytes("abcdef", -2) == ""
    family = "\U0001f469\u200d\U0001f469\u200d\U0001f467"
    cut = fit_bytes("x" * 300 + family * 6, 200)
    kept = cut.split("…")[1]
    assert len(cut.encode()) <= 200 and not kept.startswith("\u200d")
