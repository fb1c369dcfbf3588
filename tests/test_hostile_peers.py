"""A hostile peer on the synced folders: whoever can write the inbox or the outbox (a Syncthing
peer, another user of the share) plants links, FIFOs and odd names where the service works.

The service must never write through a link planted at a temporary name into a file of the
user's, never hang on a FIFO named like a file it reads, and never pass a name's control
characters raw to the terminal, the log, a text file or a notification.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from stemdeck_watch import paths
from stemdeck_watch.control.folder import STATUS_FILE, is_status_temp
from stemdeck_watch.intake.ownership import FOLDER, InboxOwnership, read_heartbeats
from stemdeck_watch.paths import move_file
from stemdeck_watch.safefile import temp_name

from conftest import wait_for

BASHRC = "alias ll='ls -l'\n"

def victim_file(tmp_path: Path, name: str = ".bashrc") -> Path:
    """A file of the user's outside the synced folders, that a planted link points at."""
    victim = tmp_path / "home" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_text(BASHRC)
    return victim


# ---------------------------------------------------------------- writing: planted links

def test_a_planted_symlink_at_the_status_temp_file_is_never_written_through(
        make_settings, service_factory, tmp_path):
    """`outbox/.STATUS.txt.tmp` → the user's .bashrc, and a song named with newlines: the
    status text must not land in .bashrc (with `echo INJECTED` on a line of its own), and
    STATUS.txt shows the name on one line."""
    settings = make_settings()
    victim = victim_file(tmp_path)
    outbox, inbox = settings.paths.outbox, settings.paths.inbox
    outbox.mkdir(parents=True, exist_ok=True)
    inbox.mkdir(parents=True, exist_ok=True)
    (outbox / ".STATUS.txt.tmp").symlink_to(victim)
    service, jobs = service_factory(settings)
    (inbox / "evil\necho INJECTED\n.wav").write_bytes(os.urandom(20_000))  # fails at once
    jobs.wait_final(1)
    status = outbox / STATUS_FILE

    def current() -> str:
        return status.read_text() if status.exists() else ""

    wait_for(lambda: "INJECTED" in current(), 30, "STATUS.txt naming the song")
    service.shutdown()
    assert victim.read_text() == BASHRC
    assert not status.is_symlink()
    text = status.read_text()
    assert "echo INJECTED" not in text.splitlines()
    assert "evil?echo INJECTED?" in text


def test_a_planted_symlink_at_the_heartbeat_temp_file_is_never_written_through(tmp_path):
    """`inbox/.stemdeck/.owner-<id>.json.tmp` → a file of the user's: the heartbeat is not
    written into it; a link at the heartbeat's own name is replaced, not followed."""
    inbox = tmp_path / "inbox"
    folder = inbox / FOLDER
    folder.mkdir(parents=True)
    victim, other = victim_file(tmp_path), victim_file(tmp_path, ".profile")
    (folder / ".owner-mine.json.tmp").symlink_to(victim)
    (folder / "owner-mine.json").symlink_to(other)
    ownership = InboxOwnership(inbox, host="me", service_id="mine")
    assert ownership.claim()
    try:
        assert victim.read_text() == BASHRC and other.read_text() == BASHRC
        assert not ownership.path.is_symlink()
        assert [b.service_id for b in read_heartbeats(folder)] == ["mine"]
    finally:
        ownership.stop()


@pytest.fixture
def other_filesystem(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """A folder on another filesystem (/dev/shm); where there is none, a folder whose hard
    links and renames from outside fail with EXDEV, as across filesystems."""
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix="stemdeck-hostile-", dir="/dev/shm"))
    except OSError:
        pass
    if folder is not None and folder.stat().st_dev == tmp_path.stat().st_dev:
        folder.rmdir()
        folder = None
    if folder is None:
        folder = tmp_path / "elsewhere"
        folder.mkdir()
        real_link, real_rename = os.link, os.rename

        def inside(path: Any) -> bool:
            return folder in Path(path).parents

        def link(src: Any, dst: Any) -> None:
            if inside(dst):
                raise OSError(errno.EXDEV, "Invalid cross-device link", str(dst))
            real_link(src, dst)

        def rename(src: Any, dst: Any) -> None:
            if inside(dst) and not inside(src):
                raise OSError(errno.EXDEV, "Invalid cross-device link", str(dst))
            real_rename(src, dst)

        monkeypatch.setattr(paths.os, "link", link)
        monkeypatch.setattr(paths.os, "rename", rename)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_planted_symlink_at_the_cross_filesystem_copy_is_never_written_through(
        tmp_path, other_filesystem):
    """processed/ on another filesystem, `processed/.song.wav.stemdeck-tmp` → the user's
    .bashrc: the input's bytes do not land in .bashrc, and processed/song.wav is the input
    itself, not the planted link. A killed run's half copy beside it is cleaned up."""
    victim = victim_file(tmp_path)
    song = tmp_path / "inbox" / "song.wav"
    song.parent.mkdir()
    data = os.urandom(300_000)
    song.write_bytes(data)
    processed = other_filesystem / "processed"
    processed.mkdir()
    (processed / ".song.wav.stemdeck-tmp").symlink_to(victim)
    killed = processed / ".song.wav.0123456789abcdef.stemdeck-tmp"
    killed.write_bytes(data[:1000])
    where = move_file(song, processed / "song.wav")
    assert victim.read_text() == BASHRC
    assert where == processed / "song.wav" and not where.is_symlink()
    assert where.read_bytes() == data and not song.exists()
    assert not killed.exists()


def test_a_status_rewrite_in_flight_has_a_recognisable_hidden_name():
    """Tests and people tell STATUS.txt's temporary copy from a leftover by its name."""
    name = temp_name(STATUS_FILE)
    assert name.startswith(".STATUS.txt.") and is_status_temp(name)
    assert not is_status_temp(".STATUS.txt.tmp") and not is_status_temp("STATUS.txt")
    assert temp_name(STATUS_FILE) != name
