"""The executor seam without a cluster: `[executor]` settings, one queue slot per worker,
status and doctor views, and Ray never imported with `kind = "local"`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stemdeck_watch.core.config import default_toml, settings_from_dict
from stemdeck_watch.cli.doctor import check_executor
from stemdeck_watch.core.errors import ConfigError
from stemdeck_watch.workers import executor as pool, ray_installed
from stemdeck_watch.store.jobqueue import JobQueue
from stemdeck_watch.store.registry import REGISTRY_FILE, Registry
from stemdeck_watch.cli.status import render
from stemdeck_watch.store.snapshot import WORKERS_META, build_snapshot as build

REPO = Path(__file__).resolve().parents[2]


def executor(**values: Any) -> Any:
    data = default_toml()
    data["executor"].update(values)
    return settings_from_dict(data)


def fresh_python(code: str) -> Any:
    """Run `code` in a new interpreter; the JSON its last output line holds."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_executor_defaults_to_local_with_one_worker() -> None:
    ex = executor().executor
    assert (ex.kind, ex.address, ex.workers, ex.gpus_per_worker, ex.cpus_per_worker) == (
        "local",
        "auto",
        1,
        0.0,
        1.0,
    )


@pytest.mark.parametrize("address", ["auto", "local", "ray://head.lan:10001", "10.0.0.5:6379"])
def test_cluster_addresses_accepted(address: str) -> None:
    assert executor(kind="ray", address=address).executor.address == address


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("kind", "dask", 'executor.kind = "dask" is not allowed'),
        ("address", "head.lan", "ray://HOST:PORT"),
        ("address", "ray://head:port", "ray://HOST:PORT"),
        ("workers", 0, "executor.workers = 0"),
        ("workers", "all", '"auto" or a whole number'),
        ("gpus_per_worker", -1, "executor.gpus_per_worker"),
    ],
)
def test_bad_executor_values_name_the_key(key: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        executor(**{key: value})
    assert expected in str(caught.value)


@pytest.mark.parametrize("workers", [2, "auto"])
def test_several_local_workers_are_refused(workers: Any) -> None:
    with pytest.raises(ConfigError, match='needs executor.kind = "ray"'):
        pool.build(executor(workers=workers))


@pytest.mark.parametrize(
    "resources,expected",
    [
        ({"CPU": 8.0}, (4, 0.0)),  # a CPU machine: one worker per cpus_per_worker cores
        ({"CPU": 1.0}, (0, 0.0)),  # too small for one
        ({"CPU": 16.0, "GPU": 2.0}, (2, 1.0)),  # one per GPU
        ({"CPU": 2.0, "GPU": 4.0}, (1, 1.0)),  # … as far as its cores go
    ],
)
def test_auto_workers_per_machine(resources: dict[str, float], expected: tuple[int, float]) -> None:
    """`workers = "auto"`: what each machine of the cluster holds (2 cores a worker here)."""
    from stemdeck_watch.workers.ray.cluster import workers_for

    assert workers_for(resources, 0.0, 2.0) == expected


def test_local_executor_never_imports_ray() -> None:
    """Everything the service, CLI, doctor and status load with kind = "local" leaves Ray
    unimported (checked in a fresh interpreter: this one may have imported it)."""
    code = (
        "import sys, json\n"
        "from stemdeck_watch import service\n"
        "from stemdeck_watch.cli import main as cli, doctor, status\n"
        "from stemdeck_watch.engine import dispatcher\n"
        "from stemdeck_watch.core.config import default_toml, settings_from_dict\n"
        "from stemdeck_watch.workers import executor as pool\n"
        "s = settings_from_dict(default_toml())\n"
        "ex = pool.build(s)\n"
        "print(json.dumps([type(c).__name__ for c in ex.clients]))\n"
        "doctor.check_executor(s)\n"
        "ex.close()\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    assert fresh_python(code) == ["WorkerClient"]


def test_doctor_names_the_executor_and_the_recorded_workers(settings: Any) -> None:
    assert "local: one resident worker process" in check_executor(executor())[0].detail
    [finding] = check_executor(executor(kind="ray", workers=3, gpus_per_worker=1))
    if ray_installed():
        assert finding.ok and "3 worker(s) of 1 GPU and 1 CPU each" in finding.detail
    else:
        assert not finding.ok and "pip install 'stemdeck-watch[ray]'" in finding.detail
    registry = Registry.open(settings.paths.state / REGISTRY_FILE)
    registry.set_meta(
        WORKERS_META,
        json.dumps(
            [
                {
                    "index": i,
                    "hostname": f"box{i}",
                    "node_ip": f"10.0.0.{i}",
                    "device": "cuda",
                    "threads": 4,
                    "pid": 70 + i,
                }
                for i in range(2)
            ]
        ),
    )
    registry.close()
    lines = [f.line() for f in check_executor(settings)]
    assert lines[1:] == [
        "[ok  ] worker 0: box0 (10.0.0.0), cuda, 4 thread(s), pid 70 (as last recorded)",
        "[ok  ] worker 1: box1 (10.0.0.1), cuda, 4 thread(s), pid 71 (as last recorded)",
    ]


def test_one_queue_slot_per_worker() -> None:
    """Two consumers each take the next job in order; each slot holds one; a cancel finds
    either; one consumer alone behaves as the single slot always did."""
    queue = JobQueue()
    for job in ("a", "b", "c"):
        queue.put(job)
    first, second = queue.take(0, slot=0), queue.take(0, slot=1)
    assert first is not None and second is not None
    assert (first.job_id, second.job_id) == ("a", "b") and queue.order() == ["c"]
    assert queue.set_running(first, slot=0) and queue.set_running(second, slot=1)
    assert {c.job_id for c in queue.in_flight()} == {"a", "b"}
    assert queue.running() is first
    assert queue.cancel("b", "user") == "running" and second.cancelled
    queue.finish(second)
    assert [c.job_id for c in queue.in_flight()] == ["a"]
    queue.cancel_running("stop")
    assert first.cancelled
    queue.finish(first)
    assert queue.running() is None and queue.in_flight() == []
    third = queue.take(0)  # the single consumer: slot 0
    assert third is not None and queue.running() is third and queue.set_running(third)


def test_status_lists_every_worker(settings: Any) -> None:
    workers = [
        {
            "executor": "ray",
            "index": i,
            "pid": 100 + i,
            "node_ip": f"10.0.0.{i + 1}",
            "hostname": f"box{i}",
            "device": "cuda",
            "job": "song" if i else None,
        }
        for i in range(2)
    ]
    status = build(
        [],
        [],
        [],
        "cluster",
        settings.paths,
        {"running": True, "pid": 1},
        worker=workers[0],
        workers=workers,
    )
    assert status["workers"] == workers and status["pause_reason"] == "cluster"
    text = render(status)
    assert "the Ray cluster is unreachable" in text
    assert "worker 0: box0 (10.0.0.1), cuda, pid 100, idle" in text
    assert "worker 1: box1 (10.0.0.2), cuda, pid 101, song" in text
    local = build(
        [],
        [],
        [],
        None,
        settings.paths,
        {"running": False, "pid": None},
        worker={"pid": 5, "device": "cpu"},
    )
    assert local["workers"] == [{"pid": 5, "device": "cpu"}]


@pytest.mark.slow
@pytest.mark.skipif(not ray_installed(), reason="the ray extra is not installed")
def test_connecting_a_private_cluster_and_a_dead_address() -> None:
    """`address = "local"` starts a private cluster that `close` stops again; an address
    where nothing listens fails at once with what to check (a fresh interpreter: connecting
    is once per process)."""
    code = (
        "import json, os\n"
        "os.environ['RAY_AUTH_MODE'] = 'disabled'\n"
        "from stemdeck_watch.core.errors import ConfigError\n"
        "from stemdeck_watch.workers.ray.cluster import connect, nodes, probe\n"
        "out = {}\n"
        "try:\n"
        "    connect('127.0.0.1:1')\n"
        "except ConfigError as exc:\n"
        "    out['dead'] = str(exc)\n"
        "c = connect('local')\n"
        "out['probe'], out['nodes'], out['owned'] = probe(), len(nodes()), c.owned\n"
        "c.close()\n"
        "import ray\n"
        "out['after'] = ray.is_initialized()\n"
        "print(json.dumps(out))\n"
    )
    out = fresh_python(code)
    assert (
        "could not connect to the Ray cluster at executor.address = '127.0.0.1:1'" in out["dead"]
        and "ray start --head" in out["dead"]
    )
    assert out["probe"] is None and out["nodes"] == 1 and out["owned"] is True
    assert out["after"] is False


def test_windows_of_a_song_arriving_out_of_order_are_stored_in_order(tmp_path: Path) -> None:
    """The actor runs a few calls at once, so two windows uploaded back to back may arrive
    in either order: the song is still stored in its own order, and a missing window fails
    the job instead of separating a scrambled song."""
    pytest.importorskip("ray", reason="the Ray executor needs the ray extra")
    import numpy as np

    from stemdeck_watch.workers.ray.actor import _Upload
    from stemdeck_watch.stages.scratch import AudioReader, AudioWriter

    song = np.arange(2 * 30, dtype=np.float32).reshape(2, 30)
    windows = [song[:, i : i + 10] for i in range(0, 30, 10)]
    upload = _Upload(tmp_path, AudioWriter(tmp_path / "input.npy", 2))
    for index in (2, 0, 1):
        upload.add(index, windows[index])
    upload.close()
    np.testing.assert_array_equal(AudioReader(tmp_path / "input.npy").read(0, 30), song)

    gap = _Upload(tmp_path, AudioWriter(tmp_path / "gap.npy", 2))
    gap.add(0, windows[0])
    gap.add(2, windows[2])
    with pytest.raises(RuntimeError, match="window 1 of the song never arrived"):
        gap.close()
