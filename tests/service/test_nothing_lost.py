"""Nothing lost: orphans adopted, removed songs stay removed, duplicates skipped, a damaged
registry rebuilt, and a state folder on a network filesystem refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stemdeck_watch import service as service_module
from stemdeck_watch.cli.main import main
from stemdeck_watch.core.config import load_settings
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.core.jobs import JobState
from stemdeck_watch.store.registry import REGISTRY_FILE
from stemdeck_watch.service import Service
from stemdeck_watch.util.synth import write_song

from support.helpers import outbox_entries, wait_for, write_config

pytestmark = pytest.mark.slow


def cli(config: Path, capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*args, "--config", str(config)])
    out, err = capsys.readouterr()
    return code, out + err


def separate_one(service_factory, settings, name: str = "song.wav", seed: int = 0):
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / name, 1.5, seed=seed)
    job = jobs.wait_final(1)[0]
    assert job.state is JobState.DONE, job.error
    return service, jobs, job


def test_a_lost_registry_is_rebuilt_from_the_outbox_and_songs_are_not_separated_again(
    tmp_path, model_repo, service_factory, capsys
):
    config = write_config(tmp_path, model_repo)
    settings = load_settings(config)
    service, _, job = separate_one(service_factory, settings)
    service.shutdown()
    registry = settings.paths.state / REGISTRY_FILE
    registry.write_bytes(b"garbage after a disk error " * 500)  # damaged
    for suffix in ("-wal", "-shm"):
        Path(str(registry) + suffix).unlink(missing_ok=True)

    service, jobs = service_factory(settings)
    adopted = service.registry.get(job.id)
    assert adopted is not None and adopted.state is JobState.DONE
    assert adopted.output == job.output and adopted.sha256
    assert [p.name for p in settings.paths.state.glob("registry.sqlite3.damaged-*")]
    # the same song dropped again is a duplicate of the adopted one: not separated again
    write_song(settings.paths.inbox / "again.wav", 1.5, seed=0)
    again = wait_for(lambda: [j for j in jobs.final() if j.name == "again"], 60, "again")[0]
    assert again.state is JobState.DONE and again.output == job.output
    assert "already separated" in again.error
    assert outbox_entries(settings.paths.outbox) == {"song"}
    assert (settings.paths.processed / "again.wav").is_file()
    code, out = cli(config, capsys, "status")
    assert code == 0 and "damaged and rebuilt" in out


def test_a_removed_song_never_comes_back(tmp_path, model_repo, service_factory, capsys):
    config = write_config(tmp_path, model_repo, queue={"on_duplicate": "separate"})
    settings = load_settings(config)
    service, jobs, job = separate_one(service_factory, settings)
    code, out = cli(config, capsys, "remove", job.id)
    assert code == 0 and "removed song" in out
    assert not Path(job.output).exists() and service.registry.get(job.id) is None
    code, out = cli(config, capsys, "remove", job.id)
    assert code == 1 and "no job" in out
    service.shutdown()
    # restart: neither orphan adoption nor a rescan brings it back
    service, jobs = service_factory(settings)
    assert service.registry.jobs() == []
    # a manifest copied back by hand (a sync client restoring it) stays ignored as well
    assert outbox_entries(settings.paths.outbox) == set()


def test_cancelled_then_removed_input_is_not_queued_by_a_rescan(
    tmp_path, model_repo, service_factory, capsys
):
    config = write_config(tmp_path, model_repo)
    settings = load_settings(config)
    service, jobs = service_factory(settings)
    service.scheduler.pause("user")
    song = write_song(settings.paths.inbox / "keep.wav", 1.5)
    job_id = wait_for(lambda: service.queue.order(), 30, "queued")[0]
    assert cli(config, capsys, "cancel", job_id)[0] == 0
    assert cli(config, capsys, "remove", job_id)[0] == 0
    service.intake.scan(settings.paths.inbox)
    service.scheduler.start()
    wait_for(lambda: not service.intake.tracker.pending(), 10, "the rescan to settle")
    assert service.registry.jobs() == [] and service.queue.order() == []
    os.utime(song, ns=(1, 1))  # its content changed: a new request
    wait_for(lambda: [j for j in jobs.final() if j.state is JobState.DONE], 60, "requeued")


def test_duplicates_are_separated_again_when_asked(make_settings, service_factory):
    settings = make_settings(queue={"on_duplicate": "separate"})
    service, jobs = service_factory(settings)
    write_song(settings.paths.inbox / "one.wav", 1.5, seed=3)
    jobs.wait_final(1)
    write_song(settings.paths.inbox / "two.wav", 1.5, seed=3)  # same content
    done = jobs.wait_final(2)
    assert all(j.state is JobState.DONE for j in done)
    assert outbox_entries(settings.paths.outbox) == {"one", "two"}


def test_orphan_folders_are_adopted_and_damaged_ones_left_alone(make_settings, service_factory):
    settings = make_settings()
    outbox = settings.paths.outbox
    good = outbox / "Album" / "kept"
    good.mkdir(parents=True)
    (good / "vocals.wav").write_bytes(b"x")
    (good / "stemdeck.json").write_text(
        json.dumps(
            {
                "job_id": "0123456789ab",
                "input": {"rel_path": "Album/kept.wav", "sha256": "ab"},
                "stems": [{"file": "vocals.wav"}],
                "settings": {"separation": {}},
            }
        )
    )
    damaged = outbox / "damaged"
    damaged.mkdir()
    (damaged / "stemdeck.json").write_text("{ cut off")
    service, _ = service_factory(settings)
    jobs = service.registry.jobs()
    assert [(j.id, j.state, j.output) for j in jobs] == [("0123456789ab", JobState.DONE, str(good))]
    assert damaged.is_dir()  # left alone


def test_a_state_folder_on_a_network_filesystem_is_refused(make_settings, monkeypatch):
    settings = make_settings()
    # no cifs/nfs mount can be made here: the filesystem type is what the check reads
    monkeypatch.setattr(service_module, "is_network_filesystem", lambda path: True)
    monkeypatch.setattr(service_module, "filesystem_type", lambda path: "cifs")
    with pytest.raises(ConfigError, match="network filesystem .cifs.*choose a local folder"):
        Service(settings).start()


def test_removing_a_job_a_retry_replaced_leaves_no_tombstone_over_the_retry(
    make_settings, service_factory
):
    """A cancelled song retried (a new job for the same file), and then the old row
    removed from the list: the file belongs to the retry, so no tombstone is left over its
    version (one would keep the song out once the retry's row went too); the retry runs."""
    settings = make_settings()
    service, jobs = service_factory(settings)
    service.scheduler.pause("user")
    song = write_song(settings.paths.inbox / "again.wav", 1.5)
    old = wait_for(lambda: service.queue.order(), 30, "queued")[0]
    service.scheduler.cancel_job(old)
    new = service.scheduler.retry(old)
    assert new is not None and service.queue.order() == [new.id]
    service.scheduler.remove(old)
    assert service.registry.tombstone(str(song), "input") is False
    service.scheduler.start()
    done = wait_for(lambda: [j for j in jobs.final() if j.id == new.id], 60, "the retry")
    assert done[0].state is JobState.DONE, done[0].error
