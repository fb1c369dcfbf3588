"""A music library dropped at once: every file accounted for (queued or waiting), on disk too,
in native and polling mode. Sized to stay fast; the 10,000-file figure is a benchmark."""

from __future__ import annotations

import os

import pytest

from stemdeck_watch.store.registry import REGISTRY_FILE, Registry

from support.helpers import wait_for

pytestmark = pytest.mark.slow
FILES = 1000


@pytest.mark.parametrize("mode", ["native", "polling"])
def test_a_thousand_files_dropped_at_once_are_all_accounted_for(
    make_settings, service_factory, tmp_path, mode
):
    settings = make_settings(watch={"mode": mode, "poll_interval": 0.5}, api={"enabled": False})
    service, _ = service_factory(settings)
    service.scheduler.pause("user")
    stage = tmp_path / "library"
    stage.mkdir()
    for i in range(FILES):
        (stage / f"song{i:04}.wav").write_bytes(b"RIFF" + os.urandom(32))
    for i in range(FILES):
        os.rename(stage / f"song{i:04}.wav", settings.paths.inbox / f"song{i:04}.wav")

    def accounted() -> int:
        return len(service.queue.order()) + len(service.scheduler.waiting())

    wait_for(lambda: accounted() == FILES, 60, f"{FILES} files accounted for ({mode})")
    lane = settings.queue.max_pending_files
    assert len(service.queue.order()) == lane
    # the waiting lane is on disk, in arrival order, without one rewrite per file
    registry = Registry.open_readonly(settings.paths.state / REGISTRY_FILE)
    try:
        wait_for(lambda: len(registry.waiting()) == FILES - lane, 10, "waiting rows written")
    finally:
        registry.close()
