"""Songs and links added through the API (what the page's drop zone and link box send), against
a real service: streamed to disk with flat memory, named safely, refused with a reason.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import pytest

from stemdeck_watch.core.jobs import JobKind
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for

MB = 1 << 20


def rss() -> int:
    """This process's resident memory in bytes (the service runs in the test's process)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class Upload:
    """One POST /api/uploads on a raw socket: headers first, then the body as it is given,
    so a test decides what is sent when (and the sender never holds the file whole)."""

    def __init__(
        self,
        service: Any,
        name: str,
        length: int,
        *,
        preset: str | None = None,
        token: str | None = None,
    ):
        self.sock = socket.create_connection(("127.0.0.1", service.api.port), timeout=60)
        query = f"name={quote(name, safe='')}" + (f"&preset={quote(preset)}" if preset else "")
        head = (
            f"POST /api/uploads?{query} HTTP/1.1\r\nHost: 127.0.0.1:{service.api.port}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n"
        )
        if token != "":
            head += f"Authorization: Bearer {token or service.api.token}\r\n"
        self.sock.sendall((head + "\r\n").encode())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> tuple[int, dict[str, Any]]:
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        body = json.loads(response.read())
        self.sock.close()
        return response.status, body


def upload(service: Any, name: str, data: bytes, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    sender = Upload(service, name, len(data), **kwargs)
    sender.send(data)
    return sender.reply()


def inbox_entries(service: Any) -> set[str]:
    """Everything in the inbox, hidden files and subfolders' files too."""
    inbox = service.settings.paths.inbox
    return {
        p.relative_to(inbox).as_posix()
        for p in inbox.rglob("*")
        if p.is_file() and ".stemdeck" not in p.parts
    }


@pytest.fixture
def paused(make_settings: Any, service_factory: Any) -> Iterator[Any]:
    service, _ = service_factory(
        make_settings(api={"max_upload_mb": 300}, presets={"karaoke": {"two_stems": "vocals"}})
    )
    service.scheduler.pause()
    yield service


def test_a_200_mb_upload_is_streamed_to_disk_with_flat_service_memory(paused: Any) -> None:
    size, piece = 200 * MB, os.urandom(MB)
    baseline, peak, stop = rss(), [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            stop.wait(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    digest = hashlib.sha256()
    try:
        sender = Upload(paused, "big song.wav", size)
        for i in range(size // MB):
            block = piece[i % 7 :] + piece[: i % 7]  # every megabyte different
            digest.update(block)
            sender.send(block)
        status, reply = sender.reply()
    finally:
        stop.set()
        watcher.join()
    assert status == 200, reply
    assert reply == {"file": "big song.wav", "bytes": size, "preset": None}
    growth = peak[0] - baseline
    assert growth < 40 * MB, (
        f"the service's memory grew by {growth / MB:.0f} MB for a 200 MB upload"
    )
    written = paused.settings.paths.inbox / "big song.wav"
    check = hashlib.sha256()
    with open(written, "rb") as handle:
        for block in iter(lambda: handle.read(MB), b""):
            check.update(block)
    assert check.hexdigest() == digest.hexdigest()
    assert inbox_entries(paused) == {"big song.wav"}  # no temporary file left beside it


def test_a_hostile_name_is_cut_to_one_clean_file_name_in_the_inbox(
    paused: Any, tmp_path: Path
) -> None:
    song = write_song(tmp_path / "src.wav", 1.0).read_bytes()
    names = {
        "../../escape\x1b[31m\n.wav": "escape [31m.wav",
        "..\\..\\windows\\evil.wav": "windows-evil.wav",
        "/etc/passwd.wav": "etc-passwd.wav",
        ".wav": "upload.wav",
        "..hidden.mp3": "hidden.mp3",
        "bell\x07\x00zero.WAV": "bell zero.wav",
        "Pause.mp3": "Pause (song).mp3",  # a song, never the inbox's pause switch
    }
    for sent, expected in names.items():
        status, reply = upload(paused, sent, song)
        assert status == 200, (sent, reply)
        assert reply["file"] == expected, (sent, reply)
    inbox = paused.settings.paths.inbox
    assert inbox_entries(paused) == set(names.values())
    assert not (tmp_path / "escape [31m.wav").exists() and not Path("/etc/passwd.wav").exists()
    # the same name again is a second file, never written over the first
    status, reply = upload(paused, "etc-passwd.wav", song)
    assert reply["file"] == "etc-passwd (2).wav"
    wait_for(
        lambda: paused.registry.latest_for_source(str(inbox / "escape [31m.wav")),
        20,
        "the uploaded song to be queued",
    )
    wait_for(
        lambda: paused.registry.latest_for_source(str(inbox / "Pause (song).mp3")),
        20,
        "the song named Pause to be queued",
    )

    status, reply = upload(paused, "karaoke song.mp3", song, preset="karaoke")
    assert status == 200 and reply["file"] == "karaoke/karaoke song.mp3"
    job = wait_for(
        lambda: paused.registry.latest_for_source(str(inbox / "karaoke" / "karaoke song.mp3")),
        20,
        "the preset's song to be queued",
    )
    assert job.preset == "karaoke"


def test_an_upload_is_refused_with_a_reason_and_leaves_nothing(paused: Any) -> None:
    status, reply = upload(paused, "notes.txt", b"hello")
    assert status == 415 and "not a song the inbox takes" in reply["error"]
    status, reply = upload(paused, "song.wav", b"RIFF", preset="nope")
    assert status == 400 and "no preset 'nope'" in reply["error"]
    status, reply = upload(paused, "song.wav", b"RIFF", token="")
    assert status == 401
    status, reply = upload(paused, "song.wav", b"RIFF", token="wrong")
    assert status == 401

    broken = Upload(paused, "cut off.wav", 10 * MB)  # the browser tab was closed mid-way
    broken.send(os.urandom(MB))
    broken.sock.close()
    time.sleep(0.5)
    wait_for(lambda: not inbox_entries(paused), 10, "the partial upload to be removed")


def test_an_upload_over_the_cap_is_refused_before_a_byte_is_read(
    make_settings: Any, service_factory: Any
) -> None:
    service, _ = service_factory(make_settings(api={"max_upload_mb": 1}))
    sender = Upload(service, "huge.wav", 3 * MB)  # the body is never sent
    status, reply = sender.reply()
    assert status == 413
    assert "limited to 1 MB (api.max_upload_mb)" in reply["error"] and "3.0 MB" in reply["error"]
    assert not inbox_entries(service)


def post_link(service: Any, body: Any) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", service.api.port, timeout=10)
    try:
        conn.request(
            "POST",
            "/api/links",
            body=json.dumps(body),
            headers={
                "Authorization": f"Bearer {service.api.token}",
                "Content-Type": "application/json",
            },
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_pasted_link_becomes_a_url_file_and_a_link_job(paused: Any) -> None:
    url = "http://127.0.0.1:9/music/a%20song"  # loopback, and the queue is paused
    status, reply = post_link(paused, {"url": url})
    assert status == 200 and reply["file"] == "127.0.0.1 a song.url", reply
    written = paused.settings.paths.inbox / reply["file"]
    assert written.read_bytes() == f"[InternetShortcut]\r\nURL={url}\r\n".encode()
    job = wait_for(
        lambda: paused.registry.latest_for_source(str(written)), 20, "the link to be queued"
    )
    assert job.kind is JobKind.LINK

    status, reply = post_link(paused, {"url": url, "name": "../up\x1b", "preset": "karaoke"})
    assert status == 200 and reply["file"] == "karaoke/up.url", reply

    status, reply = post_link(paused, {"url": url, "name": "Pause"})  # never the pause switch
    assert status == 200 and reply["file"] == "Pause (link).url", reply

    for bad, reason in (
        ({"url": "file:///etc/passwd"}, "not a web address"),
        ({"url": "http://x/a b"}, "without spaces"),
        ({"url": "http://[::1/x"}, "not a valid URL (Invalid IPv6 URL)"),
        ({"url": "http://127.0.0.1/\ud800"}, "not valid Unicode"),
        ({"url": url, "name": "a\udc80"}, "not valid Unicode"),
        ({"url": url, "preset": "nope"}, "no preset"),
        ({"url": url, "extra": 1}, "unexpected field"),
    ):
        status, reply = post_link(paused, bad)
        assert status == 400 and reason in reply["error"], (bad, reply)


def test_links_turned_off_are_refused(make_settings: Any, service_factory: Any) -> None:
    service, _ = service_factory(make_settings(links={"enabled": False}))
    status, reply = post_link(service, {"url": "http://127.0.0.1:9/a"})
    assert status == 409 and "links.enabled = false" in reply["error"]
    assert not inbox_entries(service)


def test_a_preset_folder_planted_as_a_link_is_refused_and_nothing_is_written_through_it(
    paused: Any, tmp_path: Path
) -> None:
    """`inbox/karaoke` made a link by anyone who can write the inbox: an upload or a link
    for that preset is refused with the reason (409), and nothing reaches where it points."""
    import shutil

    inbox = paused.settings.paths.inbox
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = inbox / "karaoke"
    if planted.is_dir():
        shutil.rmtree(planted)
    planted.symlink_to(elsewhere, target_is_directory=True)
    song = write_song(tmp_path / "src.wav", 1.0).read_bytes()
    status, reply = upload(paused, "up.wav", song, preset="karaoke")
    assert status == 409, reply
    assert "preset folder 'karaoke'" in reply["error"] and "symbolic link" in reply["error"]
    link = {"url": "http://127.0.0.1:9/a", "name": "up", "preset": "karaoke"}
    status, reply = post_link(paused, link)
    assert status == 409 and "symbolic link" in reply["error"], reply
    assert not list(elsewhere.iterdir()), "nothing is written where the link points"

    planted.unlink()  # a link to nothing: not made into a folder through it either
    planted.symlink_to(tmp_path / "gone", target_is_directory=True)
    status, reply = upload(paused, "up.wav", song, preset="karaoke")
    assert status == 409 and "symbolic link" in reply["error"], reply
    assert not (tmp_path / "gone").exists()

    planted.unlink()  # a file where the folder goes
    planted.write_bytes(b"")
    status, reply = post_link(paused, link)
    assert status == 409 and "not a folder" in reply["error"], reply
    assert inbox_entries(paused) == {"karaoke"}
