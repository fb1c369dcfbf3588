"""The whole service with `executor.kind = "ray"` on a real two-node Ray cluster: the same
inbox, queue, registry and outbox, separation on resident Ray workers (tiny model).

One cluster (tests/support/ray_cluster.py: two nodes of one CPU each, so two one-CPU workers land on
two nodes) serves the module. A service in this process uses the test's Ray connection; the
service killed in the restore test is a child process that joins the same cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import soundfile

if os.environ.get("CI") == "true":  # .ci/run installs the extra: nothing may skip there
    import ray
else:
    ray = pytest.importorskip(
        "ray", reason="the ray extra is not installed (pip install 'stemdeck-watch[ray]')"
    )

from stemdeck_watch.core.config import settings_from_dict  # noqa: E402
from stemdeck_watch.core.events import JobChanged  # noqa: E402
from stemdeck_watch.core.jobs import JobState  # noqa: E402
from stemdeck_watch.cli.status import collect  # noqa: E402
from stemdeck_watch.stages.manifest import read_manifest  # noqa: E402
from stemdeck_watch.util.synth import write_song  # noqa: E402

from support.helpers import REPO, config_data, wait_for, write_config  # noqa: E402
from support.ray_cluster import two_node_cluster  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with two_node_cluster() as made:
        yield made


def drop(settings: Any, name: str, seconds: float, seed: int = 0) -> Path:
    """A song written beside the inbox and renamed in (complete at once)."""
    staged = write_song(settings.paths.inbox.parent / "staging" / name, seconds, seed=seed)
    target = settings.paths.inbox / name
    staged.rename(target)
    return target


def ray_settings(make_settings: Callable[..., Any], workers: int) -> Any:
    return make_settings(executor={"kind": "ray", "address": "auto", "workers": workers})


def started_order(service: Any) -> list[str]:
    """Job names in the order they first left "queued" for a running state."""
    order: list[str] = []
    lock = threading.Lock()

    def seen(event: JobChanged) -> None:
        with lock:
            if event.job.state.is_running and event.job.name not in order:
                order.append(event.job.name)

    service.bus.subscribe(JobChanged, seen)
    return order


def test_songs_run_on_workers_on_both_nodes_one_job_each(
    cluster: Any, make_settings: Any, service_factory: Any
) -> None:
    """Two workers, one per node, take the songs from the one queue in order, never two on
    one worker; stems are published as with the local worker; status shows the workers."""
    settings = ray_settings(make_settings, 2)
    service, jobs = service_factory(settings)
    order = started_order(service)
    wait_for(
        lambda: all(c.model_info for c in service.executor.clients),
        120,
        "both workers to load the model",
    )
    for i, name in enumerate(("a.wav", "b.wav", "c.wav", "d.wav")):
        drop(settings, name, 6.0, seed=i)
    done = jobs.wait_final(4, 240)
    assert sorted(j.state for j in done) == [JobState.DONE] * 4, [(j.name, j.error) for j in done]
    assert sorted(p.name for p in settings.paths.outbox.iterdir() if p.is_dir()) == [
        "a",
        "b",
        "c",
        "d",
    ]
    assert set(order[:2]) == {"a", "b"} and set(order[2:]) == {"c", "d"}, order
    clients = service.executor.clients
    assert len({node for c in clients for node in c.nodes}) == 2, [c.nodes for c in clients]
    stats = [ray.get(c.actor.stats.remote()) for c in clients]
    assert sum(s["jobs_run"] for s in stats) == 4 and all(s["overlaps"] == 0 for s in stats)
    workers = service.scheduler.snapshot()["workers"]
    assert [w["index"] for w in workers] == [0, 1]
    assert len({w["node_id"] for w in workers}) == 2 and all(w["device"] == "cpu" for w in workers)


def test_pause_start_cancel_and_a_worker_death(
    cluster: Any, make_settings: Any, service_factory: Any
) -> None:
    """Pause holds new songs; Start runs them; a cancel stops a running job on its worker
    (the input stays, nothing in the outbox); a worker killed mid-job is a machine fault: Ray
    restarts it and the song, back at the head of the queue, is done on the next attempt
    (nothing in failed/), the attempt cut off on record; the next song is done too."""
    settings = ray_settings(make_settings, 1)
    service, jobs = service_factory(settings)
    scheduler = service.scheduler
    scheduler.pause()
    held = drop(settings, "held.wav", 3.0)
    wait_for(lambda: scheduler.queue.order(), 30, "the song to be queued")
    job = scheduler.registry.latest_for_source(str(held))
    assert job is not None and job.state is JobState.QUEUED and scheduler.queue.paused
    scheduler.start()
    assert jobs.wait_final(1, 120)[0].state is JobState.DONE

    client = service.executor.clients[0]
    long_song = drop(settings, "long.wav", 40.0, seed=1)
    running = wait_for(
        lambda: next(
            (
                j
                for j in jobs.jobs()
                if j.name == "long" and j.state is JobState.SEPARATING and j.progress > 0.3
            ),
            None,
        ),
        120,
        "the long song to be separating",
    )
    scheduler.cancel_job(running.id)
    final = wait_for(
        lambda: next((j for j in jobs.final() if j.name == "long"), None), 30, "the cancel"
    )
    assert final.state is JobState.CANCELLED and long_song.exists()
    assert not (settings.paths.outbox / "long").exists()

    victim = drop(settings, "victim.wav", 40.0, seed=2)
    wait_for(
        lambda: next(
            (
                j
                for j in jobs.jobs()
                if j.name == "victim" and j.state is JobState.SEPARATING and j.progress > 0.3
            ),
            None,
        ),
        120,
        "the victim to be separating",
    )
    pid = client.pid
    os.kill(pid, signal.SIGKILL)
    again = wait_for(
        lambda: next((j for j in jobs.final() if j.name == "victim"), None),
        180,
        "the victim to be done on its second attempt",
    )
    assert again.state is JobState.DONE, again.error
    [fault] = again.faults
    assert "stopped unexpectedly" in fault.reason and fault.worker.startswith("ray worker 0")
    assert not victim.exists() and list(settings.paths.failed.iterdir()) == []
    drop(settings, "after.wav", 3.0, seed=3)
    after = wait_for(
        lambda: next((j for j in jobs.final() if j.name == "after"), None), 120, "the next song"
    )
    assert after.state is JobState.DONE and client.pid not in (None, pid)


def test_restore_after_a_service_kill_with_the_cluster_still_up(
    cluster: Any, tmp_path: Path, model_repo: Path, service_factory: Any
) -> None:
    """A service (a child process on the same cluster) is killed mid-job; the next service
    finds the job cut off, puts it back at the head of a restore-paused queue, and after
    Start it is separated on a fresh worker."""
    config = write_config(
        tmp_path, model_repo, executor={"kind": "ray", "address": cluster.address, "workers": 1}
    )
    settings = settings_from_dict(
        config_data(
            tmp_path, model_repo, executor={"kind": "ray", "address": "auto", "workers": 1}
        ),
        source=config,
    )
    settings.paths.inbox.mkdir(parents=True)
    drop(settings, "cut.wav", 40.0)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    with open(tmp_path / "service.log", "wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "stemdeck_watch", "run", "--no-tray", "--config", str(config)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def separating() -> bool:
            jobs = collect(settings)["jobs"]
            return bool(jobs) and jobs[0]["state"] == "separating" and jobs[0]["progress"] > 0.2

        wait_for(
            lambda: separating() or child.poll() is not None,
            180,
            "the child service to be separating",
        )
        assert child.poll() is None, (tmp_path / "service.log").read_text()[-3000:]
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
    service, jobs = service_factory(settings)
    scheduler = service.scheduler
    assert scheduler.queue.paused and scheduler.queue.pause_reason == "restore"
    [restored] = scheduler.registry.jobs()
    assert restored.state is JobState.QUEUED and restored.attempts == 1
    scheduler.start()
    done = jobs.wait_final(1, 240)[0]
    assert done.state is JobState.DONE and (settings.paths.outbox / "cut").is_dir()


def test_a_song_tagged_best_on_a_ray_worker_gets_roformer_vocals_and_stems_that_add_up(
    cluster: Any, recipe_repo: Path, tmp_path: Path, service_factory: Any
) -> None:
    """A recipe on the Ray executor: the actor's worker runs the RoFormer on the mix and
    Demucs on what it left, as the local worker does; the manifest names both models and
    the stems add up to the mix. The checkpoint is read where the actor runs (here: both
    nodes are this machine; on a cluster, `models pull` on each worker machine)."""
    data = config_data(tmp_path, recipe_repo, executor={"kind": "ray", "address": "auto"})
    data["output"].update(format="wav", bit_depth=32)
    settings = settings_from_dict(data, source=tmp_path / "stemdeck.toml")
    service, jobs = service_factory(settings)
    drop(settings, "Song [best].wav", 2.0)
    [job] = jobs.wait_final(1, 240)
    assert job.state is JobState.DONE, job.error
    folder = Path(job.output or "")
    manifest = read_manifest(folder)
    roformer = "bs_roformer_viperx_1297"
    assert manifest["recipe"] == {"name": "best", "vocals": roformer, "rest": "htdemucs_ft"}
    made_by = manifest["model"]["made_by"]
    assert made_by == {
        "vocals": roformer,
        "drums": "htdemucs_ft",
        "bass": "htdemucs_ft",
        "other": "htdemucs_ft",
    }
    assert manifest["levels"]["residual_db"] < -100
    stems = [soundfile.read(folder / f"{s}.wav", dtype="float64")[0] for s in made_by]
    mix, _ = soundfile.read(settings.paths.processed / "Song [best].wav", dtype="float64")
    assert np.max(np.abs(sum(stems) / manifest["levels"]["gain"] - mix)) < 1e-5


def test_a_recipe_whose_checkpoint_a_ray_worker_lacks_fails_the_song_saying_what_to_do(
    cluster: Any, model_repo: Path, tmp_path: Path, service_factory: Any
) -> None:
    """A worker machine without the recipe's RoFormer: the song fails naming the files and
    where they go, as on the local worker, and is not taken for a fault of the machine."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copy(model_repo / "tiny.th", repo / "tiny.th")
    (repo / "htdemucs_ft.yaml").write_text("models: ['tiny']\n")
    data = config_data(tmp_path, repo, executor={"kind": "ray", "address": "auto"})
    service, jobs = service_factory(settings_from_dict(data, source=tmp_path / "stemdeck.toml"))
    drop(service.settings, "Song [best].wav", 1.0)
    [job] = jobs.wait_final(1, 240)
    assert job.state is JobState.FAILED
    assert "model_bs_roformer_ep_317_sdr_12.9755.ckpt" in (job.error or ""), job.error
    assert f"separation.model_repo ({repo})" in (job.error or ""), job.error
    assert job.faults == (), job.faults
