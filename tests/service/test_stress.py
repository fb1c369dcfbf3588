"""A randomised afternoon: about 40 songs while files are deleted and renamed and the queue is
cancelled, moved, paused and started from the CLI — checked throughout and at the end.

The seed is printed; a failure names it so the same afternoon can be replayed
(STEMDECK_STRESS_SEED=N). The chaos lasts 20 s in `make test` and a minute in `make soak`
(STEMDECK_STRESS_SECONDS=N).
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

from stemdeck_watch.cli.main import main
from stemdeck_watch.core.config import load_settings
from stemdeck_watch.core.events import JobChanged, QueueChanged
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.util.synth import write_song

from support.helpers import on_worker_side, outbox_entries, wait_for, write_config

pytestmark = pytest.mark.slow
SONGS = 40
CHAOS_SECONDS = float(os.environ.get("STEMDECK_STRESS_SECONDS") or 20.0)
MAX_PENDING = 8


class Invariants:
    """Checks every announced change as it happens (a job enters and leaves the worker side
    on the one dispatcher thread, which marks it publishing before it takes the next job, so
    the order of these events is the order of the changes)."""

    def __init__(self, service) -> None:  # type: ignore[no-untyped-def]
        self.service = service
        self.states: dict[str, JobState] = {}
        self.violations: list[str] = []
        self._lock = threading.Lock()
        service.bus.subscribe(JobChanged, self._job)
        service.bus.subscribe(QueueChanged, self._queue)

    def _job(self, event: JobChanged) -> None:
        with self._lock:
            previous = self.states.get(event.job.id)
            if previous is not None and previous.is_final and event.job.state is not previous:
                self.violations.append(
                    f"{event.job.id} left final state {previous.value} for {event.job.state.value}"
                )
            self.states[event.job.id] = event.job.state
            # one job publishes behind the next one's separation: at most one job on
            # the worker side and one publishing
            running = on_worker_side(self.states)
            if len(running) > 1:
                self.violations.append(f"two jobs running at once: {running}")
            publishing = [i for i, s in self.states.items() if s is JobState.PUBLISHING]
            if len(publishing) > 1:
                self.violations.append(f"two jobs publishing at once: {publishing}")

    def _queue(self, event: QueueChanged) -> None:
        if len(event.queued) > MAX_PENDING:
            with self._lock:
                self.violations.append(f"{len(event.queued)} queued, lane is {MAX_PENDING}")


def cli(config: Path, *args: str) -> int:
    return main([*args, "--config", str(config)])


def test_a_randomised_afternoon_never_loses_or_doubles_a_song(
    tmp_path, model_repo, capsys, service_factory
):
    seed = int(os.environ.get("STEMDECK_STRESS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"stress seed {seed}")
    config = write_config(tmp_path, model_repo, queue={"max_pending_files": MAX_PENDING})
    settings = load_settings(config)
    service, jobs = service_factory(settings)
    checks = Invariants(service)
    inbox, elsewhere = settings.paths.inbox, tmp_path / "elsewhere"
    elsewhere.mkdir()
    songs = [
        write_song(tmp_path / "made" / f"song{i:02}.wav", rng.uniform(1.2, 2.0), seed=i)
        for i in range(SONGS)
    ]
    taken_away: list[Path] = []
    actions: list[str] = []

    def in_inbox() -> list[Path]:
        return sorted(p for p in inbox.iterdir() if p.suffix == ".wav")

    def active_ids() -> list[str]:
        return [j.id for j in jobs.jobs() if not j.state.is_final]

    deadline = time.monotonic() + CHAOS_SECONDS
    pace = threading.Event()  # never set: a bounded wait between actions keeps the schedule
    while time.monotonic() < deadline:
        roll = rng.random()
        if songs and roll < 0.30:
            song = songs.pop()
            os.replace(song, inbox / song.name)
            actions.append(f"drop {song.name}")
        elif roll < 0.38 and in_inbox():
            victim = rng.choice(in_inbox())
            os.replace(victim, elsewhere / victim.name)
            taken_away.append(elsewhere / victim.name)
            actions.append(f"take away {victim.name}")
        elif roll < 0.46 and in_inbox():
            victim = rng.choice(in_inbox())
            os.replace(victim, victim.with_name("renamed-" + victim.name))
            actions.append(f"rename {victim.name}")
        elif roll < 0.62 and active_ids():
            actions.append(f"cancel → {cli(config, 'cancel', rng.choice(active_ids()))}")
        elif roll < 0.80 and len(service.queue.order()) >= 2:
            job, after = rng.sample(service.queue.order(), 2)
            args = (
                ("move", job, "--first") if rng.random() < 0.3 else ("move", job, "--after", after)
            )
            actions.append(f"move → {cli(config, *args)}")
        elif roll < 0.88:
            actions.append(f"pause → {cli(config, 'pause')}")
        else:
            actions.append(f"start → {cli(config, 'start')}")
        assert not checks.violations, (seed, checks.violations)
        pace.wait(rng.uniform(0.05, 0.6))
    assert cli(config, "start") == 0
    for song in songs:  # whatever was not dropped yet
        os.replace(song, inbox / song.name)

    # drained: every file in the inbox seen (the last ones were dropped a moment ago), nothing
    # queued, nothing waiting, nothing running, nothing left to admit
    def drained() -> bool:
        registry = service.scheduler.registry
        seen = all(registry.latest_for_source(str(path)) for path in in_inbox())
        settled = seen and not service.intake.tracker.pending()
        idle = not service.queue.order() and service.queue.running() is None
        return settled and idle and not service.scheduler.waiting() and not active_ids()

    wait_for(drained, 240, f"the queue to drain (seed {seed})")
    capsys.readouterr()
    assert not checks.violations, (seed, checks.violations)
    final = jobs.jobs()
    assert all(j.state.is_final for j in final), seed
    registry = service.scheduler.registry
    assert {j.id: j.state for j in registry.jobs()} == {j.id: j.state for j in final}, seed
    done = [j for j in final if j.state is JobState.DONE]
    # no outbox folder for a cancelled job: the outbox holds exactly the done jobs' folders
    assert outbox_entries(settings.paths.outbox) == {Path(j.output).name for j in done}, seed
    # none lost: every song is in the inbox (cancelled by request), processed/, or taken away
    # (the inbox's hidden .stemdeck/ folder holds the service's owner heartbeat)
    everywhere = [
        re.sub(r"^(renamed-)+", "", p.name)
        for folder in (inbox, settings.paths.processed, elsewhere)
        for p in folder.iterdir()
        if p.name != ".stemdeck"
    ]
    assert sorted(everywhere) == [f"song{i:02}.wav" for i in range(SONGS)], (seed, actions)
    assert not list(settings.paths.failed.iterdir()), seed
    # every file left in the inbox was cancelled by request (not forgotten)
    for path in in_inbox():
        latest = registry.latest_for_source(str(path))
        assert latest is not None and latest.state is JobState.CANCELLED, (seed, path, latest)
