"""The Ray executor's client and actor on a real two-node Ray cluster (CPU only), with the
tiny model: placement, one job per actor, data through the object store, cancel, an actor
death, the cluster watch. One cluster (tests/support/ray_cluster.py) serves the module.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

if os.environ.get("CI") == "true":  # .ci/run installs the extra: nothing may skip there
    import ray
else:
    ray = pytest.importorskip(
        "ray", reason="the ray extra is not installed (pip install 'stemdeck-watch[ray]')"
    )

from stemdeck_watch.core.errors import Cancelled, WorkerDied  # noqa: E402
from stemdeck_watch.workers.ray.cluster import PAUSE_CLUSTER, ClusterWatch, probe  # noqa: E402
from stemdeck_watch.workers.ray.actor import ALIVE  # noqa: E402
from stemdeck_watch.workers.ray.client import RayWorkerClient  # noqa: E402
from stemdeck_watch.store.jobqueue import JobControl  # noqa: E402
from stemdeck_watch.workers.separator import DemucsSettings  # noqa: E402
from stemdeck_watch.stages.scratch import AudioReader, AudioWriter  # noqa: E402
from stemdeck_watch.workers.worker import ONEDNN_ENV  # noqa: E402
from stemdeck_watch.engine.scheduler import PAUSE_USER  # noqa: E402

from support.helpers import open_scheduler  # noqa: E402
from support.ray_cluster import two_node_cluster  # noqa: E402

pytestmark = pytest.mark.slow

RATE = 44100


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with two_node_cluster() as made:
        yield made


@pytest.fixture(scope="module")
def workers(cluster: Any, model_repo: Path) -> Iterator[list[RayWorkerClient]]:
    """Two resident workers with the tiny model loaded, one per node (shared: loading costs
    seconds; each test leaves them serving)."""
    clients = [RayWorkerClient("cpu", index=i) for i in range(2)]
    try:
        for client in clients:
            client.ensure_model("tiny", str(model_repo), precision="float32")
        yield clients
    finally:
        for client in clients:
            client.close()


def song(path: Path, seconds: float, seed: int = 0) -> Path:
    """A decoded song as the pipeline's scratch file: (2, frames) float32 noise."""
    audio = np.random.default_rng(seed).standard_normal((2, int(seconds * RATE))) * 0.1
    with AudioWriter(path, 2) as writer:
        writer.write(audio.astype(np.float32))
    return path


def run(
    client: RayWorkerClient,
    job: str,
    model_repo: Path,
    source: Path,
    out: Path,
    control: JobControl | None = None,
    on_progress: Any = None,
    shifts: int = 1,
) -> Any:
    return client.separate(
        job,
        "tiny",
        str(model_repo),
        source,
        out,
        demucs=DemucsSettings(shifts=shifts),
        control=control or JobControl(job),
        on_progress=on_progress or (lambda _v: None),
        window=4.0,
        precision="float32",
    )


def actor_stats(client: RayWorkerClient) -> dict[str, Any]:
    return ray.get(client.actor.stats.remote())


def test_two_workers_on_two_nodes_one_job_each_at_a_time(
    workers: list[RayWorkerClient], model_repo: Path, tmp_path: Path
) -> None:
    """Each worker runs on its own node; jobs run on both at once, never two on one actor,
    and the stems come back whole, window by window."""
    assert len({w.info()["node_id"] for w in workers}) == 2, [w.info() for w in workers]
    source = song(tmp_path / "in.npy", 12.0)
    before = [actor_stats(w)["jobs_run"] for w in workers]
    results: dict[str, Any] = {}

    def serve(client: RayWorkerClient, jobs: list[str]) -> None:
        for job in jobs:
            results[job] = run(client, job, model_repo, source, tmp_path / job)

    threads = [
        threading.Thread(target=serve, args=(w, [f"w{w.index}j{k}" for k in range(2)]))
        for w in workers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(results) == ["w0j0", "w0j1", "w1j0", "w1j1"]
    for job, separation in results.items():
        assert sorted(separation.stems) == ["bass", "drums", "other", "vocals"]
        for path in separation.stems.values():
            assert AudioReader(path).shape == (2, 12 * RATE), (job, path)
            assert np.isfinite(np.load(path)).all()
    for worker, start in zip(workers, before):
        stats = actor_stats(worker)
        assert stats["jobs_run"] - start == 2 and stats["overlaps"] == 0, stats
    assert {w.nodes[-1] for w in workers} == {w.info()["node_id"] for w in workers}


def test_an_actor_refuses_a_second_job_while_one_runs(
    workers: list[RayWorkerClient], model_repo: Path, tmp_path: Path
) -> None:
    """The actor itself holds to one job at a time, whatever a caller does."""
    worker = workers[0]
    source = song(tmp_path / "in.npy", 30.0)
    started = threading.Event()
    second: dict[str, Any] = {}

    def intrude(value: float) -> None:
        if value > 0 and not started.is_set():
            started.set()
            stream = worker.actor.separate.remote("intruder", {"model": "tiny"})
            with pytest.raises(ray.exceptions.RayTaskError) as caught:
                ray.get(next(stream))
            second["error"] = str(caught.value)

    overlaps = actor_stats(worker)["overlaps"]
    run(worker, "first", model_repo, source, tmp_path / "first", on_progress=intrude)
    assert "busy with job first" in second["error"]
    assert actor_stats(worker)["overlaps"] == overlaps + 1


def test_cancel_of_a_running_job_on_a_remote_actor(
    cluster: Any, workers: list[RayWorkerClient], model_repo: Path, tmp_path: Path
) -> None:
    """A cancel stops the job on the worker node at its next segment: no output is left,
    the actor keeps its process and model, and serves the next job."""
    head = cluster.head_node.node_id
    remote = next(w for w in workers if w.info()["node_id"] != head)
    pid = remote.pid
    source = song(tmp_path / "in.npy", 40.0)
    control = JobControl("doomed")
    seen: list[float] = []

    def progress(value: float) -> None:
        seen.append(value)
        if value > 0.1 and not control.cancelled:
            threading.Thread(target=control.cancel, args=("user",)).start()

    with pytest.raises(Cancelled) as caught:
        run(remote, "doomed", model_repo, source, tmp_path / "doomed", control, progress)
    assert caught.value.reason == "user"
    assert max(seen) < 1.0, "the job ran to its end"
    assert not any((tmp_path / "doomed").glob("*.npy")), "partial stems were left behind"
    assert remote.pid == pid and remote.model_info is not None  # cooperative: no restart
    done = run(remote, "next", model_repo, song(tmp_path / "short.npy", 3.0), tmp_path / "next")
    assert done.worker_pid == pid and sorted(done.stems) == ["bass", "drums", "other", "vocals"]


def test_an_actor_killed_mid_job_fails_it_and_is_restarted(
    workers: list[RayWorkerClient], model_repo: Path, tmp_path: Path
) -> None:
    """The worker process dies under a job: the job fails like a local worker death (with a
    diagnosis naming the machine), Ray restarts the actor, the model is loaded again and
    the next job runs."""
    worker = workers[1]
    old = worker.pid
    assert old is not None
    source = song(tmp_path / "in.npy", 40.0)

    killed: list[int] = []

    def kill(value: float) -> None:
        if value > 0.1 and not killed:
            killed.append(old)
            os.kill(old, signal.SIGKILL)

    with pytest.raises(WorkerDied) as caught:
        run(worker, "victim", model_repo, source, tmp_path / "victim", on_progress=kill)
    message = str(caught.value)
    assert "stopped unexpectedly" in message and worker.info()["node_ip"] in message, message
    assert caught.value.details
    assert not any((tmp_path / "victim").glob("*.npy"))
    model = worker.ensure_model("tiny", str(model_repo), precision="float32")
    assert worker.pid not in (None, old) and worker.pids[-2:] == [old, worker.pid]
    assert model.sources == ("drums", "bass", "other", "vocals")
    done = run(worker, "after", model_repo, song(tmp_path / "short.npy", 3.0), tmp_path / "after")
    assert done.worker_pid == worker.pid


def test_stems_equal_the_local_workers(
    workers: list[RayWorkerClient], model_repo: Path, tmp_path: Path
) -> None:
    """The same model code on either executor gives the same samples (shifts=0: no random
    shift; the normalisation statistics given, as the pipeline always gives decode's), so
    the pipeline cannot tell the executors apart by their output."""
    from stemdeck_watch.stages.scratch import stats_of
    from stemdeck_watch.workers.local import WorkerClient

    source = song(tmp_path / "in.npy", 9.0, seed=3)
    options: dict[str, Any] = dict(
        demucs=DemucsSettings(shifts=0, stats=stats_of(source)),
        window=4.0,
        precision="float32",
        on_progress=lambda _v: None,
    )
    remote = workers[0].separate(
        "ray",
        "tiny",
        str(model_repo),
        source,
        tmp_path / "ray",
        control=JobControl("ray"),
        **options,
    )
    local_client = WorkerClient("cpu", threads=1, precision="float32")
    try:
        local_client.ensure_model("tiny", str(model_repo), precision="float32")
        local = local_client.separate(
            "local",
            "tiny",
            str(model_repo),
            source,
            tmp_path / "local",
            control=JobControl("local"),
            **options,
        )
    finally:
        local_client.close()
    for stem, path in local.stems.items():
        np.testing.assert_array_equal(np.load(remote.stems[stem]), np.load(path))


@pytest.fixture
def worker_temp(tmp_path: Path) -> Path:
    """The temp folder (TMPDIR) of a test's own worker: what it leaves there is seen."""
    temp = tmp_path / "actor-temp"
    temp.mkdir()
    return temp


def own_worker(temp: Path, model_repo: Path) -> RayWorkerClient:
    """A worker of its own whose machine's temp folder is `temp` (no CPU of the cluster's
    two reserved: the module's two workers hold those)."""
    client = RayWorkerClient(
        "cpu", threads=1, cpus=0.0, index=7, env={"TMPDIR": str(temp), ONEDNN_ENV: "0"}
    )
    client.ensure_model("tiny", str(model_repo), precision="float32")
    return client


def left_in(temp: Path) -> list[str]:
    """Files the actors left in their temp folder (a live actor's lock file aside)."""
    return sorted(
        str(p.relative_to(temp)) for p in temp.rglob("*") if p.is_file() and p.name != ALIVE
    )


def test_a_failed_write_during_a_job_fails_only_that_job_on_its_worker(
    cluster: Any, worker_temp: Path, model_repo: Path, tmp_path: Path
) -> None:
    """A write on the service's side fails while the worker separates (the registry's
    progress write, say): that job fails, and the worker lets go of it at once, so the next
    song runs there instead of being refused as "busy" with the abandoned one."""
    worker = own_worker(worker_temp, model_repo)
    try:

        def failing_write(value: float) -> None:
            if value > 0.05:
                raise OSError(28, "database or disk is full")

        with pytest.raises(OSError, match="disk is full"):
            run(
                worker,
                "broken",
                model_repo,
                song(tmp_path / "in.npy", 12.0),
                tmp_path / "broken",
                on_progress=failing_write,
            )
        done = run(worker, "next", model_repo, song(tmp_path / "short.npy", 3.0), tmp_path / "next")
        assert sorted(done.stems) == ["bass", "drums", "other", "vocals"]
        assert actor_stats(worker)["overlaps"] == 0
        assert left_in(worker_temp) == []
    finally:
        worker.close()


def test_a_worker_leaves_no_scratch_after_a_refused_upload_a_kill_or_a_close(
    cluster: Any, worker_temp: Path, model_repo: Path, tmp_path: Path
) -> None:
    """A worker's songs in its machine's temp folder do not outlive it: an upload refused
    because the worker is busy is removed; the folder of a worker killed mid-job is removed
    when it restarts; a worker closed mid-job (the service stopping) removes its own."""
    worker = own_worker(worker_temp, model_repo)
    try:
        refused: list[str] = []

        def intrude(value: float) -> None:
            if value > 0 and not refused:
                actor = worker.actor
                ray.get(actor.begin.remote("intruder", 2))
                ray.get(actor.upload.remote("intruder", 0, np.zeros((2, RATE), np.float32)))
                with pytest.raises(ray.exceptions.RayTaskError) as caught:
                    ray.get(next(actor.separate.remote("intruder", {"model": "tiny"})))
                refused.append(str(caught.value))

        run(
            worker,
            "first",
            model_repo,
            song(tmp_path / "in.npy", 12.0),
            tmp_path / "first",
            on_progress=intrude,
        )
        assert "busy with job first" in refused[0]
        assert left_in(worker_temp) == []

        old = worker.pid
        assert old is not None
        killed: list[int] = []

        def kill(value: float) -> None:
            if value > 0.1 and not killed:
                killed.append(old)
                os.kill(old, signal.SIGKILL)

        with pytest.raises(WorkerDied):
            run(
                worker,
                "victim",
                model_repo,
                song(tmp_path / "in.npy", 12.0),
                tmp_path / "victim",
                on_progress=kill,
            )
        worker.ensure_model("tiny", str(model_repo), precision="float32")  # restarted
        assert worker.pid != old and left_in(worker_temp) == []

        closing = threading.Event()
        ended: list[BaseException] = []

        def abandoned() -> None:
            try:
                run(
                    worker,
                    "abandoned",
                    model_repo,
                    song(tmp_path / "in.npy", 40.0),
                    tmp_path / "abandoned",
                    on_progress=lambda v: v > 0.1 and closing.set(),
                )
            except BaseException as exc:  # the close cuts it off
                ended.append(exc)

        thread = threading.Thread(target=abandoned)
        thread.start()
        assert closing.wait(120), "the job never got going"
        worker.close()
        thread.join(60)
        assert ended and not thread.is_alive()
        assert list(worker_temp.iterdir()) == []
    finally:
        worker.close()


def test_a_lost_cluster_pauses_the_queue_until_it_is_back(cluster: Any, settings: Any) -> None:
    """The watch probes the head's address: where nothing answers (a closed port standing in
    for a head that went away) the queue pauses with reason "cluster"; when the live head
    answers again it starts; a pause somebody else chose meanwhile stays."""
    live, dead = cluster.address, "127.0.0.1:1"
    assert probe(live) is None and "does not answer" in (probe(dead) or "")
    scheduler = open_scheduler(settings)
    endpoint = [dead]
    watch = ClusterWatch(scheduler, check=lambda: probe(endpoint[-1]))
    try:
        watch.tick()
        assert scheduler.queue.paused and scheduler.queue.pause_reason == PAUSE_CLUSTER
        assert watch.problem and dead in watch.problem
        endpoint.append(live)
        watch.tick()
        assert not scheduler.queue.paused and watch.problem is None
        endpoint.append(dead)
        watch.tick()
        scheduler.pause(PAUSE_USER)
        endpoint.append(live)
        watch.tick()
        assert scheduler.queue.paused and scheduler.queue.pause_reason == PAUSE_USER
    finally:
        scheduler.registry.close()


def test_a_machine_leaving_mid_job_fails_the_job_and_its_worker_moves(
    cluster: Any, workers: list[RayWorkerClient], model_repo: Path, tmp_path: Path
) -> None:
    """The worker node disappears under a job (the module's last test: the node stays
    gone): the job fails with a diagnosis, the actor is restarted on the machine that is
    left, loads its model again and serves the next job there."""
    head = cluster.head_node.node_id
    local = next(w for w in workers if w.info()["node_id"] == head)
    remote = next(w for w in workers if w.info()["node_id"] != head)
    local.close()  # frees the head's CPU for the worker that has to move
    node = next(n for n in cluster.worker_nodes)
    source = song(tmp_path / "in.npy", 40.0)
    gone: list[bool] = []

    def leave(value: float) -> None:
        if value > 0.1 and not gone:
            gone.append(True)
            threading.Thread(target=cluster.remove_node, args=(node,)).start()

    with pytest.raises(WorkerDied) as caught:
        run(remote, "stranded", model_repo, source, tmp_path / "stranded", on_progress=leave)
    assert "stopped unexpectedly" in str(caught.value) and caught.value.details
    remote.ensure_model("tiny", str(model_repo), precision="float32")
    assert remote.info()["node_id"] == head
    done = run(remote, "moved", model_repo, song(tmp_path / "short.npy", 3.0), tmp_path / "moved")
    assert sorted(done.stems) == ["bass", "drums", "other", "vocals"]
