"""Machine faults through the whole service with the real worker process (tiny model): a worker
that dies, stalls or runs out of memory under a song costs the song an attempt, not the song.

The faults come from the worker's fault seam (workers/faultseam.py): the real worker process
exits, SIGKILLs itself, hangs, or raises the exception torch raises, at a chosen segment of the song.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.cli.status import render
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.stages.publish import read_manifest
from stemdeck_watch.util.synth import write_song
from stemdeck_watch.workers.faultseam import FAULTS_ENV

from support.helpers import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fault seam's folder, handed to every worker the test's services start."""
    folder = tmp_path / "faults"
    folder.mkdir()
    monkeypatch.setenv(FAULTS_ENV, str(folder))
    return folder


def arm(folder: Path, *kinds: str, segment: int = 2) -> None:
    for n, kind in enumerate(kinds, 1):
        (folder / f"{n}-{kind}").write_text(str(segment))


def drop(settings: Any, name: str, seconds: float = 5.0) -> Path:
    staged = write_song(settings.paths.inbox.parent / "staging" / name, seconds, seed=3)
    return staged.rename(settings.paths.inbox / name)


def test_a_worker_that_dies_mid_song_costs_an_attempt_not_the_song(
        make_settings: Any, service_factory: Any, faults: Path) -> None:
    """The worker process exits in the middle of a song (a crash in a native library): the
    song goes back to the head of the queue, a new worker separates it, nothing goes to
    failed/; the job, `status` and the manifest show the attempt the machine cut off."""
    settings = make_settings()
    service, jobs = service_factory(settings)
    arm(faults, "exit")
    seen: list[str] = []
    drop(settings, "song.wav")

    def attempt_shown() -> bool:  # while the second attempt is queued or running
        text = render(service.scheduler.snapshot())
        if "(attempt 2:" in text:
            seen.append(text)
        return bool(jobs.final())

    wait_for(attempt_shown, 120, "the song to finish")
    [job] = jobs.final()
    assert job.state is JobState.DONE, job.error
    assert not list(faults.iterdir()), "the fault did not fire"
    assert list(settings.paths.failed.iterdir()) == []
    [fault] = job.faults
    assert fault.kind == "died" and "exit code 70" in fault.reason
    assert "the local worker (pid" in fault.worker
    assert len(service.client.pids) == 2  # the dead worker was replaced
    manifest = read_manifest(Path(job.output or ""))
    assert manifest is not None and manifest["attempts"] == 2
    assert [f["kind"] for f in manifest["faults"]] == ["died"]
    status = service.scheduler.snapshot()
    [shown] = [j for j in status["jobs"] if j["id"] == job.id]
    assert [f["reason"] for f in shown["faults"]] == [fault.reason]
    assert seen and "stopped unexpectedly" in seen[0], "status never showed attempt 2"


def test_the_same_fault_twice_fails_the_song_with_both_reasons(
        make_settings: Any, service_factory: Any, faults: Path) -> None:
    """With one attempt after a machine fault, a worker that dies under the song twice fails
    it: error.txt names both attempts, their workers and reasons."""
    settings = make_settings(queue={"worker_retries": 1})
    service, jobs = service_factory(settings)
    arm(faults, "exit", "exit")
    drop(settings, "song.wav")
    [job] = jobs.wait_final(1, 120)
    assert job.state is JobState.FAILED
    assert "both 2 attempts" in (job.error or "") and job.error.count("stopped unexpectedly") == 2
    assert [f.kind for f in job.faults] == ["died", "died"]
    report = (settings.paths.failed / "song.wav.error.txt").read_text()
    assert "attempt 1, " in report and "attempt 2, " in report
    assert report.count("exit code 70") >= 2
    recorded = service.scheduler.registry.get(job.id)
    assert recorded is not None and len(recorded.faults) == 2
    assert json.loads(json.dumps(recorded.to_status()))["faults"][1]["kind"] == "died"


def test_a_stalled_worker_is_stopped_after_the_stall_time_and_the_song_tried_again(
        make_settings: Any, service_factory: Any, faults: Path) -> None:
    """A worker that stops reporting progress mid-song (it hangs) is stopped once it has been
    silent for `separation.stall_seconds`; the song is done on the next attempt."""
    settings = make_settings(separation={"stall_seconds": 3.0})
    service, jobs = service_factory(settings)
    arm(faults, "stall")
    drop(settings, "song.wav")
    [job] = jobs.wait_final(1, 120)
    assert job.state is JobState.DONE, job.error
    [fault] = job.faults
    assert fault.kind == "stalled" and "reported no progress for" in fault.reason
    assert "the stall limit is 3 s" in fault.reason
    assert len(service.client.pids) == 2 and list(settings.paths.failed.iterdir()) == []
