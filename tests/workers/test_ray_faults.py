"""Machines failing and coming and going under the Ray executor, on a real private cluster
(tests/support/ray_cluster.py: two nodes of one CPU, a third added and removed here), tiny
model: a cancel on a slow worker waits for its cooperative stop, `workers = "auto"` puts a
machine that joins to work without a restart, and a machine that leaves mid-song costs the
song an attempt, not the song.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

if os.environ.get("CI") == "true":  # .ci/run installs the extra: nothing may skip there
    import ray
else:
    ray = pytest.importorskip(
        "ray", reason="the ray extra is not installed (pip install 'stemdeck-watch[ray]')"
    )

from stemdeck_watch.core.errors import Cancelled, WorkerStalled  # noqa: E402
from stemdeck_watch.core.jobs import JobState  # noqa: E402
from stemdeck_watch.stages.scratch import AudioWriter  # noqa: E402
from stemdeck_watch.store.jobqueue import JobControl  # noqa: E402
from stemdeck_watch.util.synth import write_song  # noqa: E402
from stemdeck_watch.workers.faultseam import FAULTS_ENV  # noqa: E402
from stemdeck_watch.workers.pace import GRACE_UNMEASURED  # noqa: E402
from stemdeck_watch.workers.ray.client import RayWorkerClient  # noqa: E402
from stemdeck_watch.workers.worker import ONEDNN_ENV  # noqa: E402

from support.helpers import wait_for  # noqa: E402
from support.ray_cluster import two_node_cluster  # noqa: E402

pytestmark = pytest.mark.slow

SLOW = 6.0  # seconds each segment takes on the slow worker: more than an unmeasured grace


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with two_node_cluster() as made:
        yield made


def noise(path: Path, seconds: float) -> Path:
    audio = np.random.default_rng(0).standard_normal((2, int(seconds * 44100))) * 0.1
    with AudioWriter(path, 2) as writer:
        writer.write(audio.astype(np.float32))
    return path


def test_a_cancel_on_a_slow_worker_waits_for_its_stop_instead_of_killing_it(
    cluster: Any, model_repo: Path, tmp_path: Path
) -> None:
    """A worker whose segments take SLOW seconds (a full-size model on a CPU): once a song
    measured its pace, a cancel waits the segment out and the worker stops on its own — its
    process and model stay — where a fixed grace shorter than a segment would kill it."""
    assert SLOW > GRACE_UNMEASURED
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "slow").write_text(str(SLOW))
    worker = RayWorkerClient("cpu", index=7, env={FAULTS_ENV: str(faults), ONEDNN_ENV: "0"})
    try:
        worker.ensure_model("tiny", str(model_repo), precision="float32")

        def run(
            job: str,
            seconds: float,
            control: JobControl,
            progress: Callable[[float], None] = lambda _v: None,
        ) -> Any:
            return worker.separate(
                job,
                "tiny",
                str(model_repo),
                noise(tmp_path / f"{job}.npy", seconds),
                tmp_path / job,
                control=control,
                on_progress=progress,
                window=4.0,
                precision="float32",
            )

        run("measured", 5.0, JobControl("measured"))  # two segments of SLOW seconds
        assert worker.pace().segment_seconds is not None
        assert worker.pace().segment_seconds >= SLOW
        assert worker.pace().cancel_grace() > SLOW
        pid = worker.pid
        control = JobControl("doomed")

        def cancel(_value: float) -> None:
            if not control.cancelled:
                threading.Thread(target=control.cancel, args=("user",)).start()

        with pytest.raises(Cancelled):
            run("doomed", 40.0, control, cancel)
        assert worker.pid == pid and worker.model_info is not None  # stopped, not killed
        assert ray.get(worker.actor.stats.remote())["running"] is None
    finally:
        worker.close()


def test_auto_workers_follow_machines_joining_and_leaving(
    cluster: Any, make_settings: Any, service_factory: Any
) -> None:
    """`executor.workers = "auto"`: one worker per machine of one CPU. A machine added while
    songs wait gets a worker without a restart, and songs run on it; removing it while it
    separates a song sends that song back to the queue — it is done on another machine,
    nothing in failed/ — and `status` lists the workers as they come and go."""
    settings = make_settings(executor={"kind": "ray", "address": "auto", "workers": "auto"})
    service, jobs = service_factory(settings)
    scheduler = service.scheduler
    wait_for(
        lambda: all(c.model_info for c in service.executor.clients),
        120,
        "both workers to load the model",
    )
    assert len(service.executor.clients) == 2
    scheduler.pause()
    for i in range(3):
        drop(settings, f"s{i}.wav", 6.0, seed=i)
    wait_for(lambda: len(scheduler.queue.order()) == 3, 30, "the songs to be queued")
    added = cluster.add_node(num_cpus=1)
    new = wait_for(
        lambda: next(
            (c for c in service.executor.clients if c.node == added.node_id and c.model_info), None
        ),
        120,
        "a worker on the machine that joined",
    )
    assert len(service.scheduler.snapshot()["workers"]) == 3
    scheduler.start()
    first = jobs.wait_final(3, 240)
    assert [j.state for j in first] == [JobState.DONE] * 3, [(j.name, j.error) for j in first]
    assert new.nodes == [added.node_id], new.nodes  # one of the songs ran on it

    scheduler.pause()
    for i in range(3):
        drop(settings, f"long{i}.wav", 40.0, seed=10 + i)
    wait_for(lambda: len(scheduler.queue.order()) == 3, 30, "the long songs to be queued")
    scheduler.start()
    victim = wait_for(
        lambda: next(
            (
                j
                for j in jobs.jobs()
                if j.id == new.current and j.state is JobState.SEPARATING and j.progress > 0.2
            ),
            None,
        ),
        120,
        "a song separating on the added machine",
    )
    cluster.remove_node(added)
    done = jobs.wait_final(6, 300)
    assert [j.state for j in done] == [JobState.DONE] * 6, [(j.name, j.error) for j in done]
    assert list(settings.paths.failed.iterdir()) == []
    [again] = [j for j in done if j.id == victim.id]
    [fault] = again.faults
    assert fault.kind == "died" and fault.worker.startswith(f"ray worker {new.index}"), fault
    wait_for(
        lambda: len(service.scheduler.snapshot()["workers"]) == 2,
        60,
        "status to list two workers again",
    )
    assert new not in service.executor.clients


def drop(settings: Any, name: str, seconds: float, seed: int = 0) -> Path:
    staged = write_song(settings.paths.inbox.parent / "staging" / name, seconds, seed=seed)
    return staged.rename(settings.paths.inbox / name)


def test_a_stalled_ray_worker_is_killed_at_the_stall_limit_and_its_actor_restarted(
    cluster: Any, model_repo: Path, tmp_path: Path
) -> None:
    """An actor that stops reporting progress mid-song (a stuck driver) is killed once it
    has been silent for the stall limit: the request ends as a machine fault naming the
    machine and the limit, and the next song gets the restarted actor."""
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "1-stall").write_text("1")
    worker = RayWorkerClient("cpu", index=8, env={FAULTS_ENV: str(faults), ONEDNN_ENV: "0"})
    try:
        worker.ensure_model("tiny", str(model_repo), precision="float32")

        def run(job: str) -> Any:
            return worker.separate(
                job,
                "tiny",
                str(model_repo),
                noise(tmp_path / f"{job}.npy", 6.0),
                tmp_path / job,
                control=JobControl(job),
                on_progress=lambda _v: None,
                window=4.0,
                precision="float32",
                stall_seconds=3.0,
            )

        began = time.monotonic()
        with pytest.raises(WorkerStalled) as stalled:
            run("stuck")
        assert time.monotonic() - began < 60
        reason = str(stalled.value)
        assert " on " in reason and "reported no progress for" in reason, reason
        assert "the stall limit is 3 s" in reason, reason
        assert not list(faults.iterdir())  # the fault fired
        worker.ensure_model("tiny", str(model_repo), precision="float32")
        assert run("next").stems  # the restarted actor separates the next song
    finally:
        worker.close()
