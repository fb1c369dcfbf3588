"""Failed inputs go to failed/ with their report, never over another file."""

from __future__ import annotations

import os
import shutil

from stemdeck_watch.core.config import Settings
from stemdeck_watch.core.jobs import FileSignature, JobState
from stemdeck_watch.stages.quarantine import quarantine

from support.helpers import add_job, open_scheduler


def test_a_retried_file_that_fails_again_gets_a_fresh_report_beside_it(settings: Settings) -> None:
    scheduler = open_scheduler(settings)
    job = add_job(scheduler, settings, "song", JobState.SEPARATING)
    first = quarantine(job, settings.paths.failed, stage="decoding", message="first failure")
    assert first == settings.paths.failed / "song.wav"
    # the user moves it back into the inbox, as the report says, and it fails again
    shutil.move(first, job.source)
    again = add_job(scheduler, settings, "song2", JobState.SEPARATING)
    again = scheduler.registry.update(
        again.id,
        source=job.source,
        rel_path="song.wav",
        signature=FileSignature.of(os.stat(job.source)),
    )
    second = quarantine(again, settings.paths.failed, stage="decoding", message="second failure")
    assert second == settings.paths.failed / "song (2).wav"
    report = settings.paths.failed / "song (2).wav.error.txt"
    assert "second failure" in report.read_text()
    assert "first failure" in (settings.paths.failed / "song.wav.error.txt").read_text()
    scheduler.registry.close()
