"""A finished song's stems, picture and beat grid through the local API, as the page's player
fetches them: HTTP Range requests against a real service's published folder, and every way a
file that is not this job's published output is refused.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.manifest import MANIFEST
from stemdeck_watch.util.synth import write_song

from support.helpers import wait_for

NO_TOKEN = object()


def call(
    service: Any, path: str, *, token: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes, http.client.HTTPMessage]:
    conn = http.client.HTTPConnection("127.0.0.1", service.api.port, timeout=10)
    try:
        sent = {"Host": f"127.0.0.1:{service.api.port}"}
        if token is not NO_TOKEN:
            sent["Authorization"] = f"Bearer {token or service.api.token}"
        sent.update(headers or {})
        conn.request("GET", path, headers=sent)
        response = conn.getresponse()
        return response.status, response.read(), response.msg
    finally:
        conn.close()


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


def finished_song(service: Any, name: str = "song", seconds: float = 4.0) -> Any:
    """Drop a song, wait until its stems are published; its job."""
    inbox = service.settings.paths.inbox
    staging = inbox.parent / "staging"
    staging.mkdir(exist_ok=True)
    path = write_song(staging / f"{name}.wav", seconds, seed=3)
    os.replace(path, inbox / path.name)

    def done() -> Any:  # the input has moved to processed/ by then
        return next(
            (job for job in service.registry.jobs([JobState.DONE]) if job.name == name), None
        )

    return wait_for(done, 90, f"{name} to be separated")


@pytest.fixture
def song(make_settings: Any, service_factory: Any) -> tuple[Any, Any]:
    service, _ = service_factory(make_settings())
    return service, finished_song(service)


def test_every_stem_is_served_in_byte_ranges_as_the_player_asks(song: tuple[Any, Any]) -> None:
    service, job = song
    status, body, _ = call(service, f"/api/jobs/{job.id}/player")
    assert status == 200, body
    player = json.loads(body)
    folder = Path(job.output)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert [s["name"] for s in player["stems"]] == [e["name"] for e in manifest["stems"]]
    assert player["frames"] == manifest["stems"][0]["frames"] and player["samplerate"] == 44100
    assert player["preview"]["url"] == f"/api/jobs/{job.id}/preview"
    assert player["beats"] is None  # output.beat_grid is off in these tests

    for stem, entry in zip(player["stems"], manifest["stems"]):
        data = (folder / entry["file"]).read_bytes()
        status, body, headers = call(service, stem["url"], headers={"Range": "bytes=100-1099"})
        assert status == 206
        assert headers["Content-Range"] == f"bytes 100-1099/{len(data)}"
        assert headers["Content-Type"] == "audio/wav" and headers["Accept-Ranges"] == "bytes"
        assert body == data[100:1100]
        status, body, headers = call(service, stem["url"], headers={"Range": "bytes=-10"})
        assert (status, body) == (206, data[-10:])
        status, body, headers = call(
            service, stem["url"], headers={"Range": f"bytes={len(data) - 5}-"}
        )
        assert (status, body) == (206, data[-5:])
        assert headers["Content-Range"] == f"bytes {len(data) - 5}-{len(data) - 1}/{len(data)}"
        status, body, headers = call(service, stem["url"])  # no Range: the whole file
        assert (status, body) == (200, data) and headers["Accept-Ranges"] == "bytes"
        status, body, headers = call(service, stem["url"], headers={"Range": f"bytes={len(data)}-"})
        assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}"
        assert "past the end" in error_of(body)

    status, body, headers = call(service, player["preview"]["url"])
    assert status == 200 and headers["Content-Type"] == "image/png"
    assert body == (folder / "preview.png").read_bytes()
    status, body, _ = call(service, f"/api/jobs/{job.id}/stems/guitar")
    assert status == 404 and "has no stem 'guitar'" in error_of(body)
    status, body, _ = call(service, f"/api/jobs/{job.id}/beats")
    assert status == 404 and "no beat grid" in error_of(body)


def test_a_stem_without_the_token_or_with_a_wrong_one_is_refused(song: tuple[Any, Any]) -> None:
    service, job = song
    for path in (
        f"/api/jobs/{job.id}/stems/vocals",
        f"/api/jobs/{job.id}/player",
        f"/api/jobs/{job.id}/preview",
    ):
        status, body, headers = call(service, path, token=NO_TOKEN, headers={"Range": "bytes=0-99"})
        assert status == 401 and "missing token" in error_of(body), path
        assert headers["WWW-Authenticate"].startswith("Bearer")
        status, body, _ = call(service, path, token="not-the-token")
        assert status == 401 and "wrong token" in error_of(body), path


def test_a_song_folder_outside_the_outbox_is_refused(song: tuple[Any, Any], tmp_path: Path) -> None:
    """The outbox was moved in the config since the song was separated, or the record points
    anywhere else: its files are not served, whatever the folder holds."""
    service, job = song
    elsewhere = tmp_path / "elsewhere" / "song"
    shutil.copytree(job.output, elsewhere)
    service.registry.update(job.id, output=str(elsewhere))
    status, body, _ = call(
        service, f"/api/jobs/{job.id}/stems/vocals", headers={"Range": "bytes=0-99"}
    )
    assert status == 403 and "outside the outbox" in error_of(body)
    status, body, _ = call(service, f"/api/jobs/{job.id}/player")
    assert status == 403 and "outside the outbox" in error_of(body)


def test_a_stem_or_song_folder_replaced_by_a_link_is_refused(
    song: tuple[Any, Any], tmp_path: Path
) -> None:
    """Someone who can write the shared outbox swaps in links to files of the user's: the
    player never reads through one, at any level."""
    service, job = song
    folder = Path(job.output)
    secret = tmp_path / "secret.wav"  # same size as the stem: the manifest's check passes
    shutil.copy(folder / "vocals.wav", secret)
    (folder / "vocals.wav").unlink()
    (folder / "vocals.wav").symlink_to(secret)
    status, body, _ = call(
        service, f"/api/jobs/{job.id}/stems/vocals", headers={"Range": "bytes=0-99"}
    )
    assert status == 403 and "through a link" in error_of(body)
    status, _, _ = call(service, f"/api/jobs/{job.id}/stems/drums", headers={"Range": "bytes=0-99"})
    assert status == 206  # the other stems are still this song's own files

    away = tmp_path / "away"
    shutil.move(str(folder), away)
    folder.symlink_to(away, target_is_directory=True)  # the folder itself is now a link
    status, body, _ = call(
        service, f"/api/jobs/{job.id}/stems/drums", headers={"Range": "bytes=0-99"}
    )
    assert status == 403 and "through a link" in error_of(body)


def test_an_unpublished_or_foreign_folder_is_refused(song: tuple[Any, Any]) -> None:
    service, job = song
    folder = Path(job.output)
    manifest = (folder / MANIFEST).read_text()
    data = json.loads(manifest)
    data["job_id"], data["input"]["sha256"] = "0123456789ab", "0" * 64  # another song's
    (folder / MANIFEST).write_text(json.dumps(data))
    status, body, _ = call(service, f"/api/jobs/{job.id}/stems/vocals")
    assert status == 403 and "another song's stems" in error_of(body)

    (folder / MANIFEST).unlink()  # not (or not completely) published
    status, body, _ = call(service, f"/api/jobs/{job.id}/stems/vocals")
    assert status == 409 and "not a complete published song folder" in error_of(body)
    (folder / MANIFEST).write_text(manifest)
    status, _, _ = call(service, f"/api/jobs/{job.id}/stems/vocals", headers={"Range": "bytes=0-1"})
    assert status == 206

    service.scheduler.pause()
    inbox = service.settings.paths.inbox
    write_song(inbox.parent / "queued.wav", 1.0, seed=9)
    os.replace(inbox.parent / "queued.wav", inbox / "queued.wav")
    queued = wait_for(
        lambda: service.registry.latest_for_source(str(inbox / "queued.wav")),
        20,
        "the song to be queued",
    )
    status, body, _ = call(service, f"/api/jobs/{queued.id}/stems/vocals")
    assert status == 409 and "no stems to play: it is queued" in error_of(body)
    status, body, _ = call(service, "/api/jobs/nosuchjob/stems/vocals")
    assert status == 404
