"""A hostile peer on the synced folders: whoever can write the inbox or the outbox (a Syncthing
peer, another user of the share) plants links, FIFOs and odd names where the service works.

The service must never write through a link planted at a temporary name into a file of the
user's, never hang on a FIFO named like a file it reads, and never pass a name's control
characters raw to the terminal, the log, a text file or a notification.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from stemdeck_watch.core import paths
from stemdeck_watch.ui.folder import STATUS_FILE, is_status_temp
from stemdeck_watch.ui.desktop.notify import Note, Target
from stemdeck_watch.links.linkfile import LinkError, read_link
from stemdeck_watch.intake.ownership import FOLDER, InboxOwnership, read_heartbeats
from stemdeck_watch.core.paths import move_file
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.manifest import read_manifest, verify_folder
from stemdeck_watch.engine.recovery import adopt_orphans
from stemdeck_watch.util.safefile import read_regular, temp_name
from stemdeck_watch.util.synth import write_song

from support import desktop
from support.helpers import open_scheduler, wait_for, write_config
from support.notify_receiver import Receiver

SUPPORT = Path(__file__).resolve().parents[1] / "support"
BASHRC = "alias ll='ls -l'\n"
# a song name as a hostile peer would write it: a terminal title and clear-screen sequence,
# and a newline followed by something that looks like a log line of its own
HOSTILE = "x\x1b]0;pwned\x07\x1b[2J\n2099-01-01 00:00:00 ERROR   stemdeck_watch: forged"


def victim_file(tmp_path: Path, name: str = ".bashrc") -> Path:
    """A file of the user's outside the synced folders, that a planted link points at."""
    victim = tmp_path / "home" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_text(BASHRC)
    return victim


# ---------------------------------------------------------------- writing: planted links


def test_a_planted_symlink_at_the_status_temp_file_is_never_written_through(
    make_settings, service_factory, tmp_path
):
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


def test_a_planted_symlink_at_an_album_folder_of_processed_or_failed_is_never_gone_through(
    make_settings, service_factory, tmp_path
):
    """`processed/Album` and `failed/Album` → a folder of the user's: a song of the album
    and a damaged file of it stay in the inbox, saying why, and nothing lands where the
    links point; the song's stems are published and the damaged file's report is written
    at the top of failed/."""
    settings = make_settings()
    elsewhere = tmp_path / "home" / "Documents"
    elsewhere.mkdir(parents=True)
    for folder in (settings.paths.processed, settings.paths.failed):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "Album").symlink_to(elsewhere)
    service, jobs = service_factory(settings)
    album = settings.paths.inbox / "Album"
    album.mkdir(parents=True)
    staged = write_song(tmp_path / "01 Intro.wav", 1.0)
    staged.rename(album / "01 Intro.wav")
    (album / "02 Broken.wav").write_bytes(os.urandom(20_000))
    ended = {job.name: job for job in jobs.wait_final(2)}
    song, broken = ended["01 Intro"], ended["02 Broken"]
    assert song.state is JobState.DONE and read_manifest(Path(song.output)) is not None
    assert "processed/Album is a symbolic link" in (song.error or ""), song.error
    assert broken.state is JobState.FAILED
    assert (album / "01 Intro.wav").is_file() and (album / "02 Broken.wav").is_file()
    assert list(elsewhere.iterdir()) == []
    report = settings.paths.failed / "02 Broken.wav.error.txt"
    assert "failed/Album is a symbolic link" in report.read_text()


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
    tmp_path, other_filesystem
):
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


# ---------------------------------------------------------------- reading: planted FIFOs


def finishes(call: Callable[[], Any], fifos: list[Path], timeout: float = 10.0) -> Any:
    """`call()`'s result (or exception) if it returns within `timeout`; otherwise the FIFOs
    are opened for writing (which lets a blocked reader go on) and the test fails."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(10)
        pytest.fail(f"blocked for more than {timeout:.0f} s on a FIFO")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_a_fifo_named_like_a_link_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "song.url"
    os.mkfifo(fifo)
    with pytest.raises(LinkError, match="song.url is not a link file"):
        finishes(lambda: read_link(fifo), [fifo])


def test_only_plain_files_of_a_bounded_size_are_read_from_a_shared_folder(tmp_path):
    fifo, link, big = tmp_path / "fifo", tmp_path / "link", tmp_path / "big"
    os.mkfifo(fifo)
    big.write_bytes(b"x" * 2000)
    link.symlink_to(big)
    for path in (fifo, link, big):
        with pytest.raises(OSError):
            finishes(lambda: read_regular(path, 1000), [fifo])
    assert read_regular(big, 2000) == b"x" * 2000


def test_a_malformed_manifest_planted_in_the_outbox_is_left_alone_not_a_failed_start(settings):
    """stemdeck.json files of any JSON shape in the outbox: the complete one of them is
    adopted, the others are named in the log, and the start goes on."""
    outbox = settings.paths.outbox
    shapes = {
        "list": [],
        "number": 7,
        "stems not a list": {"stems": 1},
        "stem not an object": {"stems": [1]},
        "files not a list": {"stems": [{"file": "a.wav"}], "files": 3},
        "input not an object": {"job_id": "j1", "stems": [{"file": "a.wav"}], "input": "x"},
    }
    for name, manifest in shapes.items():
        (outbox / name).mkdir()
        (outbox / name / "a.wav").write_bytes(b"RIFF")
        (outbox / name / "stemdeck.json").write_text(json.dumps(manifest))
    for name in list(shapes)[:-1]:
        assert read_manifest(outbox / name) is None, name
    scheduler = open_scheduler(settings)
    try:
        assert adopt_orphans(scheduler, settings) == 1
        assert scheduler.registry.get("j1").output == str(outbox / "input not an object")
    finally:
        scheduler.registry.close()


def test_fifos_planted_as_heartbeats_and_manifests_never_hang_the_start(tmp_path, model_repo):
    """A heartbeat in inbox/.stemdeck/ and an orphan song folder's stemdeck.json that are
    FIFOs, or links to one: `run` starts (the files are skipped and named in the log) and
    stops on SIGTERM."""
    config = write_config(tmp_path, model_repo)
    pipe = tmp_path / "elsewhere" / "pipe"
    pipe.parent.mkdir()
    os.mkfifo(pipe)
    beats = tmp_path / "inbox" / FOLDER
    beats.mkdir(parents=True)
    (beats / "owner-linked.json").symlink_to(pipe)
    os.mkfifo(beats / "owner-fifo.json")
    for name in ("Linked Orphan", "Fifo Orphan"):
        (tmp_path / "outbox" / name).mkdir(parents=True)
    (tmp_path / "outbox" / "Linked Orphan" / "stemdeck.json").symlink_to(pipe)
    os.mkfifo(tmp_path / "outbox" / "Fifo Orphan" / "stemdeck.json")
    log = tmp_path / "state" / "logs" / "stemdeck-watch.log"
    with open(tmp_path / "run.out", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "run", "--no-tray"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(
                lambda: log.exists() and "stemdeck-watch is running" in log.read_text(),
                90,
                "the service to start",
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    for name in ("Linked Orphan", "Fifo Orphan"):
        assert f"{name} has a damaged or incomplete stemdeck.json" in text


# ---------------------------------------------------------------- names shown


def test_a_hostile_song_name_reaches_neither_the_terminal_nor_the_log_raw(tmp_path, model_repo):
    """A song named with escape sequences and a newline followed by a fake log line: the
    terminal of `run`, the log file and `status` show it escaped, on one line."""
    config = write_config(tmp_path, model_repo)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / f"{HOSTILE}.wav").write_bytes(os.urandom(20_000))  # fails at once
    log = tmp_path / "state" / "logs" / "stemdeck-watch.log"
    terminal = tmp_path / "run.out"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "stemdeck_watch", "--config", str(config), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def failed() -> bool:
        result = cli("status", "--json")
        return result.returncode == 0 and any(
            j["state"] == "failed" for j in json.loads(result.stdout)["jobs"]
        )

    with open(terminal, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stemdeck_watch", "--config", str(config), "run", "--no-tray"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(failed, 90, "the song to fail", interval=0.5)
            shown = cli("status")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert shown.returncode == 0, shown.stderr
    for where, text in (
        ("the terminal", terminal.read_text()),
        ("the log", log.read_text()),
        ("status", shown.stdout),
    ):
        assert "x\\x1b]0;pwned\\x07\\x1b[2J\\n2099" in text, where  # named, escaped
        assert "\x1b" not in text and "\x07" not in text, where
        assert not any(line.startswith("2099") for line in text.splitlines()), where
    report = next((tmp_path / "failed").glob("*.error.txt")).read_text()
    assert "\x1b" not in report and "x?]0;pwned??[2J?2099" in report


def test_notifications_show_a_hostile_name_escaped_and_never_as_markup(tmp_path):
    """A plain target gets the name's control characters escaped; a desktop notification's
    body (read as markup by the notification server) gets `<`, `>` and `&` escaped too."""
    name = "<b>Bold</b> & <a href='evil.example'>link</a>\x1b[31m"
    with Receiver() as receiver:
        assert Target(receiver.url).send(Note("done", f"Stems ready: {name}", f"{name} done"))[0]
        (got,) = receiver.wait(1, timeout=30)
    assert got["title"] == "Stems ready: " + name.replace("\x1b", "\\x1b")
    assert got["message"] == name.replace("\x1b", "\\x1b") + " done"

    desktop.require_desktop_notifications()
    env = {k: v for k, v in os.environ.items() if k != "DBUS_SESSION_BUS_ADDRESS"}
    result = subprocess.run(
        [
            "dbus-run-session",
            "--",
            sys.executable,
            str(SUPPORT / "notify_desktop_check.py"),
            str(tmp_path),
            name,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    first = json.loads(result.stdout.strip().splitlines()[-1])["received"][0]
    escaped = name.replace("\x1b", "\\x1b")
    markup = escaped.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert first["summary"] == f"Stems ready: {escaped}"
    assert first["body"] == f"{markup} is separated. Stems: {tmp_path / 'outbox'}/{markup}"


def test_deeply_nested_json_planted_as_a_manifest_or_heartbeat_does_not_stop_the_start(
    make_settings, service_factory
) -> None:
    """A stemdeck.json in an orphan song folder, a heartbeat in inbox/.stemdeck/ and the
    manifest of a song folder the service published, each a few KB of `[[[[…`: the service
    starts, skips them, and a song dropped again is separated rather than failing."""
    settings = make_settings()
    deep = "[" * 50_000
    orphan = settings.paths.outbox / "Orphan"
    orphan.mkdir(parents=True)
    (orphan / "a.wav").write_bytes(b"RIFF")
    (orphan / "stemdeck.json").write_text(deep)
    beats = settings.paths.inbox / FOLDER
    beats.mkdir(parents=True)
    (beats / "owner-deep.json").write_text(deep)

    service, jobs = service_factory(settings)  # neither stops the start
    assert service.ownership is not None
    assert [beat.path for beat in read_heartbeats(beats)] == [service.ownership.path]
    write_song(settings.paths.inbox / "song.wav", 1.0, seed=3)
    first = wait_for(
        lambda: next((j for j in jobs.latest.values() if j.state.is_final), None),
        120,
        "the song to end",
    )
    assert first.state is JobState.DONE, first
    (Path(first.output) / "stemdeck.json").write_text(deep)  # a peer rewrites its manifest
    assert verify_folder(Path(first.output)) != []
    write_song(settings.paths.inbox / "song.wav", 1.0, seed=3)  # the same song again
    second = wait_for(
        lambda: next(
            (j for j in jobs.latest.values() if j.id != first.id and j.state.is_final), None
        ),
        120,
        "the copy to end",
    )
    assert second.state is JobState.DONE and second.output != first.output, second
