"""Every wait of a model download has a deadline, against a loopback hub that misbehaves:
a server that sends a byte now and then, and another process's download that stopped."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from stemdeck_watch.workers import download

from support.helpers import wait_for
from support.modelhub import ModelHub, build_mirror

HOLD = 200_000


@pytest.fixture
def mirror(tmp_path: Path, model_repo: Path) -> Path:
    return build_mirror(tmp_path / "mirror", model_repo / "tiny.th")


@pytest.fixture
def hub(mirror: Path, tmp_path: Path) -> Iterator[ModelHub]:
    with ModelHub(tmp_path / "mirror") as hub:
        yield hub


def url_of(hub: ModelHub, mirror: Path) -> str:
    return hub.url + f"{mirror.parent.name}/{mirror.name}"


def test_a_server_that_trickles_bytes_is_cut_off_and_the_bytes_are_kept(
    hub: ModelHub, mirror: Path, tmp_path: Path
) -> None:
    """One byte every 0.05 s never trips a socket's timeout of 0.5 s; the rate does."""
    hub.trickle = 0.05
    dest = tmp_path / "cache" / mirror.name
    started = time.monotonic()
    with pytest.raises(download.Interrupted, match="bytes a second"):
        download.fetch(url_of(hub, mirror), dest, timeout=0.5)
    assert time.monotonic() - started < 15
    assert not dest.exists() and 0 < download.partial_bytes(dest) < 1000  # kept: it resumes


def test_waiting_for_another_processs_download_that_stopped_gives_up(
    hub: ModelHub, mirror: Path, tmp_path: Path
) -> None:
    """The first download holds the lock at a byte (a stopped worker); the second waits
    for it only while it grows."""
    hub.hold_at = HOLD
    dest = tmp_path / "cache" / mirror.name
    first: list[Path] = []
    holder = threading.Thread(
        target=lambda: first.append(download.fetch(url_of(hub, mirror), dest, timeout=60))
    )
    holder.start()
    try:
        wait_for(hub.held.is_set, 30, "the first download to reach the held byte")
        wait_for(lambda: download.partial_bytes(dest) == HOLD, 30, "the held byte on disk")
        started = time.monotonic()
        with pytest.raises(download.DownloadError, match="without a new byte"):
            download.fetch(url_of(hub, mirror), dest, timeout=0.3)
        assert time.monotonic() - started < 10
    finally:
        hub.release()
        holder.join(timeout=60)
    assert first == [dest] and dest.read_bytes() == mirror.read_bytes()
