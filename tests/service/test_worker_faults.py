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
from stemdeck_watch.stages.manifest import read_manifest
from stemdeck_watch.util.synth import write_song
from stemdeck_watch.workers.worker import WINDOW_ENV

from support.helpers import wait_for

pytestmark = pytest.mark.slow


def arm(folder: Path, *kinds: str, segment: int = 2) -> None:
    for n, kind in enumerate(kinds, 1):
        (folder / f"{n}-{kind}").write_text(str(segment))


def drop(settings: Any, name: str, seconds: float = 5.0) -> Path:
    staged = write_song(settings.paths.inbox.parent / "staging" / name, seconds, seed=3)
    return staged.rename(settings.paths.inbox / name)


def test_a_worker_that_dies_mid_song_costs_an_attempt_not_the_song(
    make_settings: Any, service_factory: Any, faults: Path
) -> None:
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
    make_settings: Any, service_factory: Any, faults: Path
) -> None:
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


def test_a_fault_under_a_songs_own_choices_names_them_in_its_report(
    make_settings: Any, service_factory: Any, faults: Path
) -> None:
    """The worker dies under a song whose sidecar chose how it separates: its report names
    that choice as a possible cause, not "never because of the song"."""
    settings = make_settings(queue={"worker_retries": 0})
    service, jobs = service_factory(settings)
    arm(faults, "exit")
    (settings.paths.inbox / "song.wav.stemdeck.toml").write_text("shifts = 2\n")
    drop(settings, "song.wav")
    [job] = jobs.wait_final(1, 120)
    assert job.state is JobState.FAILED
    chosen = "shifts = 2 by the sidecar song.wav.stemdeck.toml"
    assert f"with the song's own choices ({chosen}), which may have caused it" in job.error
    report = (settings.paths.failed / "song.wav.error.txt").read_text()
    assert chosen in report and "never because of the song" not in report


def test_a_stalled_worker_is_stopped_after_the_stall_time_and_the_song_tried_again(
    make_settings: Any, service_factory: Any, faults: Path
) -> None:
    """A worker that stops reporting progress mid-song (it hangs) is stopped once it has been
    silent for `separation.stall_seconds`; the song is done on the next attempt."""
    # long enough for a fresh worker's first segment on a busy machine, short for a test
    settings = make_settings(separation={"stall_seconds": 8.0})
    service, jobs = service_factory(settings)
    arm(faults, "stall")
    drop(settings, "song.wav")
    [job] = jobs.wait_final(1, 120)
    assert job.state is JobState.DONE, job.error
    [fault] = job.faults
    assert fault.kind == "stalled" and "reported no progress for" in fault.reason
    assert "the stall limit is 8 s" in fault.reason
    assert len(service.client.pids) == 2 and list(settings.paths.failed.iterdir()) == []


def test_out_of_gpu_memory_twice_goes_smaller_then_to_the_cpu(
    make_settings: Any, service_factory: Any, faults: Path
) -> None:
    """The worker raises the errors torch raises when MPS, then CUDA, run out of memory: the
    second attempt separates with half the window and segment, the third on the CPU
    (separation.fallback_device, a worker started there); the manifest records each step."""
    settings = make_settings(separation={"device": "auto", "fallback_device": "cpu"})
    service, jobs = service_factory(settings)
    arm(faults, "oom-mps", "oom-cuda", segment=1)
    drop(settings, "song.wav")
    [job] = jobs.wait_final(1, 120)
    assert job.state is JobState.DONE, job.error
    assert [(f.kind, f.device) for f in job.faults] == [("memory", "mps"), ("memory", "cuda")]
    assert "MPS backend out of memory" in job.faults[0].reason
    assert "OutOfMemoryError: CUDA out of memory" in job.faults[1].reason
    assert job.faults[0].plan == "" and job.faults[1].plan == "window and segment halved"
    manifest = read_manifest(Path(job.output or ""))
    assert manifest is not None and manifest["attempts"] == 3
    plan = manifest["memory_plan"]
    assert plan["device"] == "cpu" and plan["shrink"] == 1, plan
    assert plan["segment"] == 2.0 and plan["window"] == 15.0  # the tiny model's 4 s, 30 s
    assert manifest["settings"]["separation"]["device"] == "auto"  # as configured
    client = service.client
    assert len(client.pids) == 2 and client.info()["device"] == "cpu"  # the fallback worker


def test_a_real_memory_limit_on_the_worker_is_met_with_a_smaller_window(
    make_settings: Any, service_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker process under a real memory limit (RLIMIT_AS, set on the running worker as
    `prlimit` would): separating a minute in one window needs more than the limit allows,
    so torch's allocator fails; the same worker separates it again with a smaller window."""
    resource = pytest.importorskip("resource")
    monkeypatch.setenv(WINDOW_ENV, "60")  # one window for the whole song: the most memory
    settings = make_settings(separation={"threads": 1})
    service, jobs = service_factory(settings)
    client = service.client
    wait_for(lambda: client.model_info, 120, "the worker to load the model")
    pid = client.pid
    size = (
        int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmSize:")
            )
        )
        * 1024
    )
    # a minute in one window takes ~330 MB more, in two windows of 30 s ~170 MB
    # (measured on Linux, x86-64, torch 2.13 and the tiny model)
    limit = size + (250 << 20)
    resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))
    drop(settings, "long.wav", seconds=60.0)
    [job] = jobs.wait_final(1, 240)
    assert job.state is JobState.DONE, job.error
    # halved once (a heap left fragmented by the failed attempt may need it halved twice)
    assert 1 <= len(job.faults) <= 2, job.faults
    for fault in job.faults:
        assert fault.kind == "memory" and fault.device == "cpu", fault
        assert "can't allocate memory" in fault.reason or "MemoryError" in fault.reason
    assert client.pids == [pid]  # the same worker, still under its limit
    manifest = read_manifest(Path(job.output or ""))
    assert manifest is not None
    assert manifest["memory_plan"]["window"] == 60.0 / 2 ** len(job.faults)


def test_an_attempt_after_a_fault_reads_a_sidecar_dropped_while_the_first_one_ran(
    make_settings: Any, service_factory: Any, faults: Path
) -> None:
    """A sidecar written while the first attempt runs is not that attempt's; when the
    machine cuts the attempt off (here a stall), the song starts over and takes the sidecar
    there then: the manifest names it and its choice holds, and it moves with the song."""
    settings = make_settings(separation={"stall_seconds": 8.0})
    service, jobs = service_factory(settings)
    arm(faults, "stall")
    drop(settings, "song.wav")
    wait_for(
        lambda: any(j.state is JobState.SEPARATING for j in service.scheduler.registry.jobs()),
        60,
        "the first attempt to separate",
    )
    sidecar = settings.paths.inbox / "song.wav.stemdeck.toml"
    sidecar.write_text('format = "flac"\n')
    [job] = jobs.wait_final(1, 120)
    assert job.state is JobState.DONE, job.error
    assert [f.kind for f in job.faults] == ["stalled"]
    folder = Path(job.output or "")
    manifest = read_manifest(folder)
    assert manifest["sidecar"]["file"] == sidecar.name, manifest["sidecar"]
    assert sorted(p.suffix for p in folder.iterdir() if p.stem == "vocals") == [".flac"]
    assert (settings.paths.processed / sidecar.name).is_file() and not sidecar.exists()
