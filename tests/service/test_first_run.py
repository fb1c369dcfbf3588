"""A first run: `separation.model = "htdemucs"` with nothing cached. The real service's worker
downloads the model from a loopback mirror of the hub (the tiny model in the hub's layout),
and while it does, `status`, the API (the page's object) and the tray say so; the song dropped
meanwhile waits for the model and is then separated with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stemdeck_watch.cli.status import collect, render
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.ui.web.client import Client
from stemdeck_watch.ui.desktop.tray import build_view
from stemdeck_watch.util.synth import write_song

from support import browser as chrome
from support.helpers import wait_for
from support.modelhub import ModelHub, build_mirror

pytestmark = pytest.mark.slow
HOLD = 200_000


def test_a_first_run_shows_the_model_arriving_then_separates_with_it(
    make_settings,
    service_factory,
    tmp_path: Path,
    model_repo: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served = build_mirror(tmp_path / "mirror", model_repo / "tiny.th")
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # the worker inherits them
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with ModelHub(tmp_path / "mirror") as hub:
        hub.hold_at = HOLD
        settings = make_settings(
            separation={"model": "htdemucs", "model_repo": "", "model_hub": hub.url}
        )
        service, jobs = service_factory(settings)
        wait_for(hub.held.is_set, 120, "the worker's download to reach the held byte")
        said = "downloading htdemucs 0.2 / 0.5 MB"
        wait_for(
            lambda: (collect(settings)["download"] or {}).get("text") == said,
            30,
            lambda: f"status to say {said!r}, not {collect(settings)['download']!r}",
        )
        assert f"model:   {said}" in render(collect(settings)).splitlines()
        page = Client.connect(settings.paths.state).get("/api/queue")  # what the page shows
        assert page["download"] == {
            "model": "htdemucs",
            "done": HOLD,
            "total": served.stat().st_size,
            "text": said,
        }
        assert said in build_view(service.scheduler.snapshot(), None).title  # the tray
        with chrome.chromium(tmp_path / "chromium") as driver:  # the page, in a real browser
            driver.get(service.api.page_url())
            shown = (
                "return [document.getElementById('download').textContent, "
                "document.getElementById('download').hidden]"
            )
            wait_for(
                lambda: driver.execute_script(shown) == [said, False],
                30,
                lambda: f"the page to say {said!r}: {driver.execute_script(shown)}",
            )
            assert not chrome.page_errors(driver)
        write_song(settings.paths.inbox / "song.wav", 2.0)
        wait_for(lambda: jobs.jobs(), 30, "the dropped song to become a job")
        assert not list(cache.glob("*.th"))  # half a model is never a model file
        assert not list(settings.paths.outbox.glob("song*"))

        hub.release()
        [job] = jobs.wait_final(1)
        assert job.state is JobState.DONE, job.error
        assert (Path(job.output or "") / "vocals.wav").is_file()
    assert [p.name for p in cache.glob("*.th")] == [served.name]
    assert (cache / served.name).read_bytes() == served.read_bytes()
    assert not list(cache.glob(".*.partial"))
    assert collect(settings)["download"] is None
    assert service.scheduler.snapshot()["download"] is None


def test_a_download_the_mirror_damages_fails_the_song_and_leaves_no_model_file(
    make_settings,
    service_factory,
    tmp_path: Path,
    model_repo: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    build_mirror(tmp_path / "mirror", model_repo / "tiny.th")
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with ModelHub(tmp_path / "mirror") as hub:
        hub.damaged = True
        settings = make_settings(
            separation={"model": "htdemucs", "model_repo": "", "model_hub": hub.url}
        )
        service, jobs = service_factory(settings)
        write_song(settings.paths.inbox / "song.wav", 2.0)
        [job] = jobs.wait_final(1)
    assert job.state is JobState.FAILED
    assert "could not download model 'htdemucs'" in (job.error or "")
    assert "is not the file its name promises" in (job.error or "")
    assert "stemdeck-watch models pull htdemucs" in (job.error or "")
    assert not list(cache.glob("*.th")) and not list(cache.glob(".*.partial"))
    assert collect(settings)["download"] is None
