"""The Ray executor against the local worker: overhead, scaling, cancel latency.

Ten 10 s clips (decoded scratch files, as the pipeline hands them to the worker) go through
the separation client of each executor with the tiny model (`workers/tinymodel.py`), the
model loaded before the clock starts:

- local, 1 and 2 threads: the resident worker subprocess (`WorkerClient`);
- ray, 1 worker (1 CPU, so 1 thread): a private cluster on this machine
  (`executor.address = "local"`); the overhead is against local with 1 thread (the same
  compute), and includes the upload of every window and the stems streamed back;
- ray, 2 workers (1 CPU each): the clips taken in order by whichever worker is free, as the
  dispatcher's workers take them from the one queue;
- ray, 2 workers on two simulated nodes (`ray.cluster_utils.Cluster`, one CPU each);
- cancel latency on the remote node's worker: from `JobControl.cancel` to the client
  raising `Cancelled`, at a random point of a 20 s clip (p50/p95 over `--cancels`).

Reported: median wall seconds for the ten clips over `--rounds`, the overhead of ray/1 over
local/1, the speed-up of ray/2 over ray/1. The machine may be shared: each configuration
waits for a quiet machine first and the cores other processes used are recorded.

    python benchmarks/bench_ray.py [--rounds 3] [--clips 10] [--seconds 10] [--cancels 20]
"""

from __future__ import annotations

import json
import logging
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from harness import (
    cpu_snapshot,
    machine,
    other_cores,
    p95,
    parser as bench_parser,
    tiny_model,
    wait_quiet,
    write_results,
)

RATE = 44100


def make_clips(folder: Path, count: int, seconds: float) -> list[Path]:
    import numpy as np

    from stemdeck_watch.stages.scratch import AudioWriter

    clips = []
    for i in range(count):
        path = folder / f"clip{i}.npy"
        audio = np.random.default_rng(i).standard_normal((2, int(seconds * RATE))) * 0.1
        with AudioWriter(path, 2) as writer:
            writer.write(audio.astype(np.float32))
        clips.append(path)
    return clips


def separate_all(clients: list[Any], clips: list[Path], repo: Path, out: Path) -> float:
    """Wall seconds for every clip, each client taking the next clip in order when free."""
    from stemdeck_watch.store.jobqueue import JobControl

    todo = list(enumerate(clips))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def serve(client: Any) -> None:
        while True:
            with lock:
                if not todo:
                    return
                index, clip = todo.pop(0)
            job = f"clip{index}-{time.monotonic_ns()}"
            try:
                client.separate(
                    job,
                    "tiny",
                    str(repo),
                    clip,
                    out / job,
                    control=JobControl(job),
                    on_progress=lambda _v: None,
                    precision="float32",
                )
            except BaseException as exc:
                errors.append(exc)
                return

    started = time.monotonic()
    threads = [threading.Thread(target=serve, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.monotonic() - started


def measure(
    name: str,
    clients: list[Any],
    clips: list[Path],
    repo: Path,
    root: Path,
    rounds: int,
    quiet: tuple[float, float],
) -> dict[str, Any]:
    """Median wall time of separating `clips` on `clients`, each round after a wait for a
    quiet machine (`quiet`: cores, patience)."""
    for client in clients:
        client.ensure_model("tiny", str(repo), precision="float32")
    walls, loads = [], []
    for r in range(rounds):
        wait_quiet(*quiet)
        before = cpu_snapshot()
        wall = separate_all(clients, clips, repo, root / f"{name}-{r}")
        walls.append(wall)
        loads.append(other_cores(before, wall))
    result = {
        "config": name,
        "walls": [round(w, 3) for w in walls],
        "median": round(statistics.median(walls), 3),
        "other_cores": round(statistics.median(loads), 2),
    }
    print(json.dumps(result), flush=True)
    return result


def ray_clients(count: int, spread: bool) -> list[Any]:
    from stemdeck_watch.workers.ray.client import RayWorkerClient

    return [
        RayWorkerClient("cpu", precision="float32", cpus=1, index=i, spread=spread)
        for i in range(count)
    ]


def with_clients(make: Callable[[], list[Any]], fn: Callable[[list[Any]], Any]) -> Any:
    clients = make()
    try:
        return fn(clients)
    finally:
        for client in clients:
            client.close()


def cancel_latency(client: Any, clip: Path, repo: Path, out: Path, count: int) -> list[float]:
    """Seconds from cancel to `Cancelled` raised, cancelling at a random point of a job."""
    from stemdeck_watch.core.errors import Cancelled
    from stemdeck_watch.store.jobqueue import JobControl

    rng = random.Random(7)
    latencies = []
    for i in range(count):
        control = JobControl(f"cancel{i}")
        point = rng.uniform(0.05, 0.8)
        at: list[float] = []

        def progress(
            value: float, control: JobControl = control, point: float = point, at: list[float] = at
        ) -> None:
            if value >= point and not at:
                at.append(time.monotonic())
                threading.Thread(target=control.cancel, args=("bench",)).start()

        try:
            client.separate(
                control.job_id,
                "tiny",
                str(repo),
                clip,
                out / control.job_id,
                control=control,
                on_progress=progress,
                precision="float32",
            )
        except Cancelled:
            latencies.append(time.monotonic() - at[0])
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "ray", quiet=True, patience=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clips", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cancels", type=int, default=20)
    args = parser.parse_args(argv)
    quiet = (args.quiet, args.patience)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private benchmark cluster
    import ray
    from ray.cluster_utils import Cluster

    from stemdeck_watch.workers.local import WorkerClient

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        root = Path(tmp)
        repo = root / "models"
        tiny_model(repo)
        clips = make_clips(root, args.clips, args.seconds)
        for threads in (1, 2):
            results.append(
                with_clients(
                    lambda threads=threads: [
                        WorkerClient("cpu", threads=threads, precision="float32")
                    ],
                    lambda c, threads=threads: measure(
                        f"local, {threads} thread(s)", c, clips, repo, root, args.rounds, quiet
                    ),
                )
            )
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING
        )
        try:
            for count in (1, 2):
                results.append(
                    with_clients(
                        lambda count=count: ray_clients(count, spread=False),
                        lambda c, count=count: measure(
                            f"ray, {count} worker(s)", c, clips, repo, root, args.rounds, quiet
                        ),
                    )
                )
        finally:
            ray.shutdown()
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, logging_level=logging.WARNING)

            def two_nodes(clients: list[Any]) -> dict[str, Any]:
                result = measure(
                    "ray, 2 workers on 2 nodes", clients, clips, repo, root, args.rounds, quiet
                )
                result["nodes"] = len({c.info()["node_id"] for c in clients})
                head = cluster.head_node.node_id
                remote = next(c for c in clients if c.info()["node_id"] != head)
                (root / "long").mkdir(exist_ok=True)
                long_clip = make_clips(root / "long", 1, 20.0)[0]
                latencies = sorted(cancel_latency(remote, long_clip, repo, root, args.cancels))
                result["cancel"] = {
                    "count": len(latencies),
                    "p50": round(statistics.median(latencies), 3),
                    "p95": round(p95(latencies), 3),
                    "max": round(latencies[-1], 3),
                    "restarts": len(remote.pids) - 1,
                }
                print(json.dumps(result["cancel"]), flush=True)
                return result

            results.append(with_clients(lambda: ray_clients(2, spread=True), two_nodes))
        finally:
            ray.shutdown()
            cluster.shutdown()
    by = {r["config"]: r for r in results}
    summary = {
        "overhead_ray1_vs_local1": round(
            by["ray, 1 worker(s)"]["median"] / by["local, 1 thread(s)"]["median"] - 1, 3
        ),
        "speedup_ray2_vs_ray1": round(
            by["ray, 1 worker(s)"]["median"] / by["ray, 2 worker(s)"]["median"], 2
        ),
        "speedup_2nodes_vs_ray1": round(
            by["ray, 1 worker(s)"]["median"] / by["ray, 2 workers on 2 nodes"]["median"], 2
        ),
    }
    print(json.dumps(summary))
    write_results(
        args.out,
        {
            "machine": machine(),
            "clips": args.clips,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "results": results,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
