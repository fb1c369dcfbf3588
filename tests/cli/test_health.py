"""`health`: 0 while the service runs and its queue moves, 1 when it is not running, its API
does not answer, or a song sits in a running state without a change past the limit — what a
container's health check runs. The service here is its lock (held by this process) and a
registry as a running service leaves it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest

from stemdeck_watch.cli import main as cli
from stemdeck_watch.cli.health import problems
from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.errors import StemdeckError
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.core.lock import ServiceLock
from stemdeck_watch.engine.scheduler import Scheduler
from stemdeck_watch.store.snapshot import WORKERS_META

from support.helpers import add_job, open_scheduler


@pytest.fixture
def running(settings: Settings) -> Iterator[Scheduler]:
    """The service's lock held and its registry open: a running service, as `health` sees it."""
    lock = ServiceLock.acquire(settings.paths.state)
    scheduler = open_scheduler(settings)
    try:
        yield scheduler
    finally:
        scheduler.registry.close()
        lock.release()


def answers(settings: Settings) -> None:
    """The API answering (the real one is asked over loopback by `health`)."""


def later(seconds: float) -> float:
    return time.time() + seconds


def test_a_stopped_service_is_unhealthy_with_exit_1(settings: Settings, tmp_path: Path, capsys):
    config = tmp_path / "stemdeck.toml"
    import tomli_w

    config.write_text(tomli_w.dumps({"folders": {"state": str(settings.paths.state)}}))
    assert cli.main(["--config", str(config), "health"]) == 1
    assert "the service is not running" in capsys.readouterr().err


def test_a_running_service_whose_songs_move_is_healthy(settings, running):
    add_job(running, settings, "moving", JobState.SEPARATING)
    assert problems(settings, stall=600, now=lambda: later(60), ask_api=answers) == []


def test_a_song_without_a_change_past_the_limit_is_a_stuck_queue(settings, running):
    add_job(running, settings, "stuck song", JobState.SEPARATING)
    found = problems(settings, stall=600, now=lambda: later(700), ask_api=answers)
    assert len(found) == 1
    assert "stuck song" in found[0] and "separating" in found[0] and "stuck" in found[0]


def test_waits_the_service_knows_about_are_not_stuck(settings, running):
    """A model downloading (the song waits for it) and an outbox share that is away (the
    song's stems wait in scratch) are waits with their own progress and their own end."""
    add_job(running, settings, "waiting", JobState.SEPARATING)
    running.registry.set_meta(WORKERS_META, json.dumps([{"download": {"model": "htdemucs"}}]))
    assert problems(settings, stall=600, now=lambda: later(700), ask_api=answers) == []
    running.registry.set_meta(WORKERS_META, json.dumps([{"download": None}]))
    running.registry.set_meta("pause_reason", "outbox")
    assert problems(settings, stall=600, now=lambda: later(700), ask_api=answers) == []
    running.registry.set_meta("pause_reason", None)
    assert len(problems(settings, stall=600, now=lambda: later(700), ask_api=answers)) == 1


def test_a_service_whose_api_does_not_answer_is_unhealthy(settings, running):
    def hangs(_settings: Settings) -> None:
        raise StemdeckError("the service at http://127.0.0.1:1/ did not answer: timed out")

    found = problems(settings, stall=600, ask_api=hangs)
    assert len(found) == 1 and "does not answer" in found[0] and "timed out" in found[0]


def test_the_real_question_to_the_api_is_asked_and_its_failure_said(settings, running):
    """No seam: `health` asks the service's own API, here one that never published its
    address, and says so rather than failing on its way there."""
    found = problems(settings, stall=600)
    assert len(found) == 1 and "does not answer" in found[0], found
